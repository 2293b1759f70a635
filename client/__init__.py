"""The engine-side shim: connection to the daemon, KV pools, block allocation, attention."""

from kvdaemon.client.connection import KVClient
from kvdaemon.client.lease import Lease
from kvdaemon.client.pool import KVPool
from kvdaemon.client.spec import KVSpec
from kvdaemon.errors import PoolExhausted

__all__ = ["KVClient", "KVPool", "KVSpec", "Lease", "PoolExhausted"]
