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

from rich.console import Console

from kvdaemon.cli import top_view
from kvdaemon.cli.top_view import EMPTY, FILLED
from tests.conftest import small_spec
from tests.kvdaemon.cli import test_cli_lifecycle as lifecycle_tests
from tests.kvdaemon.cli.test_cli_lifecycle import Cli
from tests.kvdaemon.cli.test_status_view import make_status, make_tenant

MiB = 1024 * 1024
cli = lifecycle_tests.cli  # the fixture: a detached daemon's directory, cleaned up after
ROOT = Path("/tmp/kvd")


def rendered(status: dict[str, Any] | None, footer: str | None = None) -> str:
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(top_view.frame(ROOT, status, footer))
    return out.getvalue()


def row_of(text: str, name: str) -> str:
    (row,) = [line for line in text.splitlines() if line.startswith(name + " ")]
    return row


# -- the frame -------------------------------------------------------------------------------


def test_usage_bar() -> None:
    assert top_view.usage_bar(0, 100, width=10).plain == EMPTY * 10 + "   0%"
    assert top_view.usage_bar(25, 100, width=10).plain == FILLED * 2 + EMPTY * 8 + "  25%"
    assert top_view.usage_bar(1, 1000, width=10).plain == FILLED + EMPTY * 9 + "   0%"
    assert top_view.usage_bar(150, 100, width=10).plain == FILLED * 10 + " 150%"
    assert top_view.usage_bar(0, 0, width=10).plain == EMPTY * 10 + "   0%"
    assert top_view.usage_bar(5, 0, width=10).plain == FILLED * 10 + " 100%"


def test_frame_with_tenants() -> None:
    tenants = [
        make_tenant(),  # 1.5 GiB mapped of an 8 GiB limit
        make_tenant(name="[bold]x", pid=7, state="sleeping-warm", mapped_bytes=0, max_bytes=None),
        make_tenant(name="over", mapped_bytes=3072 * MiB, max_bytes=2048 * MiB),
    ]
    text = rendered(make_status(tenants), footer="q quits")
    lines = text.splitlines()
    assert lines[0].startswith("kvdaemon at /tmp/kvd: backend host, capacity 4.00 GiB, free 1.00 GiB")
    assert lines[1] == "mapped " + FILLED * 15 + EMPTY * 5 + "  75%"  # 3 of 4 GiB not free
    assert lines[2].split() == [
        "name", "pid", "state", "mapped", "in", "use", "limit", "min", "weight", "idle",
        "of", "limit", "of", "capacity",
    ]  # fmt: skip
    assert lines[-1] == "q quits"

    first = row_of(text, "llama-a")
    assert first.split()[:3] == ["llama-a", "4242", "active"]
    for size in ("1.50 GiB", "512.0 MiB", "8.00 GiB", "0 B", "3m05s"):
        assert size in first
    assert FILLED * 4 + EMPTY * 16 + "  19%" in first  # 1.5 of 8 GiB
    assert first.endswith(" 38%")  # 1.5 of 4 GiB capacity

    unlimited = row_of(text, "[bold]x")  # names are not markup
    assert "sleeping-warm" in unlimited and "none" in unlimited
    assert EMPTY * 20 + "   0%" in unlimited  # against the capacity

    over = row_of(text, "over")
    assert FILLED * 20 + " 150%" in over and over.endswith(" 75%")


def test_frame_without_tenants() -> None:
    text = rendered(make_status([]))
    lines = text.splitlines()
    assert "capacity 4.00 GiB, free 1.00 GiB (25%)" in lines[0]
    assert lines[1].startswith("mapped " + FILLED)
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
        done = cli.run("top", "--once")
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert lines[0].startswith(f"kvdaemon at {cli.dir}: backend host, capacity 64.0 MiB")
        assert "2 tenant(s)" in lines[0]
        a_row, b_row = row_of(done.stdout, "llama-a"), row_of(done.stdout, "qwen-b")
        assert a_row.split()[:5] == ["llama-a", str(os.getpid()), "active", "4.00", "MiB"]
        assert "16.0 MiB" in a_row and FILLED * 5 + EMPTY * 15 + "  25%" in a_row
        assert b_row.split()[:4] == ["qwen-b", str(os.getpid()), "active", "0"]
        assert EMPTY * 20 in b_row
    finally:
        first.close()
        second.close()
        client.close()


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


@contextmanager
def top_on_a_terminal(cli: Cli, *, keys: bool = True) -> Iterator[Terminal]:
    """Run ``kvdaemon top --interval 0.2`` on a fresh pty; its stdin too when ``keys``."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))
    child = subprocess.Popen(
        [sys.executable, "-m", "kvdaemon", "top", "--interval", "0.2", "--dir", str(cli.dir)],
        stdin=slave if keys else subprocess.DEVNULL, stdout=slave, stderr=slave,
        start_new_session=True,
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
