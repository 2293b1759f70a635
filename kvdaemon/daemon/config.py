"""The daemon's configuration: one frozen dataclass, built once at the edge.

``load_config`` layers command-line flags over ``KVDAEMON_*`` environment
variables over a TOML file over the defaults, validates every value (raising
``ConfigError`` that names the source and the value) and returns a
:class:`DaemonConfig` that the rest of the daemon receives as-is. Keys are
spelled like the flags (``page-size`` for ``--page-size``; ``page_size`` is
read as the same key); ``deploy/kvdaemon.toml`` lists every one.
``DaemonConfig.to_argv`` writes it back as flags, so a detached start can hand
exactly the resolved configuration to its child process.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvdaemon.errors import ConfigError
from kvdaemon.wire.paths import DaemonPaths, default_dir
from kvdaemon.wire.sizes import SizeSpec, format_bytes, parse_size, percent_of

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

BACKENDS = ("auto", "host", "cuda")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DEFAULT_PAGE_SIZE_BYTES = 2 * 1024 * 1024
OS_PAGE_BYTES = 4096
MAX_SOCKET_PATH_BYTES = 107  # sun_path is 108 bytes including the terminating NUL
DEFAULT_METRICS_HOST = "127.0.0.1"


@dataclass(frozen=True)
class DaemonConfig:
    """Everything a daemon needs to start; validated on construction (``ConfigError``).

    ``capacity`` is resolved against the device's total memory (on the host
    backend, physical RAM) by :meth:`capacity_bytes`.
    """

    dir: Path = field(default_factory=default_dir)
    backend: str = "auto"
    device: int = 0
    capacity: SizeSpec = field(default_factory=lambda: percent_of(50))
    page_size_bytes: int = DEFAULT_PAGE_SIZE_BYTES
    metrics_host: str = DEFAULT_METRICS_HOST
    metrics_port: int | None = None
    idle_sleep_s: float | None = None
    idle_mode: str = "warm"
    reclaim_sleep: bool = True
    log_level: str = "INFO"
    log_file: Path | None = None

    def __post_init__(self) -> None:
        _check_dir(self.dir)
        _check_backend(self.backend)
        _check_device(self.device)
        _check_capacity(self.capacity)
        _check_page_size(self.page_size_bytes)
        _check_host(self.metrics_host)
        _check_port(self.metrics_port)
        _check_idle_sleep(self.idle_sleep_s)
        _check_idle_mode(self.idle_mode)
        _check_log_level(self.log_level)
        _check_log_file(self.log_file)

    @property
    def paths(self) -> DaemonPaths:
        return DaemonPaths(self.dir)

    @property
    def metrics_address(self) -> str | None:
        """``HOST:PORT`` the metrics are served on (``[HOST]:PORT`` for IPv6), or ``None``."""
        if self.metrics_port is None:
            return None
        host = f"[{self.metrics_host}]" if ":" in self.metrics_host else self.metrics_host
        return f"{host}:{self.metrics_port}"

    def capacity_bytes(self, total_bytes: int) -> int:
        """Capacity against a device of ``total_bytes``, rounded down to whole pages.

        Raises ``ConfigError`` when that is less than one page or more than the device has.
        """
        wanted = self.capacity.resolve(total_bytes)
        if wanted > total_bytes:
            raise ConfigError(
                f"capacity {self.capacity} ({format_bytes(wanted)}) exceeds the device's "
                f"{format_bytes(total_bytes)}"
            )
        rounded = wanted - wanted % self.page_size_bytes
        if rounded < self.page_size_bytes:
            raise ConfigError(
                f"capacity {self.capacity} ({format_bytes(wanted)}) is less than one page of "
                f"{format_bytes(self.page_size_bytes)}"
            )
        return rounded

    def to_argv(self) -> list[str]:
        """Flags of ``kvdaemon start`` that reproduce this config exactly (see ``load_config``)."""
        argv = [
            "--dir", str(self.dir),
            "--backend", self.backend,
            "--device", str(self.device),
            "--capacity", str(self.capacity),
            "--page-size", str(self.page_size_bytes),
            "--log-level", self.log_level,
        ]  # fmt: skip
        if self.metrics_address is not None:
            argv += ["--metrics-address", self.metrics_address]
        if self.idle_sleep_s is not None:
            argv += ["--idle-sleep", repr(self.idle_sleep_s), "--idle-mode", self.idle_mode]
        if not self.reclaim_sleep:
            argv += ["--no-reclaim-sleep"]
        if self.log_file is not None:
            argv += ["--log-file", str(self.log_file)]
        return argv


def load_config(
    flags: Mapping[str, Any], env: Mapping[str, str], file: Path | None
) -> DaemonConfig:
    """Build the config: ``flags`` > ``KVDAEMON_*`` in ``env`` > TOML ``file`` > defaults.

    ``flags`` and the file use the keys of ``KEYS`` (``-`` or ``_`` alike); a
    ``None`` flag is unset. ``metrics-address`` and ``metrics-port`` (which
    means ``127.0.0.1:PORT``) exclude each other. Raises ``ConfigError`` for an
    unknown key, an unreadable file or any invalid value, naming where the
    value came from. Reads ``file`` once.
    """
    flags = {key: value for key, (_, value) in _normalised(flags, "setting").items()}
    file_values = _read_toml(file) if file is not None else {}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key, spec in KEYS.items():
        raw, source = _pick(key, flags, env, file_values, file)
        if source is not None:
            values[spec.attr] = _parse_from(source, spec.parse, raw)
            sources[key] = source
    if "metrics-address" in sources and "metrics-port" in sources:
        raise ConfigError(
            f"give the metrics address once: {sources['metrics-address']} and "
            f"{sources['metrics-port']} are both set"
        )
    address = values.pop("metrics_address", None)
    if address is not None:
        values["metrics_host"], values["metrics_port"] = address
    return DaemonConfig(**values)


def dir_from(flag: str | Path | None, env: Mapping[str, str], file: Path | None = None) -> Path:
    """The daemon directory alone: ``flag`` > ``KVDAEMON_DIR`` in ``env`` > ``dir`` in
    the TOML ``file`` > the default. Other keys of the file are checked by name only."""
    if flag is not None:
        return _parse_from("--dir", _parse_dir, flag)
    if env.get("KVDAEMON_DIR"):
        return _parse_from("KVDAEMON_DIR", _parse_dir, env["KVDAEMON_DIR"])
    file_values = _read_toml(file) if file is not None else {}
    if "dir" in file_values:
        return _parse_from(f"{file}: dir", _parse_dir, file_values["dir"][1])
    return _parse_dir(default_dir())


@dataclass(frozen=True)
class _Key:
    attr: str
    flag: str
    env: str
    parse: Callable[[Any], Any]


def _pick(
    key: str,
    flags: Mapping[str, Any],
    env: Mapping[str, str],
    file_values: Mapping[str, tuple[str, Any]],
    file: Path | None,
) -> tuple[Any, str | None]:
    """The raw value of ``key`` and where it came from (flag, variable, ``FILE: key``
    as spelled there), or ``(None, None)``. An empty variable counts as unset."""
    spec = KEYS[key]
    if flags.get(key) is not None:
        return flags[key], spec.flag
    if env.get(spec.env, "") != "":
        return env[spec.env], spec.env
    if key in file_values:
        spelled, value = file_values[key]
        return value, f"{file}: {spelled}"
    return None, None


def _parse_from(source: str, parse: Callable[[Any], Any], raw: Any) -> Any:
    try:
        return parse(raw)
    except ConfigError as err:
        given = "" if str(raw) in err.message else f" (given {raw!r})"
        raise ConfigError(f"{source}: {err.message}{given}") from err


def _read_toml(file: Path) -> dict[str, tuple[str, Any]]:
    """The file's keys (as ``KEYS`` spells them) -> (spelling in the file, value)."""
    try:
        with open(file, "rb") as stream:
            values = tomllib.load(stream)
    except OSError as err:
        raise ConfigError(f"cannot read config file {file}: {err.strerror}") from err
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file {file} is not valid TOML: {err}") from err
    return _normalised(values, f"config file {file}: key")


