"""``kvdaemon limit`` as an operator uses it: a policy before the tenant registers, kept across
a daemon restart, against the config file's ``[tenants]``, ``none``, ``--reset``, clamped
limits and what a tenant owes, in text and JSON; and ``sleep --cold`` of a warm sleeper."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import small_spec
from tests.kvdaemon.cli import test_cli_lifecycle as lifecycle_tests
from tests.kvdaemon.cli.test_cli_lifecycle import HOST_FLAGS, Cli
from tests.kvdaemon.cli.test_json_contract import json_of

MiB = 1024 * 1024
BLOCKS_PER_PAGE = 2 * MiB // small_spec().block_bytes  # blocks of one logical page
cli = lifecycle_tests.cli  # the fixture: a detached daemon's directory, cleaned up after
CONFIG = """
backend = "host"
capacity = "64MiB"

[tenants.llama-a]
max = "50%"
weight = 3
"""


def text_of(cli: Cli, *args: str) -> list[str]:
    done = cli.run(*args)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    return done.stdout.splitlines()


def test_policies_before_registration_across_a_restart_and_against_the_config(
    cli: Cli, tmp_path: Path
) -> None:
    config = tmp_path / "kvdaemon.toml"
    config.write_text(CONFIG)
    assert cli.start("--config", str(config)).returncode == 0
    stored = json_of(cli.run("limit", "qwen-b", "--max", "25%", "--json"))
    assert stored == {
        "name": "qwen-b", "registered": False, "revision": None, "changed": True, "max_bytes": None,
        "min_bytes": None, "weight": None, "over_limit_bytes": None,
        "policy": {"max": "25%", "min": None, "weight": None}, "clamped": [], "warnings": [],
        "logical_page_bytes": None,
    }  # fmt: skip
    assert text_of(cli, "limit", "big", "--max", "20GiB") == [
        "big: not registered; policy max 20.0 GiB kept, applied when it registers",
        "big: max 20.0 GiB clamped to 64.0 MiB (above the capacity)",
    ]

    assert cli.run("stop").returncode == 0  # a new daemon reads what `limit` set
    assert cli.start("--config", str(config)).returncode == 0
    policies = json_of(cli.run("status", "--json"))["policies"]
    assert policies == [
        {"name": "big", "registered": False, "max": 20 * 1024 * MiB, "min": None, "weight": None,
         "sources": {"max": "limit"}},
        {"name": "llama-a", "registered": False, "max": "50%", "min": None, "weight": 3.0,
         "sources": {"max": "config", "weight": "config"}},
        {"name": "qwen-b", "registered": False, "max": "25%", "min": None, "weight": None,
         "sources": {"max": "limit"}},
    ]  # fmt: skip

    client = cli.client()
    qwen = client.register("qwen-b", small_spec())
    llama = client.register("llama-a", small_spec(), num_spare_pages=0, num_prefetch_pages=0)
    try:
        assert qwen.max_bytes == 16 * MiB and llama.max_bytes == 32 * MiB  # applied on registering
        assert text_of(cli, "limit", "llama-a", "--max", "none") == [
            "llama-a: limit 64.0 MiB, min 0 B, weight 3 (revision 1; policy max none, weight 3)",
        ]  # limit's none wins over the config file's max
        assert text_of(cli, "limit", "llama-a", "--reset") == [
            "llama-a: limit 32.0 MiB, min 0 B, weight 3 (revision 2; policy max 50%, weight 3)",
        ]  # the config file's apply again
        blocks = llama.alloc(3 * BLOCKS_PER_PAGE)  # three logical pages of 4 MiB, all in use
        lowered = json_of(cli.run("limit", "llama-a", "--max", "4MiB", "--json"))
        assert (lowered["max_bytes"], lowered["over_limit_bytes"]) == (4 * MiB, 8 * MiB)
        assert lowered["policy"] == {"max": 4 * MiB, "min": None, "weight": 3.0}
        owing = text_of(cli, "status")
        assert "llama-a: owes 8.00 MiB over its 4.00 MiB limit; cannot be slept (no quiesce hook)" in owing
        llama.free(blocks)
        assert text_of(cli, "limit", "qwen-b", "--max", "3MiB") == [
            "qwen-b: limit 3.00 MiB, min 0 B, weight 1 (revision 1; policy max 3.00 MiB)",
            "qwen-b: a limit under its logical page (4.00 MiB) lets it map nothing; what it maps it gives back",
        ]
        under = json_of(cli.run("limit", "qwen-b", "--max", "3MiB", "--json"))  # JSON warns as the text does
        assert under["warnings"] == [
            "a limit under its logical page (4.00 MiB) lets it map nothing; what it maps it gives back"]
        at_page = json_of(cli.run("limit", "qwen-b", "--max", "4MiB", "--json"))
        assert at_page["logical_page_bytes"] == 4 * MiB and at_page["warnings"] == []
    finally:
        llama.close()
        qwen.close()
        client.close()


def test_sleep_cold_of_a_warm_sleeper_drops_its_host_copy(cli: Cli) -> None:
    cli.start(*HOST_FLAGS)
    client = cli.client()
    pool = client.register("llama-a", small_spec(), num_prefetch_pages=0)
    pool.quiesce_hook = lambda: None
    try:
        pool.alloc(4)  # one logical page: 4 MiB
        assert json_of(cli.run("sleep", "llama-a", "--json"))["host_bytes"] == 4 * MiB
        cold = json_of(cli.run("sleep", "llama-a", "--cold", "--json"))
        assert cold == {"name": "llama-a", "state": "sleeping-cold", "changed": True,
                        "host_bytes": 0, "dropped_host_bytes": 4 * MiB}  # fmt: skip
        assert text_of(cli, "sleep", "llama-a") == [
            "llama-a: already sleeping-cold; nothing to do",  # a warm sleep cannot bring it back
        ]
        assert json_of(cli.run("sleep", "llama-a", "--json"))["changed"] is False
        assert text_of(cli, "wake", "llama-a") == ["llama-a: active, 0 B mapped"]
        assert pool.wait_state(lambda state: state.value == "active", 5)
        assert pool.num_block_losses == 1  # the pool learnt that its KV is gone
        assert pool.alloc(4) == [0, 1, 2, 3]  # a fresh allocator, on a page mapped for it
        assert json_of(cli.run("status", "llama-a", "--json"))["tenants"][0]["mapped_bytes"] == 4 * MiB
        text_of(cli, "sleep", "llama-a")
        assert text_of(cli, "sleep", "llama-a", "--cold") == [
            "llama-a: sleeping-cold (was sleeping-warm; its host copy of 4.00 MiB dropped)",
        ]
    finally:
        pool.close()
        client.close()


def test_a_limit_past_what_the_wire_carries_is_a_usage_error_and_keeps_nothing(cli: Cli) -> None:
    assert cli.start(*HOST_FLAGS).returncode == 0
    done = cli.run("limit", "pp", "--max", "99999999999999999999999")
    assert done.returncode == 2 and "at most 9223372036854775807 bytes" in done.stderr, done
    assert json_of(cli.run("status", "--json"))["policies"] == []
    assert cli.run("limit", "pp", "--max", "9223372036854775807").returncode == 0  # the largest: clamped
    assert [p["name"] for p in json_of(cli.run("status", "--json"))["policies"]] == ["pp"]


def test_a_promise_that_does_not_fit_now_is_kept_and_said_so(cli: Cli) -> None:
    assert cli.start(*HOST_FLAGS).returncode == 0
    client = cli.client()
    pool = client.register("llama-a", small_spec(), min_bytes=48 * MiB)
    try:
        assert text_of(cli, "limit", "qwen-b", "--min", "32MiB") == [
            "qwen-b: not registered; policy min 32.0 MiB kept, applied when it registers",
            "qwen-b: min 32.0 MiB does not fit now: 48.0 MiB of 64.0 MiB are guaranteed to registered tenants; "
            "a tenant 'qwen-b' is refused until they release or lower theirs",
        ]
        assert json_of(cli.run("status", "--json"))["policies"][0]["min"] == 32 * MiB
    finally:
        pool.close()
        client.close()


def test_guarantees_in_the_config_that_do_not_fit_are_said_at_start_and_in_status(
    cli: Cli, tmp_path: Path
) -> None:
    config = tmp_path / "kvdaemon.toml"
    config.write_text(CONFIG + '\n[tenants.qwen-b]\nmin = "40MiB"\n\n[tenants.phi-c]\nmin = "40MiB"\n')
    started = cli.start("--config", str(config))
    assert started.returncode == 0
    said = ("warning: the operator's mins for names not registered add up to 80.0 MiB, past the 64.0 MiB left "
            "beside registered tenants' guarantees: those that register last are refused")
    assert started.stdout.splitlines()[1:] == [said]
    assert said in text_of(cli, "status")
    assert json_of(cli.run("status", "--json"))["warnings"] == [said.removeprefix("warning: ")]
