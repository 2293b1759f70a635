"""The engine-side shim: connection to the daemon, KV pools, block allocation, attention.

``KVPool`` and ``Lease`` load on first use (PEP 562): a process that only talks to the daemon
(the CLI) does not import the pool's machinery.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvdaemon.client.connection import KVClient
from kvdaemon.client.spec import KVSpec
from kvdaemon.errors import PoolExhausted
from kvdaemon.lazy_names import lazy_names

if TYPE_CHECKING:
    from kvdaemon.client.lease import Lease
    from kvdaemon.client.pool import KVPool

_LAZY = {"KVPool": "kvdaemon.client.pool", "Lease": "kvdaemon.client.lease"}

__all__ = ["KVClient", "KVPool", "KVSpec", "Lease", "PoolExhausted"]


__getattr__ = lazy_names(__name__, _LAZY, globals())
