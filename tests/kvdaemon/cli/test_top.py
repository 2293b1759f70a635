"""``kvdaemon top``: the pure frame, ``--once`` against a real daemon, and the live
loop on a pseudo-terminal (quits on ``q`` and Ctrl-C, survives the daemon going away)."""

from __future__ import annotations

import fcntl
import io
import os
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from kvdaemon.cli import top_view
from kvdaemon.cli.top_view import GLYPHS

FILLED, EMPTY, _ = GLYPHS[True]
from tests.conftest import small_spec
from tests.kvdaemon.cli import test_cli_lifecycle as lifecycle_tests
from tests.kvdaemon.cli.test_cli_lifecycle import Cli
from tests.kvdaemon.cli.test_status_view import make_status, make_tenant

MiB = 1024 * 1024
cli = lifecycle_tests.cli  # the fixture: a detached daemon's directory, cleaned up after
ROOT = Path("/tmp/kvd")


def rendered(status: dict[str, Any] | None, footer: str | None = None, sort: str = "mapped",
             width: int = 80) -> str:  # fmt: skip
    out = io.StringIO()
    frame = top_view.frame(ROOT, status, footer, sort)
    Console(file=out, width=width, color_system=None).print(frame)
    return out.getvalue()


def row_of(text: str, name: str) -> str:
    (row,) = [line for line in text.splitlines() if line.startswith(name + " ")]
    return row


def names_in(text: str) -> list[str]:
    body = text.splitlines()[3:]  # two header lines and the column titles
    footers = ("q quit", top_view.NO_SLEEP_LEGEND)
    return [line.split()[0] for line in body if line and not line.startswith(footers)]


THREE = [
    make_tenant(sleepable=True),  # 1.5 GiB mapped of an 8 GiB limit, idle 3m05s
    make_tenant(name="[bold]x", pid=7, state="sleeping-warm", mapped_bytes=0, used_bytes=0,
                max_bytes=None, idle_seconds=4000, sleepable=False),
    make_tenant(name="over", mapped_bytes=3072 * MiB, used_bytes=3000 * MiB,
                max_bytes=2048 * MiB, idle_seconds=2, refused_grows=12, sleepable=False),
]  # fmt: skip


# -- the frame -------------------------------------------------------------------------------


def test_usage_bar() -> None:
    assert top_view.usage_bar(0, 100, width=10).plain == EMPTY * 10 + "   0%"
    assert top_view.usage_bar(25, 100, width=10).plain == FILLED * 2 + EMPTY * 8 + "  25%"
    assert top_view.usage_bar(1, 1000, width=10).plain == FILLED + EMPTY * 9 + "   0%"
    assert top_view.usage_bar(150, 100, width=10).plain == FILLED * 10 + " 150%"
    assert top_view.usage_bar(0, 0, width=10).plain == EMPTY * 10 + "   0%"
    assert top_view.usage_bar(5, 0, width=10).plain == FILLED * 10 + " 100%"


def test_frame_with_tenants_at_80_columns() -> None:
    footer = top_view.help_line("mapped", 1.0)
    text = rendered(make_status(THREE), footer=footer)
    lines = text.splitlines()
    assert lines[0] == "kvdaemon at /tmp/kvd · backend host · page 2.00 MiB · 3 tenant(s)"
    assert lines[1] == (
        "capacity 4.00 GiB · free 1.00 GiB · mapped " + FILLED * 15 + EMPTY * 5 + "  75%"
    )
    assert lines[2].split() == ["name", "state", "mapped", "in", "use", "limit", "%", "of", "limit",
                                "idle", "owes", "refused"]  # fmt: skip
    assert len(lines) == 3 + 3 + 2  # one line per tenant: nothing wrapped; the legend of *
    assert lines[-2] == "* cannot be slept: its engine has no quiesce hook"
    assert all(len(line) <= 80 for line in lines)
    assert lines[-1] == footer == (
        "q quit · sort by m mapped, u in use, n name, i idle, s state [mapped] · 1s"
    )

    assert row_of(text, "llama-a").split() == [
        "llama-a", "active", "1.50G", "512M", "8.00G", FILLED + EMPTY * 2, "19%", "3m05s", "-", "-",
    ]  # fmt: skip
    assert row_of(text, "[bold]x").split() == [  # names are not markup; state in words
        "[bold]x", "asleep", "(warm)", "0", "0", "none", EMPTY * 3, "0%", "1h06m", "-", "-",
    ]  # fmt: skip
    assert row_of(text, "over").split() == [  # over its limit: a full bar, what it owes, refusals;
        "over", "active*", "3.00G", "2.93G", "2.00G", FILLED * 3, "150%", "2s", "1.00G", "12",
    ]  # fmt: skip  # and it cannot be slept


