"""The engine-side shim: connection to the daemon, KV pools, block allocation, attention.

``KVPool`` and ``Lease`` load on first use (PEP 562): a process that only talks to the daemon
(the CLI) does not import the pool's machinery.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvdaemon.client.connection import KVClient
from kvdaemon.client.spec import KVSpec
from kvdaemon.errors import PoolExhausted

if TYPE_CHECKING:
    from kvdaemon.client.lease import Lease
    from kvdaemon.client.pool import KVPool

_LAZY = {"KVPool": "kvdaemon.client.pool", "Lease": "kvdaemon.client.lease"}

__all__ = ["KVClient", "KVPool", "KVSpec", "Lease", "PoolExhausted"]


def __getattr__(name: str) -> Any:
    """Import ``KVPool`` or ``Lease`` when first asked for."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
