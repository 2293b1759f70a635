"""kvdaemon.cli.status_view: the table of ``kvdaemon status``."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from kvdaemon.cli import status_view

MiB = 1024 * 1024


def make_tenant(**overrides: Any) -> dict[str, Any]:
    tenant = {
        "name": "llama-a", "pid": 4242, "state": "active", "mapped_bytes": 1536 * MiB,
        "used_bytes": 512 * MiB, "max_bytes": 8192 * MiB, "min_bytes": 0, "weight": 1.0,
        "idle_seconds": 185.4,
    }  # fmt: skip
    tenant.update(overrides)
    return tenant


def make_status(tenants: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "backend": "host", "page_size": 2 * MiB, "capacity_bytes": 4096 * MiB,
        "free_bytes": 1024 * MiB, "tenants": tenants,
    }  # fmt: skip


def rendered(status: dict[str, Any], width: int = 200) -> str:
    out = io.StringIO()
    status_view.render(Console(file=out, width=width, color_system=None), Path("/tmp/kvd"), status)
    return out.getvalue()


def test_tenant_row() -> None:
    assert status_view.tenant_row(make_tenant()) == [
        "llama-a", "4242", "active", "1.50G", "512M", "8.00G", "0", "1", "3m05s",
    ]  # fmt: skip
    unlimited = status_view.tenant_row(make_tenant(max_bytes=None, weight=2.5, state="sleeping-cold"))
    assert unlimited[2] == "asleep (cold)" and unlimited[5:8] == ["none", "0", "2.5"]
    assert status_view.tenant_row(make_tenant(copying="saving"))[2] == "active, saving"
    waking = status_view.tenant_row(make_tenant(state="sleeping-warm", copying="restoring"))
    assert waking[2] == "asleep (warm), restoring"


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (0.9, "0s"), (59.9, "59s"), (60, "1m00s"), (3725, "1h02m"), (359999, "99h59m"),
     (360000, "4d04h")],
)  # fmt: skip
def test_format_duration(seconds: float, text: str) -> None:
    assert status_view.format_duration(seconds) == text


def test_render_header_and_rows() -> None:
    sleeper = make_tenant(name="[bold]x", pid=7, state="sleeping-warm")
    status = {**make_status([make_tenant(), sleeper]), "pid": 99, "version": "0.1.0",
              "uptime_seconds": 7300.5, "device": 0}  # fmt: skip
    lines = rendered(status).splitlines()
    assert lines[:2] == [
        "kvdaemon 0.1.0 at /tmp/kvd (pid 99, up 2h01m): backend host, device 0",
        "capacity 4.00 GiB, free 1.00 GiB (25%), page 2.00 MiB, 2 tenant(s)",
    ]
    assert lines[2].split() == [
        "name", "pid", "state", "mapped", "in", "use", "limit", "min", "weight", "idle",
    ]  # fmt: skip
    assert lines[3].split()[:3] == ["llama-a", "4242", "active"]
    assert lines[4].split()[:4] == ["[bold]x", "7", "asleep", "(warm)"]  # names are not markup
    assert len(lines) == 5  # nothing needs attention, no policies


def test_render_without_tenants() -> None:
    text = rendered(make_status([]))
    assert text.splitlines()[2] == "no tenants registered"


def test_every_line_fits_80_columns() -> None:
    widest = make_tenant(name="qwen-2.5-7b-instruct-replica", pid=4194304, state="sleeping-warm",
                         mapped_bytes=1000 * 1024 * MiB, used_bytes=999 * MiB, min_bytes=1000 * MiB,
                         weight=0.125, idle_seconds=359999)  # fmt: skip
    lines = rendered(make_status([widest, make_tenant()]), width=80).splitlines()
    assert all(len(line) <= 80 for line in lines)
    assert lines[3].split() == [
        "qwen-2.5-7b-ins…", "4194304", "asleep", "(warm)", "0.98T", "999M", "8.00G", "0.98G",
        "0.125", "99h59m",
    ]  # fmt: skip


def test_names_get_what_the_console_width_leaves() -> None:
    name = "qwen-2.5-7b-instruct-" + "y" * 107  # 128 characters, the longest a name may be
    wide = rendered(make_status([make_tenant(name=name)]), width=200).splitlines()
    assert wide[3].split()[0] == name  # piped output is 200 wide: a name is never cut
    narrow = rendered(make_status([make_tenant(name=name)]), width=100).splitlines()
    assert narrow[3].split()[0] == name[:35] + "…" and all(len(line) <= 100 for line in narrow)


def test_a_tenant_that_needs_attention_gets_a_note() -> None:
    over = make_tenant(name="over", mapped_bytes=3072 * MiB, max_bytes=2048 * MiB,
                       over_limit_bytes=1024 * MiB, refused_grows=3, sleepable=False)  # fmt: skip
    asleep = make_tenant(name="asleep", state="sleeping-cold", sleepable=False)  # nothing to say
    fine = make_tenant(name="fine", refused_grows=0, sleepable=True)
    lines = rendered(make_status([fine, over, asleep])).splitlines()
    assert lines[6:] == [
        "over: owes 1.00 GiB over its 2.00 GiB limit; 3 grow(s) refused; "
        "cannot be slept (no quiesce hook)",
    ]
    assert status_view.owed_bytes(over) == 1024 * MiB
    recent = make_tenant(name="recent", refused_grows=5, refused_seconds_ago=4.2, sleepable=True)
    long_ago = make_tenant(name="long-ago", refused_grows=1216, refused_seconds_ago=600.0, sleepable=True)
    notes = [line for line in rendered(make_status([recent, long_ago])).splitlines() if "refused" in line]
    assert notes == ["recent: 5 grow(s) refused, the last 4s ago"]  # one from ten minutes ago needs no note
    assert status_view.owed_bytes(make_tenant(mapped_bytes=3072 * MiB, max_bytes=2048 * MiB)) == 1024 * MiB
    assert status_view.owed_bytes(make_tenant(max_bytes=None)) == 0


def test_a_tenant_short_of_memory_now_is_noted_with_its_fair_share() -> None:
    short = make_tenant(name="short", short=True, fair_bytes=1024 * MiB)
    calm = make_tenant(name="calm", short=False, fair_bytes=1024 * MiB)
    lines = rendered(make_status([calm, short])).splitlines()
    assert lines[5:] == ["short: short of memory now (1.50 GiB held, fair share 1.00 GiB)"]


def test_policies_are_listed_with_their_sources() -> None:
    policies = [
        {"name": "llama-a", "registered": True, "max": "40%", "min": None, "weight": None,
         "sources": {"max": "config"}},
        {"name": "qwen-b", "registered": False, "max": 8589934592, "min": "none", "weight": 2.0,
         "sources": {"max": "limit", "min": "limit", "weight": "config"}},
    ]  # fmt: skip
    lines = rendered({**make_status([make_tenant()]), "policies": policies}).splitlines()
    assert lines[4:] == [
        "operator policies (kvdaemon limit; [tenants] of the config file):",
        "  llama-a: max 40% (config)",
        "  qwen-b: max 8.00 GiB (limit; the capacity, 4.00 GiB, applies), min none (limit), weight 2 (config); "
        "not registered (applied when it registers)",
    ]


def test_the_header_says_how_many_are_shown_and_what_is_quarantined() -> None:
    status = {**make_status([make_tenant()]), "quarantined_bytes": 3 << 20}
    lines = status_view.header_lines(Path("/tmp/kvd"), status, num_registered=2)
    assert lines[1].endswith("page 2.00 MiB, 1 of 2 tenant(s) shown")
    assert lines[2].startswith("quarantined 3.00 MiB: pages of ended leases")
    assert len(status_view.header_lines(Path("/tmp/kvd"), make_status([make_tenant()]), 1)) == 2


def test_a_tenant_silent_for_three_heartbeats_is_noted() -> None:
    stopped = make_tenant(name="stopped", silent_seconds=42.0)
    quiet = make_tenant(name="quiet", silent_seconds=4.9)  # between two heartbeats: nothing to say
    lines = rendered(make_status([quiet, stopped])).splitlines()
    assert lines[5:] == ["stopped: silent for 42s (pools tell the daemon every 5 s): stopped or hung?"]


def test_a_registration_not_attached_is_said_so_and_the_dropped_ones_counted() -> None:
    waiting = make_tenant(name="waiting", attached=False, sleepable=False, refused_grows=0)
    status = {**make_status([waiting]), "counters": {"never_attached": 3}}
    lines = rendered(status).splitlines()
    assert "3 registration(s) dropped without ever attaching (a client that died, or a flood)" in lines
    assert lines[-1] == "waiting: registered; its handle channel is not attached yet (dropped if it never is)"


def test_the_header_says_when_the_device_has_less_free_than_the_pool_counts() -> None:
    def header(device_free: int | None) -> list[str]:
        status = {**make_status([make_tenant()]), "device_free_bytes": device_free}
        return status_view.header_lines(Path("/tmp/kvd"), status)

    (note,) = header(256 * MiB)[2:]
    assert note.startswith("device free 256.0 MiB, under the pool's: held elsewhere")
    assert header(1024 * MiB)[2:] == [] and header(None)[2:] == []  # as much as the pool counts, or unknown


def test_the_header_shows_warm_sleepers_host_memory_and_the_idle_policy() -> None:
    status = {**make_status([make_tenant()]), "host_bytes": 8 * MiB,
              "settings": {"idle_sleep_s": 300.0, "idle_mode": "cold", "reclaim_sleep": True,
                           "warm_memory_bytes": 64 * MiB}}  # fmt: skip
    assert status_view.header_lines(Path("/tmp/kvd"), status)[2:] == [
        "host memory 8.00 MiB of 64.0 MiB allowed: the KV of warm sleepers", "idle tenants sleep cold after 5m00s",
    ]
    quiet = {**status, "host_bytes": 0, "settings": {"idle_sleep_s": None, "idle_mode": "warm"}}
    assert status_view.header_lines(Path("/tmp/kvd"), quiet)[2:] == []