def _normalised(values: Mapping[str, Any], what: str) -> dict[str, tuple[str, Any]]:
    """``values`` keyed by the spelling of ``KEYS`` (``page_size`` -> ``page-size``),
    each with its own spelling. Raises ``ConfigError`` for an unknown key or one
    given in both spellings."""
    out: dict[str, tuple[str, Any]] = {}
    for key, value in values.items():
        name = key.replace("_", "-")
        if name not in KEYS:
            raise ConfigError(f"{what} {key!r} is unknown; known are {', '.join(KEYS)}")
        if name in out:
            raise ConfigError(f"{what} {name!r} is given twice, as {out[name][0]} and {key}")
        out[name] = (key, value)
    return out


# -- parsers: raw text (or an already typed value) -> checked value -------------------------


def _parse_dir(raw: Any) -> Path:
    if not isinstance(raw, (str, Path)) or not str(raw):
        raise ConfigError(f"directory must be a non-empty path, got {raw!r}")
    path = Path(raw).expanduser().absolute()
    _check_dir(path)
    return path


def _parse_backend(raw: Any) -> str:
    if not isinstance(raw, str):
        raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, got {raw!r}")
    return _check_backend(raw.strip().lower())


def _parse_int(raw: Any, what: str) -> int:
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


def _parse_device(raw: Any) -> int:
    return _check_device(_parse_int(raw, "device"))


