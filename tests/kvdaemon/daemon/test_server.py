"""Server-level faults: failed sends during an op, bad attach tokens, revoked leases."""

from __future__ import annotations

import logging
import socket
import threading
from contextlib import closing

import pytest

from kvdaemon.client import KVSpec
from kvdaemon.client.pool_state import PoolState
from kvdaemon.cuda_vmm import host
from kvdaemon.errors import DaemonUnreachable, KVDaemonError, PoolClosed
from kvdaemon.wire.handles import recv_frame, send_frame
from kvdaemon.wire.sizes import format_bytes

from tests.conftest import RunningDaemon, running_daemon, small_spec, wait_until
from tests.kvdaemon.daemon.test_hostile_transport import register_raw


def test_a_send_failing_inside_grow_does_not_hang_the_daemon(kvd: RunningDaemon) -> None:
    client = kvd.client(timeout_s=1.0)
    lease = client.lease("a", small_spec(), num_virtual_pages=4)
    conn = kvd.daemon.leases.grant_conns[lease.tenant_id]  # grants travel on the grant channel

    def broken_pipe() -> bool:
        raise BrokenPipeError("peer gone")

    conn.outbox.flush = broken_pipe  # type: ignore[method-assign]
    with pytest.raises(DaemonUnreachable):
        lease.grow([0])  # the grant's fds can never arrive
    status = kvd.client().status()  # the daemon still serves, and the lease is over
    assert status["tenants"] == []  # its page is quarantined: the (live) test process got its fd
    assert status["free_bytes"] + status["quarantined_bytes"] == status["capacity_bytes"]
    kvd.check_invariants()
    client.close()


def test_non_ascii_attach_token_is_refused(kvd: RunningDaemon) -> None:
    client = kvd.client()
    client.call("register", {"name": "a", "spec": small_spec().to_wire(), "num_virtual_pages": 2})
    with closing(socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)) as sock:
        sock.settimeout(5)
        sock.connect(str(client.paths.handle_socket))
        send_frame(sock, {"tenant": "a", "token": "ü" * 32})
        body, _ = recv_frame(sock)
        assert body["error"]["code"] == "FORBIDDEN"
    assert client.status()["tenants"][0]["name"] == "a"


def test_revoked_pool_unmaps_and_refuses_alloc(kvd: RunningDaemon) -> None:
    client = kvd.client()
    spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16, dtype="float16")
    pool = client.register("a", spec)
    pool.alloc(8)
    held = pool.mapped_bytes
    assert pool.lease._sock is not None
    send_frame(pool.lease._sock, {"unexpected": True})  # a protocol violation
    wait_until(lambda: pool.state is PoolState.REVOKED)
    assert pool.mapped_bytes == 0
    with pytest.raises(PoolClosed, match="revoked"):
        pool.alloc(pool.num_blocks)
    status = client.status()  # the daemon cannot know it unmapped: quarantined while it lives
    assert status["tenants"] == [] and status["quarantined_bytes"] == held
    assert status["free_bytes"] + held == status["capacity_bytes"]
    pool.close()
    client.close()


def test_a_sleep_waiting_when_the_daemon_stops_is_told_the_daemon_stopped() -> None:
    with running_daemon() as kvd:
        client = kvd.client()
        sock, _ = register_raw(client, "stuck")  # never reads its channel: never quiesces
        outcome: dict[str, KVDaemonError] = {}

        def ask_sleep() -> None:
            try:
                kvd.client(timeout_s=10).call("sleep", {"name": "stuck"})
            except KVDaemonError as exc:
                outcome["error"] = exc

        asker = threading.Thread(target=ask_sleep)
        asker.start()
        service = kvd.daemon.service
        assert service is not None
        wait_until(lambda: service.tenants.named("stuck").pending_sleep is not None, 5, "no sleep pending")
        kvd.daemon.stop()
        asker.join(15)
        sock.close()
    error = outcome["error"]
    assert isinstance(error, DaemonUnreachable) and "the daemon stopped before the tenant slept" in error.message


@pytest.mark.parametrize(("os_cap", "warned"), [(1200, True), (100000, False)])
def test_start_warns_where_a_tenant_could_not_map_the_whole_capacity(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, os_cap: int, warned: bool
) -> None:
    monkeypatch.setattr(host, "max_mappings", lambda: os_cap - os_cap // 4)  # the backend reads it at start
    caplog.set_level(logging.WARNING, logger="kvdaemon.daemon.server")
    elsewhere = host.process_mappings()  # other tests' backends still alive
    with running_daemon("64MiB", page_size_bytes=64 * 1024):  # 1,024 pages
        pass
    lines = [r.getMessage() for r in caplog.records if "vm.max_map_count" in r.getMessage()]
    mappable = os_cap - os_cap // 4 - elsewhere  # 1,500 in a process that maps nothing else
    assert lines == ([f"a tenant process may map about {mappable} of the 1024 pages before its memory mappings "
                      f"reach vm.max_map_count ({format_bytes(mappable * 64 * 1024)}); past that its grows are "
                      "refused: raise vm.max_map_count or the page size"] if warned else [])
