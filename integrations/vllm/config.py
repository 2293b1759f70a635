"""``PluginConfig``: what the vLLM plugin was asked to do, read once from the environment.

Variables (read by ``PluginConfig.from_env`` at plugin load, never at import):

- ``KVDAEMON_VLLM_TENANT``: the tenant name; unset or empty, the plugin does nothing;
- ``KVDAEMON_DIR``: the daemon's directory (default: ``kvdaemon.wire.paths.default_dir``, as every client);
- ``KVDAEMON_VLLM_MAX`` / ``KVDAEMON_VLLM_MIN``: the tenant's limit and
  guarantee, as ``kvdaemon limit`` takes them (``8GiB``, ``40%`` of the daemon);
- ``KVDAEMON_VLLM_WEIGHT``: its share under contention (default 1).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from kvdaemon.errors import ConfigError
from kvdaemon.wire.sizes import SizeSpec, parse_size

TENANT_VAR = "KVDAEMON_VLLM_TENANT"


@dataclass(frozen=True)
class PluginConfig:
    """One vLLM engine's tenant settings; sizes resolve against the daemon's capacity."""

    tenant: str
    dir: str | None = None  # noqa: A003 - the daemon directory, as KVClient names it
    max_size: SizeSpec | None = None
    min_size: SizeSpec | None = None
    weight: float = 1.0

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> PluginConfig | None:
        """The config the variables describe, or ``None`` when no tenant is named.

        Raises ``ConfigError`` naming the variable for a malformed value.
        """
        tenant = env.get(TENANT_VAR, "").strip()
        if not tenant:
            return None
        return cls(
            tenant=tenant,
            dir=env.get("KVDAEMON_DIR") or None,
            max_size=_size(env, "KVDAEMON_VLLM_MAX"),
            min_size=_size(env, "KVDAEMON_VLLM_MIN"),
            weight=_weight(env, "KVDAEMON_VLLM_WEIGHT"),
        )

    def max_bytes(self, capacity_bytes: int) -> int | None:
        return None if self.max_size is None else self.max_size.resolve(capacity_bytes)

    def min_bytes(self, capacity_bytes: int) -> int:
        return 0 if self.min_size is None else self.min_size.resolve(capacity_bytes)


def _size(env: Mapping[str, str], var: str) -> SizeSpec | None:
    text = env.get(var, "").strip()
    if not text:
        return None
    try:
        return parse_size(text)
    except ConfigError as exc:
        raise ConfigError(f"{var}={text!r}: {exc.message}") from exc


def _weight(env: Mapping[str, str], var: str) -> float:
    text = env.get(var, "").strip()
    if not text:
        return 1.0
    try:
        weight = float(text)
    except ValueError:
        weight = math.nan
    if not math.isfinite(weight) or weight <= 0:
        raise ConfigError(f"{var}={text!r}: a weight is a positive number")
    return weight
