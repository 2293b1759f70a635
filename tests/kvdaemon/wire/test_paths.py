"""kvdaemon.wire.paths: the default directory, and which directories may be trusted."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdaemon.errors import UnsafeDirectory
from kvdaemon.wire import paths
from kvdaemon.wire.paths import check_private_dir, default_dir
from tests.conftest import short_dir


@pytest.fixture
def root() -> Iterator[Path]:
    path = short_dir()
    yield path
    os.chmod(path, 0o700)
    for child in sorted(path.rglob("*"), reverse=True):
        child.unlink() if child.is_symlink() or not child.is_dir() else child.rmdir()
    path.rmdir()


def as_euid(monkeypatch: pytest.MonkeyPatch, euid: int) -> None:
    monkeypatch.setattr(paths.os, "geteuid", lambda: euid)
    monkeypatch.setattr(paths.os, "getuid", lambda: euid)


def test_kvdaemon_dir_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    as_euid(monkeypatch, 0)
    assert default_dir({"KVDAEMON_DIR": "/srv/kvd", "XDG_RUNTIME_DIR": "/run/user/0"}) == Path("/srv/kvd")


def test_root_uses_run_kvdaemon(monkeypatch: pytest.MonkeyPatch) -> None:
    as_euid(monkeypatch, 0)
    assert default_dir({}) == Path("/run/kvdaemon")
    assert default_dir({"XDG_RUNTIME_DIR": "/run/user/0", "KVDAEMON_DIR": ""}) == Path("/run/kvdaemon")


def test_a_user_uses_their_runtime_dir_when_it_is_theirs(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if os.getuid() == 0:
        os.chown(root, 4321, 4321)  # a user's, as a login session's runtime directory is
    as_euid(monkeypatch, root.stat().st_uid)
    assert default_dir({"XDG_RUNTIME_DIR": str(root)}) == root / "kvdaemon"


@pytest.mark.parametrize("xdg", ["", "relative/dir", "/nonexistent/run/user/7", "/"])
def test_a_user_without_a_usable_runtime_dir_uses_tmp(xdg: str, monkeypatch: pytest.MonkeyPatch) -> None:
    as_euid(monkeypatch, 4321)  # "/" is root's, not 4321's
    assert default_dir({"XDG_RUNTIME_DIR": xdg}) == Path("/tmp/kvdaemon-4321")


def test_a_private_dir_passes(root: Path) -> None:
    check_private_dir(root)  # mkdtemp makes it 0700 and ours


@pytest.mark.parametrize("mode", [0o755, 0o750, 0o500])
def test_a_wider_or_narrower_mode_is_refused_with_the_fix(root: Path, mode: int) -> None:
    os.chmod(root, mode)
    with pytest.raises(UnsafeDirectory) as caught:
        check_private_dir(root)
    assert caught.value.code == "UNSAFE_DIR"
    assert caught.value.message == (
        f"daemon directory {root} has mode {mode:04o}, not 0700; run `chmod 700 {root}` "
        "if it is yours alone, or choose another directory with --dir"
    )
    assert stat.S_IMODE(root.stat().st_mode) == mode


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o1700])
def test_a_shared_dir_is_refused_without_suggesting_chmod(root: Path, mode: int) -> None:
    os.chmod(root, mode)
    with pytest.raises(UnsafeDirectory, match=f"is shared \\(mode {mode:04o}\\)") as caught:
        check_private_dir(root)
    assert "chmod" not in caught.value.message


def test_a_symlink_is_refused_even_to_a_private_dir(root: Path) -> None:
    target = root / "real"
    target.mkdir(mode=0o700)
    link = root / "link"
    link.symlink_to(target)
    with pytest.raises(UnsafeDirectory, match="is a symlink"):
        check_private_dir(link)


def test_a_file_and_a_missing_path_are_refused(root: Path) -> None:
    (root / "file").write_text("")
    with pytest.raises(UnsafeDirectory, match="is not a directory"):
        check_private_dir(root / "file")
    with pytest.raises(UnsafeDirectory, match="does not exist"):
        check_private_dir(root / "absent")


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a directory to another uid")
def test_another_users_dir_is_refused(root: Path) -> None:
    os.chown(root, 12345, 12345)
    with pytest.raises(UnsafeDirectory, match="belongs to uid 12345, not to you"):
        check_private_dir(root)