def _parse_capacity(raw: Any) -> SizeSpec:
    return _check_capacity(raw if isinstance(raw, SizeSpec) else parse_size(raw))


def _parse_page_size(raw: Any) -> int:
    spec = parse_size(raw)
    if spec.is_percent:
        raise ConfigError(f"page size must be a size in bytes, not a percentage ({raw!r})")
    return _check_page_size(spec.resolve(0))


def _parse_port(raw: Any) -> int | None:
    return _check_port(_parse_int(raw, "metrics port"))


def _parse_metrics_address(raw: Any) -> tuple[str, int]:
    """``HOST:PORT``, ``[IPV6]:PORT`` or a bare ``PORT`` (on 127.0.0.1)."""
    text = str(raw).strip() if isinstance(raw, (str, int)) and not isinstance(raw, bool) else ""
    host, sep, port = text.rpartition(":")
    if not sep:
        host = DEFAULT_METRICS_HOST
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not text or not host or not port.isdigit():
        raise ConfigError(
            f"metrics address must be HOST:PORT (127.0.0.1:9400, 0.0.0.0:9400, [::1]:9400) "
            f"or a port, got {raw!r}"
        )
    return _check_host(host), _check_port(int(port))  # type: ignore[return-value]


def _parse_log_file(raw: Any) -> Path:
    if not isinstance(raw, (str, Path)) or not str(raw):
        raise ConfigError(f"log file must be a non-empty path, got {raw!r}")
    return _check_log_file(Path(raw).expanduser().absolute())  # type: ignore[return-value]


_DURATION_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


def _parse_idle_sleep(raw: Any) -> float | None:
    """Seconds, or text like ``300``, ``300s``, ``5m``, ``1h``; ``off`` disables it."""
    if isinstance(raw, bool):
        raise ConfigError(f"idle sleep must be a duration in seconds, got {raw!r}")
    if isinstance(raw, (int, float)):
        return _check_idle_sleep(float(raw))
    if not isinstance(raw, str):
        raise ConfigError(f"idle sleep must be a duration in seconds, got {raw!r}")
    text = raw.strip().lower()
    if text in ("off", "none"):
        return None
    unit = text[-1:] if text[-1:] in ("s", "m", "h") else ""
    try:
        seconds = float(text[: len(text) - len(unit)]) * _DURATION_UNITS[unit]
    except ValueError as err:
        raise ConfigError(
            f"idle sleep must be a duration like 300, 300s, 5m or 1h, got {raw!r}"
        ) from err
    return _check_idle_sleep(seconds)


