"""Parsing and checking one setting's value, wherever it came from.

``parse_*`` turn raw text (a flag, a ``KVDAEMON_*`` variable) or an already
typed TOML value into a checked value; ``check_*`` check a typed value (also
used by ``DaemonConfig.__post_init__``). Each raises ``ConfigError`` saying
what is expected; ``kvdaemon.daemon.config`` adds where the value came from.
Pure and O(length of the value), except ``check_dir``'s path arithmetic.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvdaemon.daemon.policies import Policy, check_consistent, parse_policy
from kvdaemon.daemon.tenant import check_name
from kvdaemon.errors import ConfigError, KVDaemonError
from kvdaemon.wire.paths import DaemonPaths
from kvdaemon.wire.sizes import SizeSpec, parse_size

BACKENDS = ("auto", "host", "cuda")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
OS_PAGE_BYTES = 4096
MAX_SOCKET_PATH_BYTES = 107  # sun_path is 108 bytes including the terminating NUL
DEFAULT_METRICS_HOST = "127.0.0.1"


# -- parsers: raw text (or an already typed value) -> checked value -------------------------


def parse_dir(raw: Any) -> Path:
    if not isinstance(raw, (str, Path)) or not str(raw):
        raise ConfigError(f"directory must be a non-empty path, got {raw!r}")
    path = Path(raw).expanduser().absolute()
    check_dir(path)
    return path


def parse_backend(raw: Any) -> str:
    if not isinstance(raw, str):
        raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, got {raw!r}")
    return check_backend(raw.strip().lower())


def parse_int(raw: Any, what: str) -> int:
    if isinstance(raw, bool):
        raise ConfigError(f"{what} must be an integer, got {raw!r}")
    if isinstance(raw, int):
        return raw
    if isinstance(raw, str):
        try:
            return int(raw.strip())
        except ValueError as err:
            raise ConfigError(f"{what} must be an integer, got {raw!r}") from err
    raise ConfigError(f"{what} must be an integer, got {raw!r}")


def parse_device(raw: Any) -> int:
    return check_device(parse_int(raw, "device"))


def parse_capacity(raw: Any) -> SizeSpec:
    return check_capacity(raw if isinstance(raw, SizeSpec) else parse_size(raw))


def parse_warm_memory(raw: Any) -> SizeSpec:
    return check_warm_memory(raw if isinstance(raw, SizeSpec) else parse_size(raw))


def parse_page_size(raw: Any) -> int:
    spec = parse_size(raw)
    if spec.is_percent:
        raise ConfigError(f"page size must be a size in bytes, not a percentage ({raw!r})")
    return check_page_size(spec.resolve(0))


def parse_port(raw: Any) -> int | None:
    return check_port(parse_int(raw, "metrics port"))


def parse_metrics_address(raw: Any) -> tuple[str, int] | None:
    """``HOST:PORT``, ``[IPV6]:PORT`` or a bare ``PORT`` (on 127.0.0.1); ``off`` (or ``none``):
    no metrics, ``None``."""
    text = str(raw).strip() if isinstance(raw, (str, int)) and not isinstance(raw, bool) else ""
    if text.lower() in ("off", "none"):
        return None
    host, sep, port = text.rpartition(":")
    if not sep:
        host = DEFAULT_METRICS_HOST
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not text or not host or not port.isdigit():
        raise ConfigError(
            f"metrics address must be HOST:PORT (127.0.0.1:9400, 0.0.0.0:9400, [::1]:9400), "
            f"a port, or off, got {raw!r}"
        )
    return check_host(host), check_port(int(port))  # type: ignore[return-value]


def parse_log_file(raw: Any) -> Path:
    if not isinstance(raw, (str, Path)) or not str(raw):
        raise ConfigError(f"log file must be a non-empty path, got {raw!r}")
    return check_log_file(Path(raw).expanduser().absolute())  # type: ignore[return-value]


DURATION_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_idle_sleep(raw: Any) -> float | None:
    """Seconds, or text like ``300``, ``300s``, ``5m``, ``1h``; ``off`` disables it."""
    if isinstance(raw, bool):
        raise ConfigError(f"idle sleep must be a duration in seconds, got {raw!r}")
    if isinstance(raw, (int, float)):
        return check_idle_sleep(float(raw))
    if not isinstance(raw, str):
        raise ConfigError(f"idle sleep must be a duration in seconds, got {raw!r}")
    text = raw.strip().lower()
    if text in ("off", "none"):
        return None
    unit = text[-1:] if text[-1:] in ("s", "m", "h") else ""
    try:
        seconds = float(text[: len(text) - len(unit)]) * DURATION_UNITS[unit]
    except ValueError as err:
        raise ConfigError(
            f"idle sleep must be a duration like 300, 300s, 5m or 1h, got {raw!r}"
        ) from err
    return check_idle_sleep(seconds)


def parse_idle_mode(raw: Any) -> str:
    if not isinstance(raw, str):
        raise ConfigError(f"idle mode must be 'warm' or 'cold', got {raw!r}")
    return check_idle_mode(raw.strip().lower())


def parse_reclaim_sleep(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"reclaim sleep must be on or off, got {raw!r}")


def parse_log_level(raw: Any) -> str:
    if not isinstance(raw, str):
        raise ConfigError(f"log level must be one of {', '.join(LOG_LEVELS)}, got {raw!r}")
    return check_log_level(raw.strip().upper())


def parse_tenants(raw: Any) -> tuple[tuple[str, Policy], ...]:
    """The ``[tenants.NAME]`` tables of a config file: ``max``, ``min``, ``weight`` each."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"tenants must be tables [tenants.NAME], got {raw!r}")
    policies = []
    for name, table in raw.items():
        if not isinstance(table, Mapping):
            raise ConfigError(f"tenants.{name} must be a table of max, min, weight, got {table!r}")
        policies.append((_tenant_name(name), parse_policy(table, f"tenants.{name}")))
    return check_tenants(tuple(sorted(policies, key=lambda item: item[0])))


