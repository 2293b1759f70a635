"""kvdaemon.daemon.metrics: a Prometheus endpoint over a status snapshot and event counters."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from kvdaemon import __version__
from kvdaemon.daemon.metrics import Metrics
from kvdaemon.errors import ConfigError

MiB = 1024 * 1024


def make_status(tenants: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A DESIGN.md §13 status object with 64 MiB capacity."""
    if tenants is None:
        tenants = [make_tenant("llama-a", 8 * MiB, 6 * MiB, 32 * MiB)]
    mapped = sum(t["mapped_bytes"] for t in tenants)
    return {
        "backend": "host",
        "page_size": 2 * MiB,
        "capacity_bytes": 64 * MiB,
        "free_bytes": 64 * MiB - mapped,
        "tenants": tenants,
    }


def make_tenant(
    name: str, mapped_bytes: int, used_bytes: int, max_bytes: int | None
) -> dict[str, Any]:
    return {
        "name": name, "pid": 1234, "state": "active", "mapped_bytes": mapped_bytes,
        "used_bytes": used_bytes, "max_bytes": max_bytes, "min_bytes": 0, "weight": 1.0,
        "idle_seconds": 0.5,
    }  # fmt: skip


class FakeDaemon:
    """Holds the status object the metrics' snapshot returns; counts the calls."""

    def __init__(self, status: dict[str, Any]) -> None:
        self.status = status
        self.num_snapshots = 0

    def snapshot(self) -> dict[str, Any]:
        self.num_snapshots += 1
        return self.status


@pytest.fixture
def fake() -> FakeDaemon:
    return FakeDaemon(make_status())


@pytest.fixture
def metrics(fake: FakeDaemon) -> Iterator[Metrics]:
    served = Metrics(0, fake.snapshot)
    served.start()
    yield served
    served.stop()