def test_a_long_name_is_cut_not_wrapped() -> None:
    tenant = make_tenant(name="llama-3-70b-instruct-production-replica-7", refused_grows=123456,
                         idle_seconds=359999, sleepable=False)  # fmt: skip
    lines = rendered(make_status([tenant])).splitlines()
    assert len(lines) == 5 and all(len(line) <= 80 for line in lines)
    assert lines[3].startswith("llama-3-70b-i… active*")
    assert lines[3].split()[-3:] == ["99h59m", "-", "123456"]


def test_a_wide_console_shows_whole_names() -> None:
    name = "llama-3.1-8b-instruct-" + "x" * 106  # 128 characters, the longest a name may be
    lines = rendered(make_status([make_tenant(name=name)]), width=200).splitlines()
    assert lines[3].startswith(name + " active")  # piped output is 200 wide: never cut
    cut = rendered(make_status([make_tenant(name=name)]), width=100).splitlines()[3]
    assert cut.startswith(name[:33] + "… active") and len(cut) <= 100  # what 100 columns leave


def test_an_ascii_console_gets_ascii_glyphs() -> None:
    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding="ascii")
    name = "llama-3-70b-instruct-production-replica-7"
    Console(file=out, width=80, color_system=None).print(
        top_view.frame(ROOT, make_status([make_tenant(name=name)]), "q quit · 1s")
    )
    out.flush()
    lines = raw.getvalue().decode("ascii").splitlines()
    assert lines[0].startswith(f"kvdaemon at {ROOT} | backend host | page ")
    assert "#" in lines[1] and "." in lines[1]
    assert lines[3].startswith("llama-3-70b-in active")  # cut without an ellipsis
    assert lines[-1] == "q quit | 1s"


@pytest.mark.parametrize(
    ("sort", "order"),
    [
        ("mapped", ["over", "llama-a", "[bold]x"]),
        ("used", ["over", "llama-a", "[bold]x"]),
        ("name", ["[bold]x", "llama-a", "over"]),
        ("idle", ["[bold]x", "llama-a", "over"]),
        ("state", ["llama-a", "over", "[bold]x"]),
    ],
)
def test_sort_keys(sort: str, order: list[str]) -> None:
    assert names_in(rendered(make_status(THREE), sort=sort)) == order


def test_unknown_sort_key_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown sort key 'pid'"):
        top_view.sorted_tenants(THREE, "pid")


def test_state_words() -> None:
    assert [top_view.state_words(s) for s in ("active", "sleeping-warm", "sleeping-cold")] == [
        "active", "asleep (warm)", "asleep (cold)",
    ]  # fmt: skip
    assert top_view.state_words("going-to-sleep") == "going to sleep"


def test_frame_without_tenants() -> None:
    lines = rendered(make_status([])).splitlines()
    assert lines[1].startswith("capacity 4.00 GiB · free 1.00 GiB · mapped " + FILLED)
    assert lines[2:] == ["no tenants registered"]


def test_frame_when_unreachable() -> None:
    text = rendered(None, footer="q quits")
    assert text.splitlines() == ["kvdaemon at /tmp/kvd: daemon unreachable, retrying", "q quits"]


# -- the real command ------------------------------------------------------------------------


