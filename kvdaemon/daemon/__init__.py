"""The daemon core: server loop, service and its ops, tenants, grants, limits, reclaim, sleep, metrics, config."""