def scrape(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of one scrape, keyed by (sample name, sorted labels)."""
    url = f"http://127.0.0.1:{metrics.bound_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_gauges_follow_the_snapshot_on_every_scrape(metrics: Metrics, fake: FakeDaemon) -> None:
    samples = scrape(metrics)
    assert samples[("kvdaemon_capacity_bytes", ())] == 64 * MiB
    assert samples[("kvdaemon_free_bytes", ())] == 56 * MiB
    tenant = (("tenant", "llama-a"),)
    assert samples[("kvdaemon_tenant_mapped_bytes", tenant)] == 8 * MiB
    assert samples[("kvdaemon_tenant_used_bytes", tenant)] == 6 * MiB
    assert samples[("kvdaemon_tenant_max_bytes", tenant)] == 32 * MiB
    assert samples[("kvdaemon_tenant_refused_grows_total", tenant)] == 0

    fake.status = make_status(
        [
            make_tenant("llama-a", 2 * MiB, 0, 32 * MiB),
            {**make_tenant("qwen-b", 10 * MiB, 4 * MiB, None), "refused_grows": 7, "unpaid_reclaims": 2},
        ]
    )
    samples = scrape(metrics)
    assert samples[("kvdaemon_tenant_refused_grows_total", (("tenant", "qwen-b"),))] == 7
    assert samples[("kvdaemon_tenant_unpaid_reclaims_total", (("tenant", "qwen-b"),))] == 2
    assert samples[("kvdaemon_free_bytes", ())] == 52 * MiB
    assert samples[("kvdaemon_tenant_mapped_bytes", tenant)] == 2 * MiB
    assert samples[("kvdaemon_tenant_mapped_bytes", (("tenant", "qwen-b"),))] == 10 * MiB
    assert ("kvdaemon_tenant_max_bytes", (("tenant", "qwen-b"),)) not in samples  # no limit
    assert fake.num_snapshots == 2


def test_gone_tenants_disappear(metrics: Metrics, fake: FakeDaemon) -> None:
    fake.status = make_status([])
    samples = scrape(metrics)
    assert samples[("kvdaemon_free_bytes", ())] == 64 * MiB
    assert not [key for key in samples if key[0].startswith("kvdaemon_tenant_")]


def test_counters_and_histogram(metrics: Metrics) -> None:
    before = scrape(metrics)
    assert before[("kvdaemon_granted_pages_total", ())] == 0
    assert before[("kvdaemon_grant_latency_seconds_count", ())] == 0

    metrics.observe_grant(0.0002, 4)
    metrics.observe_grant(0.03, 16)
    metrics.count_shrink(3)
    metrics.count_lease_expiry()
    metrics.count_lease_expiry()

    samples = scrape(metrics)
    assert samples[("kvdaemon_granted_pages_total", ())] == 20
    assert samples[("kvdaemon_shrunk_pages_total", ())] == 3
    assert samples[("kvdaemon_lease_expiries_total", ())] == 2
    assert samples[("kvdaemon_grant_latency_seconds_count", ())] == 2
    assert samples[("kvdaemon_grant_latency_seconds_sum", ())] == pytest.approx(0.0302)
    assert samples[("kvdaemon_grant_latency_seconds_bucket", (("le", "0.00025"),))] == 1
    assert samples[("kvdaemon_grant_latency_seconds_bucket", (("le", "0.05"),))] == 2


def test_listens_on_loopback_only_and_stop_closes_the_port(fake: FakeDaemon) -> None:
    metrics = Metrics(0, fake.snapshot)
    metrics.start()
    port = metrics.bound_port
    assert port is not None
    assert metrics._server is not None and metrics._server.server_address[0] == "127.0.0.1"
    metrics.stop()
    assert metrics.bound_port is None
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    metrics.stop()  # idempotent


def test_fixed_port_and_busy_port(fake: FakeDaemon) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    first = Metrics(port, fake.snapshot)
    first.start()
    try:
        assert first.bound_port == port
        second = Metrics(port, fake.snapshot)
        expected = f"cannot serve metrics on 127.0.0.1:{port}: "
        with pytest.raises(ConfigError, match=expected) as caught:
            second.start()
        assert caught.value.code == "CONFIG"
        assert second.bound_port is None
    finally:
        first.stop()


def test_recording_works_before_start_and_uses_no_global_registry(fake: FakeDaemon) -> None:
    metrics = Metrics(0, fake.snapshot)
    metrics.observe_grant(0.001, 1)
    metrics.count_shrink(1)
    assert REGISTRY.get_sample_value("kvdaemon_granted_pages_total") is None
    assert metrics.registry.get_sample_value("kvdaemon_granted_pages_total") == 1
    assert fake.num_snapshots == 0  # no scrape, no snapshot


def test_two_instances_coexist(fake: FakeDaemon) -> None:
    first, second = Metrics(0, fake.snapshot), Metrics(0, fake.snapshot)
    first.start()
    second.start()
    try:
        first.count_shrink(5)
        assert scrape(first)[("kvdaemon_shrunk_pages_total", ())] == 5
        assert scrape(second)[("kvdaemon_shrunk_pages_total", ())] == 0
    finally:
        first.stop()
        second.stop()


def test_states_host_bytes_and_sleep_counters(metrics: Metrics, fake: FakeDaemon) -> None:
    sleeper = {**make_tenant("qwen-b", 0, 0, None), "state": "sleeping-warm", "host_bytes": 6 * MiB}
    fake.status = {
        **make_status([make_tenant("llama-a", 2 * MiB, 0, 32 * MiB), sleeper]),
        "host_bytes": 6 * MiB,
        "counters": {"sleeps": 3, "wakes": 2, "reclaim_requests": 5, "victims_slept": 1, "never_attached": 4,
                     "parked_grows": 2},
        "quarantined_bytes": 4 * MiB,
    }
    samples = scrape(metrics)
    assert samples[("kvdaemon_never_attached_total", ())] == 4
    assert samples[("kvdaemon_parked_grows", ())] == 2
    assert samples[("kvdaemon_quarantined_bytes", ())] == 4 * MiB
    assert samples[("kvdaemon_tenant_state", (("state", "sleeping-warm"), ("tenant", "qwen-b")))] == 1
    assert samples[("kvdaemon_tenant_state", (("state", "active"), ("tenant", "llama-a")))] == 1
    for state in ("active", "sleeping-cold"):  # every state has its series: 0 for the others
        assert samples[("kvdaemon_tenant_state", (("state", state), ("tenant", "qwen-b")))] == 0
    assert samples[("kvdaemon_tenant_state", (("state", "sleeping-warm"), ("tenant", "llama-a")))] == 0
    assert samples[("kvdaemon_tenant_host_bytes", (("tenant", "qwen-b"),))] == 6 * MiB
    assert samples[("kvdaemon_host_bytes", ())] == 6 * MiB
    assert samples[("kvdaemon_sleeps_total", ())] == 3
    assert samples[("kvdaemon_victims_slept_total", ())] == 1


def get(metrics: Metrics, path: str) -> tuple[int, str, str]:
    """Status, content type and body of ``GET path``."""
    url = f"http://127.0.0.1:{metrics.bound_port}{path}"
    with urllib.request.urlopen(url, timeout=5) as reply:
        return reply.status, reply.headers["Content-Type"], reply.read().decode()


def test_info_and_up(metrics: Metrics) -> None:
    samples = scrape(metrics)
    assert samples[("kvdaemon_up", ())] == 1
    assert samples[("kvdaemon_info", (("backend", "host"), ("version", __version__)))] == 1


def test_healthz_answers_without_a_snapshot(metrics: Metrics, fake: FakeDaemon) -> None:
    status, content_type, body = get(metrics, "/healthz")
    assert (status, body) == (200, "ok\n")
    assert content_type.startswith("text/plain")
    assert fake.num_snapshots == 0
    assert "kvdaemon_up 1.0" in get(metrics, "/metrics")[2]
    assert fake.num_snapshots == 1


def test_help_texts_name_what_is_counted(metrics: Metrics) -> None:
    _, _, text = get(metrics, "/metrics")
    helps = dict(
        line.removeprefix("# HELP ").split(" ", 1) for line in text.splitlines()
        if line.startswith("# HELP ")
    )  # fmt: skip
    assert all(helps.values()), helps
    assert helps["kvdaemon_granted_pages_total"].startswith("Physical pages")
    assert helps["kvdaemon_shrunk_pages_total"].startswith("Physical pages")


def test_serves_on_the_host_given(fake: FakeDaemon) -> None:
    metrics = Metrics(0, fake.snapshot, host="0.0.0.0")
    metrics.start()
    try:
        assert metrics.url == f"http://0.0.0.0:{metrics.bound_port}/metrics"
        assert get(metrics, "/healthz")[2] == "ok\n"  # reached on 127.0.0.1 too
    finally:
        metrics.stop()
    assert metrics.url is None


def num_threads() -> int:
    return len(psutil.Process().threads())


def test_half_sent_requests_cannot_pile_up_threads(fake: FakeDaemon) -> None:
    """Regression (#10 item 11): 200 clients that send half a request and wait held 200
    threads for good. Now at most ``max_handlers`` are handled at once, each for at most
    ``request_timeout_s``; the rest are closed at once, and scrapes work again after."""
    metrics = Metrics(0, fake.snapshot, request_timeout_s=1.0, max_handlers=4)
    metrics.start()
    before = num_threads()
    stalled: list[socket.socket] = []
    try:
        for _ in range(200):
            sock = socket.create_connection(("127.0.0.1", metrics.bound_port), timeout=5)
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # no blank line: never ends
            stalled.append(sock)
        wait_until(lambda: _closed_by_server(stalled) >= 196)  # all past the cap: closed
        assert num_threads() <= before + 4
        wait_until(lambda: _closed_by_server(stalled) == 200)  # the 4 held: timed out
        assert get(metrics, "/healthz")[2] == "ok\n"
        assert scrape(metrics)[("kvdaemon_up", ())] == 1
    finally:
        for sock in stalled:
            sock.close()
        metrics.stop()


def test_slow_clients_holding_every_handler_cannot_keep_health_checks_out(fake: FakeDaemon) -> None:
    """Regression: 8 connections sending half a request held all 8 handlers, and every
    /healthz and scrape was refused while they were re-opened. A new request now takes
    the slot of the oldest connection still sending its head."""
    metrics = Metrics(0, fake.snapshot, request_timeout_s=30.0, max_handlers=4)
    metrics.start()
    stalled: list[socket.socket] = []
    try:
        for _ in range(8):
            sock = socket.create_connection(("127.0.0.1", metrics.bound_port), timeout=5)
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never ends
            stalled.append(sock)
        for _ in range(5):
            assert get(metrics, "/healthz")[2] == "ok\n"
        assert scrape(metrics)[("kvdaemon_up", ())] == 1
        with pytest.raises(urllib.error.HTTPError, match="404"):
            get(metrics, "/nope")  # only /metrics, / and /healthz are served
    finally:
        for sock in stalled:
            sock.close()
        metrics.stop()


def _closed_by_server(socks: list[socket.socket]) -> int:
    """How many of ``socks`` the server has closed (a read sees EOF or a reset at once)."""
    closed = 0
    for sock in socks:
        sock.setblocking(False)
        try:
            closed += sock.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:
            pass
        except ConnectionResetError:
            closed += 1
    return closed


def wait_until(condition: Any, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