def test_top_once_shows_each_tenant(cli: Cli) -> None:
    cli.started_pid()
    client = cli.client()
    first = client.register(
        "llama-a", small_spec(), max_bytes=16 * MiB, min_bytes=4 * MiB, num_spare_pages=0
    )
    second = client.register("qwen-b", small_spec(), weight=2.0, num_spare_pages=0)
    try:
        first.alloc(1)  # maps one logical page (2 segments x 2 MiB), no spare
        for args in (("top", "--once"), ("top",)):  # stdout is no terminal: one frame either way
            done = cli.run(*args)
            assert done.returncode == 0, done.stderr
            lines = done.stdout.splitlines()
            assert lines[0] == f"kvdaemon at {cli.dir} · backend host · page 2.00 MiB · 2 tenant(s)"
            assert lines[1].startswith("capacity 64.0 MiB · free 60.0 MiB · mapped ")
            assert names_in(done.stdout) == ["llama-a", "qwen-b"]  # by mapped bytes
            cells = row_of(done.stdout, "llama-a").split()
            assert cells[:3] + cells[4:6] == [  # in use: as the last heartbeat said
                "llama-a", "active*", "4.00M", "16.0M", FILLED + EMPTY * 2,
            ]  # fmt: skip  # no quiesce hook: it cannot be slept
            assert row_of(done.stdout, "qwen-b").split()[:3] == ["qwen-b", "active*", "0"]
        by_name = cli.run("top", "--sort", "name")
        assert names_in(by_name.stdout) == ["llama-a", "qwen-b"]
        bad = cli.run("top", "--sort", "pid")
        assert bad.returncode == 2 and "'pid' is not one of" in bad.stderr
    finally:
        first.close()
        second.close()
        client.close()


def test_top_once_prints_on_a_non_utf8_stdout(cli: Cli) -> None:
    cli.started_pid()
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    done = subprocess.run([sys.executable, "-m", "kvdaemon", "top", "--once", "--dir", str(cli.dir)],
                          capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == f"kvdaemon at {cli.dir} | backend host | page 2.00 MiB | 0 tenant(s)"


def test_top_once_without_a_daemon_exits_1(cli: Cli) -> None:
    done = cli.run("top", "--once")
    status = cli.run("status")
    assert done.returncode == status.returncode == 1
    assert done.stderr == status.stderr
    assert done.stderr.strip() == f"no kvdaemon running at {cli.dir} — start it with `kvdaemon start`"
    assert done.stdout == ""


# -- the live loop on a pseudo-terminal ------------------------------------------------------


@dataclass
class Terminal:
    """``kvdaemon top`` with its stdout (and maybe stdin) on a pseudo-terminal."""

    child: subprocess.Popen[bytes]
    master: int
    output: bytearray = field(default_factory=bytearray)

    def text(self) -> str:
        return self.output.decode(errors="replace")

    def wait_for(self, needle: str, after: int = 0, timeout_s: float = 30.0) -> int:
        """Wait until ``needle`` appears at or after output offset ``after``; return its offset."""
        deadline = time.monotonic() + timeout_s
        while (found := self.text().find(needle, after)) < 0:
            assert self.child.poll() is None, f"top exited {self.child.returncode}: {self.text()}"
            assert time.monotonic() < deadline, f"no {needle!r} in {self.text()!r}"
            time.sleep(0.02)
        return found

    def echo_and_cbreak(self) -> tuple[bool, bool]:
        """Whether the terminal echoes and reads by lines (what cbreak mode turns off)."""
        lflag = termios.tcgetattr(self.master)[3]
        return bool(lflag & termios.ECHO), bool(lflag & termios.ICANON)


def _ctrl_c_as_on_a_terminal() -> None:
    """SIGINT back to its default in the child: a test run started in the background
    (``cmd &`` in a script) ignores SIGINT, and a child would inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextmanager
def top_on_a_terminal(cli: Cli, *, keys: bool = True) -> Iterator[Terminal]:
    """Run ``kvdaemon top --interval 0.2`` on a fresh pty; its stdin too when ``keys``."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))
    child = subprocess.Popen(
        [sys.executable, "-m", "kvdaemon", "top", "--interval", "0.2", "--dir", str(cli.dir)],
        stdin=slave if keys else subprocess.DEVNULL, stdout=slave, stderr=slave,
        start_new_session=True, preexec_fn=_ctrl_c_as_on_a_terminal,
    )  # fmt: skip
    os.close(slave)
    terminal = Terminal(child, master)
    reader = threading.Thread(target=_drain, args=(terminal,), daemon=True)
    reader.start()
    try:
        yield terminal
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=10)
        reader.join(timeout=10)
        os.close(master)


