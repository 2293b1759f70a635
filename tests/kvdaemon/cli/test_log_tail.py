"""``kvdaemon logs``: the last lines of the daemon's log, and following it across rotations."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvdaemon.cli import log_tail
from kvdaemon.cli.commands import main
from kvdaemon.errors import ConfigError


def log_dir(tmp_path: Path, text: str) -> Path:
    """A daemon directory (0700) whose kvdaemon.log holds ``text``."""
    root = tmp_path / "run"
    root.mkdir(mode=0o700)
    (root / "kvdaemon.log").write_text(text)
    return root


def lines_of(n: int, start: int = 0) -> list[str]:
    return [f"line {i} " + "x" * (i % 97) for i in range(start, start + n)]


@pytest.mark.parametrize("num_lines", [0, 1, 7, 5000])
def test_the_last_lines_are_read_from_the_end_across_blocks(tmp_path: Path, num_lines: int) -> None:
    written = lines_of(3000)  # ~200 KB: several blocks
    root = log_dir(tmp_path, "\n".join(written) + "\n")
    fd = log_tail.open_log(root / "kvdaemon.log")
    try:
        lines, size = log_tail.last_lines(fd, num_lines)
    finally:
        os.close(fd)
    assert lines == (written[-num_lines:] if num_lines else [])
    assert size == (root / "kvdaemon.log").stat().st_size


def test_a_partial_last_line_is_shown_and_lines_end_at_newlines_only(tmp_path: Path) -> None:
    root = log_dir(tmp_path, "one\ntwo \x0c\r\u2028 still two\nthree, half")
    fd = log_tail.open_log(root / "kvdaemon.log")
    assert log_tail.last_lines(fd, 2)[0] == ["two \x0c\r\u2028 still two", "three, half"]
    os.close(fd)
    os.mkfifo(tmp_path / "fifo.log")
    with pytest.raises(ConfigError, match="not a regular file"):
        log_tail.open_log(tmp_path / "fifo.log")  # refused before it is opened: no wait for a writer


def test_a_missing_file_a_symlink_and_a_directory_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no log file at"):
        log_tail.open_log(tmp_path / "absent.log")
    (tmp_path / "real.log").write_text("secret\n")
    (tmp_path / "link.log").symlink_to(tmp_path / "real.log")
    with pytest.raises(ConfigError, match="cannot read the log file"):
        log_tail.open_log(tmp_path / "link.log")
    with pytest.raises(ConfigError, match="not a regular file"):
        log_tail.open_log(tmp_path)


def test_follow_reads_on_across_a_rename_and_a_truncation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(log_tail, "FOLLOW_POLL_S", 0.01)
    path = log_dir(tmp_path, "old 1\n") / "kvdaemon.log"
    fd = log_tail.open_log(path)
    _, size = log_tail.last_lines(fd, 10)
    done = threading.Event()
    follower = log_tail.follow(path, fd, size, done.is_set)

    def append(text: str) -> None:
        with path.open("a") as log:
            log.write(text)

    append("old 2\npart")
    assert next(follower) == "old 2"
    append("ial\n")
    assert next(follower) == "partial"  # a line is printed whole
    append("old 3\n")
    path.rename(path.with_suffix(".1"))  # logrotate's create: the old file is read to its end first
    path.write_text("new 1\n")
    assert [next(follower), next(follower)] == ["old 3", "new 1"]
    path.write_text("c\n")  # copytruncate: shorter than what was read, so read from its start
    assert next(follower) == "c"
    done.set()
    assert list(follower) == []


def test_the_command_prints_the_last_lines_and_json(tmp_path: Path) -> None:
    written = lines_of(60)
    root = log_dir(tmp_path, "\n".join(written) + "\n")
    text = CliRunner().invoke(main, ["logs", "--dir", str(root), "-n", "5"])
    assert (text.exit_code, text.output.splitlines()) == (0, written[-5:])
    default = CliRunner().invoke(main, ["logs", "--dir", str(root)])
    assert default.output.splitlines() == written[-40:]
    as_json = CliRunner().invoke(main, ["logs", "--dir", str(root), "-n", "2", "--json"])
    assert json.loads(as_json.output) == {"log_file": str(root / "kvdaemon.log"), "lines": written[-2:]}
    both = CliRunner().invoke(main, ["logs", "--dir", str(root), "--follow", "--json"])
    assert both.exit_code == 2 and json.loads(both.output)["error"]["code"] == "USAGE"
    bad = CliRunner().invoke(main, ["logs", "--dir", str(root), "-n", "-1"])
    assert bad.exit_code == 2


def test_the_command_reads_the_log_file_the_config_names(tmp_path: Path) -> None:
    root = log_dir(tmp_path, "")
    other = tmp_path / "elsewhere.log"
    other.write_text("from the config's file\n")
    config = tmp_path / "kvdaemon.toml"
    config.write_text(f'dir = "{root}"\nlog-file = "{other}"\n')
    done = CliRunner().invoke(main, ["logs", "--config", str(config)])
    assert (done.exit_code, done.output) == (0, "from the config's file\n")
    missing = CliRunner().invoke(main, ["logs", "--dir", str(tmp_path / "none")])
    assert missing.exit_code == 2 and "no log file at" in missing.output
    flag = CliRunner().invoke(main, ["logs", "--dir", str(root), "--log-file", str(other)])
    assert (flag.exit_code, flag.output) == (0, "from the config's file\n")  # as `start --log-file` was given