def _parse_idle_mode(raw: Any) -> str:
    if not isinstance(raw, str):
        raise ConfigError(f"idle mode must be 'warm' or 'cold', got {raw!r}")
    return _check_idle_mode(raw.strip().lower())


def _parse_reclaim_sleep(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"reclaim sleep must be on or off, got {raw!r}")


def _parse_log_level(raw: Any) -> str:
    if not isinstance(raw, str):
        raise ConfigError(f"log level must be one of {', '.join(LOG_LEVELS)}, got {raw!r}")
    return _check_log_level(raw.strip().upper())


def _key(name: str, attr: str, parse: Callable[[Any], Any]) -> _Key:
    """A setting spelled ``name`` in files and ``--name`` as a flag, read from ``KVDAEMON_NAME``."""
    return _Key(attr, f"--{name}", "KVDAEMON_" + name.upper().replace("-", "_"), parse)


KEYS: dict[str, _Key] = {
    key.flag[2:]: key
    for key in (
        _key("dir", "dir", _parse_dir),
        _key("backend", "backend", _parse_backend),
        _key("device", "device", _parse_device),
        _key("capacity", "capacity", _parse_capacity),
        _key("page-size", "page_size_bytes", _parse_page_size),
        _key("metrics-address", "metrics_address", _parse_metrics_address),
        _key("metrics-port", "metrics_port", _parse_port),
        _key("idle-sleep", "idle_sleep_s", _parse_idle_sleep),
        _key("idle-mode", "idle_mode", _parse_idle_mode),
        _key("reclaim-sleep", "reclaim_sleep", _parse_reclaim_sleep),
        _key("log-level", "log_level", _parse_log_level),
        _key("log-file", "log_file", _parse_log_file),
    )
}


# -- checks on typed values (shared by the parsers and DaemonConfig.__post_init__) ----------


def _check_dir(path: Path) -> Path:
    if not isinstance(path, Path):
        raise ConfigError(f"directory must be a Path, got {path!r}")
    longest = max(len(str(sock).encode()) for sock in DaemonPaths(path).sockets())
    if longest > MAX_SOCKET_PATH_BYTES:
        raise ConfigError(
            f"directory {str(path)!r} is too long: its socket paths would be {longest} bytes, "
            f"a unix socket path holds at most {MAX_SOCKET_PATH_BYTES}"
        )
    return path


def _check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    return backend


def _check_device(device: int) -> int:
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise ConfigError(f"device must be an integer >= 0, got {device!r}")
    return device


def _check_capacity(capacity: SizeSpec) -> SizeSpec:
    if not isinstance(capacity, SizeSpec):
        raise ConfigError(f"capacity must be a size, got {capacity!r}")
    if (capacity.percent if capacity.is_percent else capacity.exact_bytes) == 0:
        raise ConfigError(f"capacity must be more than zero, got {capacity}")
    return capacity


def _check_page_size(page_size_bytes: int) -> int:
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


def _check_host(host: str) -> str:
    if not isinstance(host, str) or not host or any(c.isspace() or c in "[]/" for c in host):
        raise ConfigError(f"metrics host must be an address or host name, got {host!r}")
    return host


def _check_log_file(path: Path | None) -> Path | None:
    if path is not None and not isinstance(path, Path):
        raise ConfigError(f"log file must be a Path, got {path!r}")
    return path


def _check_port(port: int | None) -> int | None:
    if port is None:
        return None
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ConfigError(f"metrics port must be in 1..65535, got {port!r}")
    return port


def _check_idle_sleep(seconds: float | None) -> float | None:
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ConfigError(f"idle sleep must be a positive number of seconds, got {seconds!r}")
    if seconds == float("inf"):
        raise ConfigError("idle sleep must be finite; use 'off' to disable it")
    return float(seconds)


def _check_idle_mode(mode: str) -> str:
    if mode not in ("warm", "cold"):
        raise ConfigError(f"idle mode must be 'warm' or 'cold', got {mode!r}")
    return mode


def _check_log_level(level: str) -> str:
    if level not in LOG_LEVELS:
        raise ConfigError(f"log level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    return level