def parse_tenant_flags(raw: Sequence[str]) -> tuple[tuple[str, Policy], ...]:
    """Policies given as JSON objects ``{"name": ..., "max": ..., ...}`` (``to_argv``'s form)."""
    table: dict[str, Any] = {}
    for text in raw:
        try:
            item = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"a tenant policy must be a JSON object, got {text!r}") from err
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ConfigError(f"a tenant policy needs a \"name\", got {text!r}")
        table[item.pop("name")] = item
    return parse_tenants(table)


def _tenant_name(name: str) -> str:
    try:
        return check_name(name)
    except KVDaemonError as err:
        raise ConfigError(err.message) from err


# -- checks on typed values (shared by the parsers and DaemonConfig.__post_init__) ----------


def check_dir(path: Path) -> Path:
    if not isinstance(path, Path):
        raise ConfigError(f"directory must be a Path, got {path!r}")
    longest = max(len(str(sock).encode()) for sock in DaemonPaths(path).sockets())
    if longest > MAX_SOCKET_PATH_BYTES:
        raise ConfigError(
            f"directory {str(path)!r} is too long: its socket paths would be {longest} bytes, "
            f"a unix socket path holds at most {MAX_SOCKET_PATH_BYTES}"
        )
    return path


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    return backend


def check_device(device: int, backend: str = "auto") -> int:
    """A GPU's index; the host backend has device 0 alone (any other is a mistake to say)."""
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise ConfigError(f"device must be an integer >= 0, got {device!r}")
    if backend == "host" and device:
        raise ConfigError(f"device {device} with backend host: --device chooses a CUDA GPU "
                          "(host memory is device 0); drop it or use --backend cuda")
    return device


def check_capacity(capacity: SizeSpec) -> SizeSpec:
    if not isinstance(capacity, SizeSpec):
        raise ConfigError(f"capacity must be a size, got {capacity!r}")
    if (capacity.percent if capacity.is_percent else capacity.exact_bytes) == 0:
        raise ConfigError(f"capacity must be more than zero, got {capacity}")
    return capacity


def check_warm_memory(warm_memory: SizeSpec) -> SizeSpec:
    """Host memory warm sleepers' KV may take: a size, or a percentage of RAM (0: none)."""
    if not isinstance(warm_memory, SizeSpec):
        raise ConfigError(f"warm memory must be a size, got {warm_memory!r}")
    return warm_memory


def check_page_size(page_size_bytes: int) -> int:
    if (
        isinstance(page_size_bytes, bool)
        or not isinstance(page_size_bytes, int)
        or page_size_bytes <= 0
        or page_size_bytes % OS_PAGE_BYTES
    ):
        raise ConfigError(
            f"page size must be a positive multiple of {OS_PAGE_BYTES} bytes, "
            f"got {page_size_bytes!r}"
        )
    return page_size_bytes


def check_host(host: str) -> str:
    if not isinstance(host, str) or not host or any(c.isspace() or c in "[]/" for c in host):
        raise ConfigError(f"metrics host must be an address or host name, got {host!r}")
    return host


def check_log_file(path: Path | None) -> Path | None:
    if path is not None and not isinstance(path, Path):
        raise ConfigError(f"log file must be a Path, got {path!r}")
    return path


def check_port(port: int | None) -> int | None:
    if port is None:
        return None
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ConfigError(f"metrics port must be in 1..65535, got {port!r}")
    return port


def check_idle_sleep(seconds: float | None) -> float | None:
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ConfigError(f"idle sleep must be a positive number of seconds, got {seconds!r}")
    if seconds == float("inf"):
        raise ConfigError("idle sleep must be finite; use 'off' to disable it")
    return float(seconds)


def check_idle_mode(mode: str) -> str:
    if mode not in ("warm", "cold"):
        raise ConfigError(f"idle mode must be 'warm' or 'cold', got {mode!r}")
    return mode


def check_log_level(level: str) -> str:
    if level not in LOG_LEVELS:
        raise ConfigError(f"log level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    return level


def check_tenants(tenants: tuple[tuple[str, Policy], ...]) -> tuple[tuple[str, Policy], ...]:
    if not isinstance(tenants, tuple) or not all(
        isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], Policy) for item in tenants
    ):
        raise ConfigError(f"tenants must be (name, Policy) pairs, got {tenants!r}")
    for name, policy in tenants:
        check_consistent(policy, f"tenants.{name}")
    return tenants
