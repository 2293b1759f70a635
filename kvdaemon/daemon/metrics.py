"""The daemon's Prometheus endpoint.

:class:`Metrics` owns one private ``CollectorRegistry`` (never the global
one, so several daemons or tests can live in one process) and serves it over
HTTP on the configured address (``127.0.0.1`` by default): ``/metrics`` (and
``/``), ``/healthz``, which answers ``ok`` without touching the daemon's state,
and 404 for anything else. Event metrics (grant latency,
pages granted and shrunk, lease expiries) are updated by the daemon as they
happen and cost a lock and an add each. Pool and tenant gauges are not stored
at all: each scrape calls the ``snapshot`` callable (the ``status`` object of
DESIGN.md §13) from the HTTP server's thread, so ``snapshot`` must be safe to
call from another thread and cheap (O(tenants)).

The server is bounded (``kvdaemon.daemon.http_limits``): at most
``MAX_HANDLERS`` requests are handled at once, each must arrive whole within
``REQUEST_TIMEOUT_S``; connections past the cap are closed unanswered, so
clients that send half a request and wait cannot pile up threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

from kvdaemon import __version__
from kvdaemon.daemon.http_limits import (
    MAX_HANDLERS, REQUEST_TIMEOUT_S, BoundedServer, bounded_server,
)  # fmt: skip
from kvdaemon.daemon.tenant import TenantState
from kvdaemon.errors import ConfigError

STATE_NAMES = tuple(state.value for state in TenantState)  # each tenant's state series, 0 or 1

Snapshot = Callable[[], dict[str, Any]]

# Grants are expected to take from tens of microseconds (one page, host backend)
# to about a second (a large grow on a busy GPU).
GRANT_LATENCY_BUCKETS_S = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip

LISTEN_ADDR = "127.0.0.1"
SHUTDOWN_POLL_S = 0.05  # how often the server thread checks for stop(); bounds stop()'s wait
HEALTH_PATH = "/healthz"
METRICS_PATHS = ("/metrics", "/")

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def _with_health(metrics_app: WsgiApp) -> WsgiApp:
    """``/healthz`` answers ``ok`` at once (no snapshot, no lock); ``METRICS_PATHS`` are
    the metrics; anything else is 404."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO")
        if path == HEALTH_PATH:
            start_response("200 OK", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"ok\n"]
        if path in METRICS_PATHS:
            return metrics_app(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"not found: /metrics and /healthz are served here\n"]

    return app


