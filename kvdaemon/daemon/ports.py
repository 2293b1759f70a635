"""What the daemon core needs from the server's handle channel, as a protocol.

The service and its policy modules (grants, sleep, reclaim) talk to tenants
only through a ``LeasePort``; the server's ``LeaseTable`` implements it, tests
use a recording fake. None of these calls blocks: frames are queued and sent as
the tenant's socket takes them.
"""

from __future__ import annotations

from typing import Any, Protocol

from kvdaemon.wire.messages import Notice


class LeasePort(Protocol):
    """The handle channel as the daemon core sees it."""

    def send_grant(
        self, tenant_id: int, grant_id: int, page_ids: list[int], fds: list[int],
        fd_index: list[int],
    ) -> None:
        """Queue one frame of a grant to the tenant (takes ownership of the fds)."""

    def drop_lease(self, tenant_id: int) -> None:
        """Close the tenant's handle connection, if any."""

    def send_notice(self, tenant_id: int, body: dict[str, Any]) -> None:
        """Queue a notice map to the tenant over its handle connection (dropped if it has none)."""


def notify(leases: LeasePort, tenant_id: int, notice: Notice) -> None:
    """Queue ``notice`` to ``tenant_id``: the one way the core sends notices."""
    leases.send_notice(tenant_id, notice.to_wire())
