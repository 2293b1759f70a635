"""``PluginConfig``: what the vLLM plugin was asked to do, read once from the environment.

Variables (read by ``PluginConfig.from_env`` at plugin load, never at import):

- ``KVDAEMON_VLLM_TENANT``: the tenant name (1-128 characters of letters, digits
  and ``._:-``, starting with a letter or digit); unset or empty, the plugin does nothing;
- ``KVDAEMON_DIR``: the daemon's directory (default: ``kvdaemon.wire.paths.default_dir``, as every client);
- ``KVDAEMON_VLLM_MAX`` / ``KVDAEMON_VLLM_MIN``: the tenant's limit and
  guarantee, as ``kvdaemon limit`` takes them (``8GiB``, ``40%`` of the daemon,
  ``none``); a limit of 0 bytes, or a guarantee above the limit once both are
  resolved against the daemon's capacity (``limits``), is refused;
- ``KVDAEMON_VLLM_WEIGHT``: its share under contention, within the daemon's
  ``[1e-06, 1e+06]`` (default 1).

Every refusal is a ``ConfigError`` whose message starts with the variable and its value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from kvdaemon.daemon.policies import MAX_WEIGHT, MIN_WEIGHT
from kvdaemon.daemon.tenant import NAME_PATTERN
from kvdaemon.errors import ConfigError
from kvdaemon.wire.sizes import SizeSpec, format_bytes, parse_size

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
        if not NAME_PATTERN.fullmatch(tenant):
            raise ConfigError(f"{TENANT_VAR}={tenant!r}: a tenant name is 1-128 characters of letters, digits "
                              "and ._:- starting with a letter or digit")
        max_size = _size(env, "KVDAEMON_VLLM_MAX")
        if max_size is not None and max_size.resolve(1 << 62) == 0:
            raise ConfigError(f"KVDAEMON_VLLM_MAX={env['KVDAEMON_VLLM_MAX'].strip()!r}: a limit of 0 bytes leaves "
                              "the engine no KV cache; unset it for no limit")
        return cls(
            tenant=tenant,
            dir=env.get("KVDAEMON_DIR") or None,
            max_size=max_size,
            min_size=_size(env, "KVDAEMON_VLLM_MIN"),
            weight=_weight(env, "KVDAEMON_VLLM_WEIGHT"),
        )

    def max_bytes(self, capacity_bytes: int) -> int | None:
        return None if self.max_size is None else self.max_size.resolve(capacity_bytes)

    def min_bytes(self, capacity_bytes: int) -> int:
        return 0 if self.min_size is None else self.min_size.resolve(capacity_bytes)

    def limits(self, capacity_bytes: int, logical_page_bytes: int = 0) -> tuple[int | None, int]:
        """``(max_bytes, min_bytes)`` against the daemon's capacity; ``ConfigError`` naming the
        variables when the guarantee is above the capacity or the limit, or the limit under
        ``logical_page_bytes`` (one page of every segment: the engine could map no block)."""
        max_bytes, min_bytes = self.max_bytes(capacity_bytes), self.min_bytes(capacity_bytes)
        if max_bytes is not None and max_bytes < logical_page_bytes:
            raise ConfigError(
                f"KVDAEMON_VLLM_MAX means {format_bytes(max_bytes)}, less than one page of every layer's K "
                f"and V ({format_bytes(logical_page_bytes)} for this model on this daemon): the engine "
                "could map no block; raise it or unset it"
            )
        if min_bytes > capacity_bytes:
            raise ConfigError(f"KVDAEMON_VLLM_MIN means {format_bytes(min_bytes)}, more than this daemon's "
                              f"capacity of {format_bytes(capacity_bytes)}")
        if max_bytes is not None and min_bytes > max_bytes:
            raise ConfigError(
                f"KVDAEMON_VLLM_MIN means {format_bytes(min_bytes)}, above KVDAEMON_VLLM_MAX's "
                f"{format_bytes(max_bytes)} (against this daemon's {format_bytes(capacity_bytes)}): "
                "a guarantee cannot exceed the limit"
            )
        return max_bytes, min_bytes


def _size(env: Mapping[str, str], var: str) -> SizeSpec | None:
    text = env.get(var, "").strip()
    if not text or text.lower() == "none":
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
    if not MIN_WEIGHT <= weight <= MAX_WEIGHT:
        raise ConfigError(f"{var}={text!r}: a weight is within [{MIN_WEIGHT:g}, {MAX_WEIGHT:g}]")
    return weight
