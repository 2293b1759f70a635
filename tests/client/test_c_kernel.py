"""c_kernel: a C source built once per machine and compiler, cached by what it depends on; no compiler, no crash."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from kvdaemon.client import c_kernel

SOURCE = "int kvd_answer(void) { return %d; }\n"
needs_cc = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(c_kernel, "_loaded", {})
    return tmp_path / "cache" / "kvdaemon"


def source(tmp_path: Path, answer: int, name: str = "answer.c") -> Path:
    path = tmp_path / name
    path.write_text(SOURCE % answer)
    return path


@needs_cc
def test_a_source_is_built_once_and_a_changed_one_again(tmp_path: Path, cache: Path) -> None:
    path = source(tmp_path, 41)
    lib = c_kernel.load(path)
    assert lib is not None and lib.kvd_answer() == 41
    assert c_kernel.load(path) is lib, "one build and one load per process"
    built = sorted(cache.glob("answer-*.so"))
    assert len(built) == 1
    c_kernel._loaded.clear()
    assert c_kernel.load(path).kvd_answer() == 41  # type: ignore[union-attr]
    assert sorted(cache.glob("answer-*.so")) == built, "an unchanged source was built again"
    c_kernel._loaded.clear()
    path.write_text(SOURCE % 42)
    assert c_kernel.load(path).kvd_answer() == 42  # type: ignore[union-attr]
    assert len(list(cache.glob("answer-*.so"))) == 2
    assert not list(cache.glob("*.tmp")), "a temporary build file was left behind"


@needs_cc
def test_extra_flags_build_a_library_of_their_own(tmp_path: Path, cache: Path) -> None:
    path = tmp_path / "flagged.c"
    path.write_text("#ifdef KVD_SEVEN\nint kvd_answer(void) { return 7; }\n#else\n" + SOURCE % 41 + "#endif\n")
    plain, flagged = c_kernel.load(path), c_kernel.load(path, ("-DKVD_SEVEN",))
    assert plain is not None and flagged is not None
    assert (plain.kvd_answer(), flagged.kvd_answer()) == (41, 7)
    assert c_kernel.load(path, ("-DKVD_SEVEN",)) is flagged
    assert len(list(cache.glob("flagged-*.so"))) == 2


@needs_cc
def test_a_source_that_does_not_build_gives_none(tmp_path: Path, cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "broken.c"
    path.write_text("this is not C\n")
    with caplog.at_level(logging.WARNING, logger="kvdaemon.client.c_kernel"):
        assert c_kernel.load(path) is None
    assert "broken.c failed" in caplog.text
    assert not list(cache.glob("broken-*"))


def test_without_a_compiler_nothing_is_built(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(shutil, "which", lambda _name: None)
    with caplog.at_level(logging.WARNING, logger="kvdaemon.client.c_kernel"):
        assert c_kernel.load(source(tmp_path, 1)) is None
    assert "no C compiler" in caplog.text