class _StatusCollector:
    """Turns one ``snapshot()`` per scrape into pool and per-tenant gauges."""

    def __init__(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot

    def describe(self) -> list[Metric]:
        # Nothing to describe up front: registering must not call snapshot().
        return []

    def collect(self) -> Iterator[Metric]:
        status = self._snapshot()
        yield _gauge("kvdaemon_up", "1 while the daemon serves; a failed scrape means it does not.", 1)
        info = InfoMetricFamily("kvdaemon", "The daemon's version and memory backend.")
        info.add_metric([], {"version": __version__, "backend": str(status["backend"])})
        yield info
        yield _gauge("kvdaemon_capacity_bytes", "Bytes of device memory the pool manages.",
                     status["capacity_bytes"])  # fmt: skip
        yield _gauge("kvdaemon_free_bytes", "Bytes of the pool not mapped by any tenant.",
                     status["free_bytes"])  # fmt: skip
        if status.get("device_free_bytes") is not None:
            yield _gauge("kvdaemon_device_free_bytes", "Bytes the device itself reports free (host backend: "
                         "RAM available), whoever holds the rest.", status["device_free_bytes"])  # fmt: skip
        yield _gauge("kvdaemon_quarantined_bytes", "Bytes of departed tenants held until their processes "
                     "unmap them.", status.get("quarantined_bytes", 0))  # fmt: skip
        yield _gauge("kvdaemon_retired_bytes", "Bytes of pages whose release failed, never granted again.",
                     status.get("retired_bytes", 0))  # fmt: skip
        yield _gauge("kvdaemon_parked_grows", "Grows waiting now for pages other tenants give back.",
                     status.get("counters", {}).get("parked_grows", 0))  # fmt: skip
        yield from _tenant_gauges(status["tenants"])
        yield from _sleep_and_reclaim(status)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _tenant_gauges(tenants: list[dict[str, Any]]) -> Iterator[GaugeMetricFamily]:
    mapped = GaugeMetricFamily(
        "kvdaemon_tenant_mapped_bytes", "Bytes of pages mapped by a tenant.", labels=["tenant"]
    )
    used = GaugeMetricFamily(
        "kvdaemon_tenant_used_bytes", "Bytes of blocks a tenant's engine holds.", labels=["tenant"]
    )
    limit = GaugeMetricFamily(
        "kvdaemon_tenant_max_bytes",
        "A tenant's limit in bytes (the capacity where nothing sets a smaller one).",
        labels=["tenant"],
    )
    refused = CounterMetricFamily(
        "kvdaemon_tenant_refused_grows", "Grows of a tenant refused (by the daemon, or by its pool past its "
        "limit) since it registered.", labels=["tenant"],
    )  # fmt: skip
    unpaid = CounterMetricFamily(
        "kvdaemon_tenant_unpaid_reclaims", "Urgent reclaim asks to a tenant that lapsed with nothing given "
        "back, since it registered.", labels=["tenant"],
    )  # fmt: skip
    for tenant in tenants:
        name = [str(tenant["name"])]
        mapped.add_metric(name, tenant["mapped_bytes"])
        used.add_metric(name, tenant["used_bytes"])
        if tenant.get("max_bytes") is not None:
            limit.add_metric(name, tenant["max_bytes"])
        refused.add_metric(name, tenant.get("refused_grows", 0))
        unpaid.add_metric(name, tenant.get("unpaid_reclaims", 0))
    yield from (mapped, used, limit, refused, unpaid)


def _sleep_and_reclaim(status: dict[str, Any]) -> Iterator[Metric]:
    """Tenant states, host bytes of warm sleepers, and the sleep and reclaim counters."""
    state = GaugeMetricFamily(
        "kvdaemon_tenant_state", "1 for the state a tenant is in, 0 for each other state.",
        labels=["tenant", "state"],
    )
    host = GaugeMetricFamily(
        "kvdaemon_tenant_host_bytes", "Bytes a warm sleeper keeps in host memory.",
        labels=["tenant"],
    )
    for tenant in status["tenants"]:
        for name in STATE_NAMES:
            state.add_metric([str(tenant["name"]), name], int(name == tenant["state"]))
        host.add_metric([str(tenant["name"])], tenant.get("host_bytes", 0))
    yield from (state, host)
    yield _gauge("kvdaemon_host_bytes", "Bytes all warm sleepers keep in host memory.",
                 status.get("host_bytes", 0))  # fmt: skip
    counters = status.get("counters", {})
    for key, doc in (("sleeps", "Tenants put to sleep."), ("wakes", "Tenants woken."),
                     ("reclaim_requests", "Reclaim requests sent to tenants."),
                     ("victims_slept", "Idle tenants slept to serve another's grow."),
                     ("never_attached", "Registered tenants dropped without ever attaching.")):  # fmt: skip
        yield CounterMetricFamily(f"kvdaemon_{key}", doc, value=counters.get(key, 0))


class Metrics:
    """Prometheus metrics of one daemon, served on ``host:port`` once started.

    ``port`` 0 binds a free port (read it back from ``bound_port``). The
    recording methods work whether or not the server is running.
    ``request_timeout_s`` and ``max_handlers`` bound the HTTP server (see the
    module docstring).
    """

    def __init__(
        self,
        port: int,
        snapshot: Snapshot,
        host: str = LISTEN_ADDR,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        max_handlers: int = MAX_HANDLERS,
    ) -> None:
        self.host = host
        self.port = port
        self.request_timeout_s = request_timeout_s
        self.max_handlers = max_handlers
        self.registry = CollectorRegistry()
        self._collector = _StatusCollector(snapshot)
        self._grant_latency = Histogram(
            "kvdaemon_grant_latency_seconds",
            "Time the daemon took to serve one grow (checks, page grants), in seconds.",
            buckets=GRANT_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self._granted_pages = Counter(
            "kvdaemon_granted_pages", "Physical pages granted to tenants by grows.",
            registry=self.registry,
        )
        self._shrunk_pages = Counter(
            "kvdaemon_shrunk_pages", "Physical pages tenants gave back by shrinks.",
            registry=self.registry,
        )
        self._lease_expiries = Counter(
            "kvdaemon_lease_expiries",
            "Tenants whose lease ended without unregistering (process died).",
            registry=self.registry,
        )
        self._server: BoundedServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def bound_port(self) -> int | None:
        """The port the server listens on, or ``None`` when it is not running."""
        return None if self._server is None else self._server.server_port

    @property
    def url(self) -> str | None:
        """``http://HOST:PORT/metrics`` while serving, else ``None``."""
        if self._server is None:
            return None
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.bound_port}/metrics"

    def start(self) -> None:
        """Register the status collector and serve on ``host:port`` from a daemon thread.

        Raises ``ConfigError`` naming the address when it cannot be bound. Idempotent.
        """
        if self._server is not None:
            return
        self.registry.register(self._collector)
        try:
            server = bounded_server(
                self.host, self.port, _with_health(make_wsgi_app(self.registry)),
                request_timeout_s=self.request_timeout_s, max_handlers=self.max_handlers,
            )  # fmt: skip
        except OSError as err:
            self.registry.unregister(self._collector)
            raise ConfigError(
                f"cannot serve metrics on {self.host}:{self.port}: {err.strerror or err}"
            ) from err
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, args=(SHUTDOWN_POLL_S,), name="kvdaemon-metrics",
            daemon=True,
        )  # fmt: skip
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and close the listening socket; waits for the server thread
        (at most about ``SHUTDOWN_POLL_S`` plus a scrape in progress). Idempotent."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join()
        self.registry.unregister(self._collector)
        self._server = None
        self._thread = None

    def observe_grant(self, seconds: float, num_pages: int) -> None:
        """Record one grant that took ``seconds`` and gave ``num_pages`` physical pages."""
        self._grant_latency.observe(seconds)
        self._granted_pages.inc(num_pages)

    def count_shrink(self, num_pages: int) -> None:
        """Record ``num_pages`` physical pages returned to the pool."""
        self._shrunk_pages.inc(num_pages)

    def count_lease_expiry(self) -> None:
        """Record one tenant whose lease ended because its process went away."""
        self._lease_expiries.inc()
