"""The engine-side shim: connection to the daemon, KV pools, block allocation, attention."""

from kvdaemon.client.connection import KVClient
from kvdaemon.client.lease import Lease
from kvdaemon.client.spec import KVSpec

__all__ = ["KVClient", "KVSpec", "Lease"]
