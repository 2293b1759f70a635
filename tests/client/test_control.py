"""``ControlChannel``: a wait with no deadline says, now and then, that it still waits."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import threading
from typing import Any

import pytest

from kvdaemon.client import control
from kvdaemon.client.control import ControlChannel
from kvdaemon.errors import DaemonUnreachable
from kvdaemon.wire.paths import DaemonPaths, running_pid
from kvdaemon.wire.protocol import PROTOCOL_VERSION

from tests.conftest import short_dir, start_daemon, wait_until


def test_a_wait_for_a_stopped_daemon_is_logged_until_it_answers(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(control, "STILL_WAITING_S", 0.2)
    caplog.set_level(logging.WARNING, logger="kvdaemon.client")
    root = short_dir()
    daemon = start_daemon(root)
    channel = ControlChannel(DaemonPaths(root), 5.0)
    answered: list[Any] = []
    try:
        os.kill(daemon.pid, signal.SIGSTOP)  # alive, but answering nothing
        waiter = threading.Thread(
            target=lambda: answered.append(channel.call_until_answered("hello", {"version": PROTOCOL_VERSION})))
        waiter.start()
        wait_until(lambda: len([r for r in caplog.records if "has not answered 'hello'" in r.getMessage()]) >= 2, 10,
                   "the wait was not said")
        assert answered == []
        os.kill(daemon.pid, signal.SIGCONT)
        waiter.join(10)
        assert answered and answered[0]["pid"] == daemon.pid
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
        channel.close()
        daemon.kill()
        daemon.wait(10)
        shutil.rmtree(root, ignore_errors=True)


def test_a_daemon_that_dies_before_it_answers_is_said_to_be_gone() -> None:
    root = short_dir()
    daemon = start_daemon(root)
    paths = DaemonPaths(root)
    channel = ControlChannel(paths, 5.0, alive=lambda: running_pid(paths) is not None)
    try:
        os.kill(daemon.pid, signal.SIGSTOP)  # it takes the request and never answers
        killer = threading.Timer(0.5, lambda: os.kill(daemon.pid, signal.SIGKILL))
        killer.start()
        with pytest.raises(DaemonUnreachable, match=r"went away before it answered \(no kvdaemon runs there now\)"):
            channel.call("hello", {"version": PROTOCOL_VERSION}, 30)
        killer.join()
    finally:
        channel.close()
        daemon.kill()
        daemon.wait(10)
        shutil.rmtree(root, ignore_errors=True)