def _drain(terminal: Terminal) -> None:
    """Copy the pty's output into ``terminal.output`` until the child side closes."""
    while True:
        try:
            chunk = os.read(terminal.master, 65536)
        except OSError:  # EIO: every slave fd is closed
            return
        if not chunk:
            return
        terminal.output += chunk


def test_live_top_quits_on_q_and_restores_the_terminal(cli: Cli) -> None:
    cli.started_pid()
    with top_on_a_terminal(cli) as terminal:
        terminal.wait_for("capacity 64.0 MiB")
        assert terminal.echo_and_cbreak() == (False, False)  # cbreak while running
        started = time.monotonic()
        os.write(terminal.master, b"q")
        assert terminal.child.wait(timeout=5) == 0, terminal.text()
        assert time.monotonic() - started < 5
        assert terminal.echo_and_cbreak() == (True, True)  # restored


def test_live_top_quits_on_ctrl_c(cli: Cli) -> None:
    cli.started_pid()
    with top_on_a_terminal(cli) as terminal:
        terminal.wait_for("capacity 64.0 MiB")
        terminal.child.send_signal(signal.SIGINT)  # what Ctrl-C sends (the pty is not its ctty)
        assert terminal.child.wait(timeout=5) == 0, terminal.text()
        assert terminal.echo_and_cbreak() == (True, True)
        assert "Traceback" not in terminal.text()


def test_live_top_without_a_tty_stdin_refreshes_until_ctrl_c(cli: Cli) -> None:
    cli.started_pid()
    with top_on_a_terminal(cli, keys=False) as terminal:
        first = terminal.wait_for("capacity 64.0 MiB")
        terminal.wait_for("capacity 64.0 MiB", after=first + 1)  # redrawn
        terminal.child.send_signal(signal.SIGINT)
        assert terminal.child.wait(timeout=5) == 0, terminal.text()


def test_live_top_survives_the_daemon_going_away(cli: Cli) -> None:
    cli.started_pid()
    with top_on_a_terminal(cli) as terminal:
        terminal.wait_for("capacity 64.0 MiB")
        assert cli.run("stop").returncode == 0
        gone = terminal.wait_for("daemon unreachable")
        cli.started_pid()  # a new daemon on the same directory
        terminal.wait_for("capacity 64.0 MiB", after=gone)
        os.write(terminal.master, b"q")
        assert terminal.child.wait(timeout=5) == 0, terminal.text()


def test_live_top_sorts_on_a_key_and_shows_its_help_line(cli: Cli) -> None:
    cli.started_pid()
    client = cli.client()
    pools = [client.register(name, small_spec(), num_spare_pages=0) for name in ("aaa", "zzz")]
    try:
        pools[1].alloc(1)  # zzz maps more: first by mapped, last by name
        with top_on_a_terminal(cli) as terminal:
            shown = terminal.wait_for("[mapped] · 0.2s")
            assert terminal.text().index("zzz", shown - 2000) < terminal.text().index("aaa", shown - 2000)
            os.write(terminal.master, b"n")
            by_name = terminal.wait_for("[name] · 0.2s", after=shown)
            frame = terminal.text()[terminal.text().rfind("tenant(s)", 0, by_name):by_name]
            assert frame.index("aaa") < frame.index("zzz")
            os.write(terminal.master, b"q")
            assert terminal.child.wait(timeout=5) == 0, terminal.text()
    finally:
        for pool in pools:
            pool.close()
        client.close()


def test_a_silent_tenant_is_marked_with_its_legend() -> None:
    stopped = {**THREE[0], "name": "stopped", "silent_seconds": 20.0}
    text = rendered(make_status([stopped]))
    assert row_of(text, "stopped").split()[:2] == ["stopped", "active?"]
    assert text.splitlines()[-1] == "? silent 15 s or more (pools tell the daemon every 5 s): stopped or hung?"
    assert "?" not in rendered(make_status([{**stopped, "silent_seconds": 4.0}]))
