"""The engine-side shim: connection to the daemon, KV pools, block allocation, attention."""
