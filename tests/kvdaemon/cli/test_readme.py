"""The README's sequences, run verbatim: each shell block under "Using it" and "Two models on
one device" by bash with ``-e`` (every line must succeed, in order), and each Python block
against a running daemon. Only the environment differs from a fresh shell: ``KVDAEMON_DIR``
points at a fresh directory, so nothing touches the machine's own daemon."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import small_spec
from tests.kvdaemon.cli import test_cli_lifecycle as lifecycle_tests
from tests.kvdaemon.cli.test_cli_lifecycle import Cli

REPO = Path(__file__).resolve().parents[3]
README = REPO / "README.md"
cli = lifecycle_tests.cli
BLOCK = re.compile(r"^```(?P<lang>\w+)\n(?P<body>.*?)^```$", re.MULTILINE | re.DOTALL)


def section(heading: str) -> str:
    """The README's text from ``heading`` to the next heading of any level."""
    text = README.read_text()
    start = text.index(f"\n{heading}\n")
    rest = text[start + len(heading) + 2:]
    end = re.search(r"^#{1,6} ", rest, re.MULTILINE)
    return rest[: end.start() if end else len(rest)]


def blocks(heading: str, lang: str) -> list[str]:
    return [m["body"] for m in BLOCK.finditer(section(heading)) if m["lang"] == lang]


@pytest.fixture
def env(cli: Cli) -> Iterator[dict[str, str]]:
    """A fresh shell's environment with ``KVDAEMON_DIR`` set and the venv not yet active."""
    bin_dir = str(Path(sys.executable).parent)
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != bin_dir)
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("KVDAEMON_", "VIRTUAL_ENV"))}
    yield {**environ, "PATH": path, "KVDAEMON_DIR": str(cli.dir)}


def run_shell(script: str, env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-e", "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=timeout_s,
    )  # fmt: skip


def venv_ready() -> bool:
    return (REPO / ".venv" / "bin" / "activate").exists()


needs_venv = pytest.mark.skipif(not venv_ready(), reason="the README's shell blocks use .venv")


@needs_venv
def test_using_it_runs_as_written(cli: Cli, env: dict[str, str]) -> None:
    (script,) = blocks("## Using it", "sh")
    done = run_shell(script, env, timeout_s=600)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    out = done.stdout
    assert f"kvdaemon running at {cli.dir}" in out
    assert "no tenants registered" in out
    assert "llama-a: registered" in out
    assert '"name": "llama-a"' in out
    assert "llama-a: limit 32.0 MiB" in out
    assert "llama-a: sleeping-warm" in out and "llama-a: sleeping-cold" in out
    assert f"kvdaemon at {cli.dir} stopped" in out
    assert cli.run("status").returncode == 1


@needs_venv
def test_two_models_on_one_device_runs_as_written(cli: Cli, env: dict[str, str]) -> None:
    (script,) = blocks("### Two models on one device", "sh")
    done = run_shell(script, env, timeout_s=900)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    out = done.stdout
    assert "llama-a, qwen-b: registered" in out
    assert "llama-a: registered, sleepable and idle for 5 s" in out
    assert "llama-a: sleeping-warm, " in out
    assert "llama-a: active (waited " in out  # woken by its engine's next round
    assert "[llama-a] round 2: 2 requests" in out and "[qwen-b] round 2: 2 requests" in out


@pytest.mark.parametrize("heading", ["## Using it", "## Serving a transformers model"])
def test_python_blocks_run_as_written(cli: Cli, env: dict[str, str], heading: str) -> None:
    started = cli.start("--backend", "host", "--capacity", "1GiB")
    assert started.returncode == 0, started.stderr
    for code in blocks(heading, "python"):
        done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        assert done.returncode == 0, f"{code}\n{done.stdout}\n{done.stderr}"
    assert cli.run("status", "--json").returncode == 0


@needs_venv
def test_limits_that_outlive_a_tenant_run_as_written(cli: Cli, env: dict[str, str]) -> None:
    (script,) = blocks("### Limits that outlive a tenant", "sh")
    done = run_shell("source .venv/bin/activate\n" + script, env, timeout_s=300)  # "venv active"
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    out = done.stdout
    assert "qwen-b: not registered; policy max 64.0 MiB, min 16.0 MiB kept, applied when it registers" in out
    assert "qwen-b: max 1.00 TiB clamped to 256.0 MiB (above the capacity)" in out
    assert "  llama-a: max 50% (config), weight 2 (config); not registered (applied when it registers)" in out
    assert '"sources": {\n        "max": "limit",\n        "min": "limit"' in out  # after the restart
    assert "llama-a: not registered; policy max none, weight 2 kept" in out
    assert "llama-a: not registered; policy max 50%, weight 2 kept" in out
    assert cli.run("status").returncode == 1


def test_the_status_json_tables_name_every_field(cli: Cli) -> None:
    """Each table of the README's "status --json" lists exactly the fields a daemon reports."""
    text = section("### What `status --json` says")
    tables = re.split(r"\n\n(?=Per )", text)
    documented = [
        {name for row in re.findall(r"^\| (`[^|]*) \|", table, re.MULTILINE)
         for name in re.findall(r"`([a-z_]+)`", row)}
        for table in tables
    ]  # fmt: skip
    cli.started_pid()
    cli.run("limit", "nobody-yet", "--max", "25%")
    client = cli.client()
    pool = client.register("llama-a", small_spec())
    try:
        status = json.loads(cli.run("status", "--json").stdout)
    finally:
        pool.close()
        client.close()
    assert documented == [set(status), set(status["tenants"][0]), set(status["policies"][0])]
    assert all(f"`{counter}`" in tables[0] for counter in status["counters"])
