"""The daemon's configuration: one frozen dataclass, built once at the edge.

``load_config`` layers command-line flags over ``KVDAEMON_*`` environment
variables over a TOML file over the defaults, validates every value (raising
``ConfigError`` that names the source and the value) and returns a
:class:`DaemonConfig` that the rest of the daemon receives as-is. Keys are
spelled like the flags (``page-size`` for ``--page-size``; ``page_size`` is
read as the same key); ``deploy/kvdaemon.toml`` lists every one. The file's
``[tenants.NAME]`` tables (``max``, ``min``, ``weight``) are operator policies
for tenant names (``kvdaemon.daemon.policies``); they have no flag or variable
of their own.
``DaemonConfig.to_argv`` writes it back as flags, so a detached start can hand
exactly the resolved configuration to its child process.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvdaemon.daemon import config_values as values
from kvdaemon.daemon.policies import Policy
from kvdaemon.errors import ConfigError
from kvdaemon.wire.paths import DaemonPaths, default_dir
from kvdaemon.wire.sizes import SizeSpec, format_bytes, percent_of

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

DEFAULT_PAGE_SIZE_BYTES = 2 * 1024 * 1024


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
    metrics_host: str = values.DEFAULT_METRICS_HOST
    metrics_port: int | None = None
    idle_sleep_s: float | None = None
    idle_mode: str = "warm"
    reclaim_sleep: bool = True
    warm_memory: SizeSpec = field(default_factory=lambda: percent_of(50))  # of RAM: warm sleepers' KV
    log_level: str = "INFO"
    log_file: Path | None = None
    # Timing knobs of the daemon's exchanges (programmatic only: no flags, kept by
    # ``to_argv`` at their defaults). Tests shorten them instead of patching a live daemon.
    sleep_timeout_s: float = 10.0  # a tenant asked to sleep must quiesce within this
    reclaim_wait_s: float = 2.0  # the longest a grow may wait for other tenants' pages
    reclaim_escalate_s: float = 0.25  # then every victim is asked; at twice this one sleeps
    victim_idle_s: float = 5.0  # ... if idle this long (a busy engine says so every second)
    attach_timeout_s: float = 10.0  # a registered tenant must attach its handle channel within this
    # Operator policies by tenant name ([tenants.NAME] of the config file), sorted by name.
    tenants: tuple[tuple[str, Policy], ...] = ()

    def __post_init__(self) -> None:
        values.check_dir(self.dir)
        values.check_backend(self.backend)
        values.check_device(self.device, self.backend)
        values.check_capacity(self.capacity)
        values.check_warm_memory(self.warm_memory)
        values.check_page_size(self.page_size_bytes)
        values.check_host(self.metrics_host)
        values.check_port(self.metrics_port)
        values.check_idle_sleep(self.idle_sleep_s)
        values.check_idle_mode(self.idle_mode)
        values.check_log_level(self.log_level)
        values.check_log_file(self.log_file)
        values.check_tenants(self.tenants)

    @property
    def tenant_policies(self) -> dict[str, Policy]:
        return dict(self.tenants)

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
        if self.warm_memory != percent_of(50):
            argv += ["--warm-memory", str(self.warm_memory)]
        if self.idle_sleep_s is not None:
            argv += ["--idle-sleep", repr(self.idle_sleep_s), "--idle-mode", self.idle_mode]
        if not self.reclaim_sleep:
            argv += ["--no-reclaim-sleep"]
        if self.log_file is not None:
            argv += ["--log-file", str(self.log_file)]
        for name, policy in self.tenants:
            argv += [TENANT_FLAG, json.dumps({"name": name, **policy.to_json()})]
        return argv


def load_config(
    flags: Mapping[str, Any], env: Mapping[str, str], file: Path | None
) -> DaemonConfig:
    """Build the config: ``flags`` > ``KVDAEMON_*`` in ``env`` > TOML ``file`` > defaults.

    ``flags`` and the file use the keys of ``KEYS`` (``-`` or ``_`` alike); a
    ``None`` flag is unset. ``metrics-address`` and ``metrics-port`` (which
    means ``127.0.0.1:PORT``) are one setting: from two sources, the one that
    ranks higher wins (a flag over the file's); from one source, both is an
    error. ``metrics-address off`` serves no metrics. Tenant policies come from the
    file's ``[tenants]``, or all from the flag ``tenant-policy`` (JSON objects,
    how ``to_argv`` hands them to a detached daemon) when that is given.
    Raises ``ConfigError`` for an unknown key, an unreadable file or any
    invalid value, naming where the value came from. Reads ``file`` once.
    """
    flags = dict(flags)
    policy_flags = flags.pop(TENANT_FLAG[2:], None)
    flags = {key: value for key, (_, value) in _normalised(flags, "setting").items()}
    file_values, file_tenants = _read_toml(file) if file is not None else ({}, None)
    settings: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key, spec in KEYS.items():
        raw, source = _pick(key, flags, env, file_values, file)
        if source is not None:
            settings[spec.attr] = _parse_from(source, spec.parse, raw)
            sources[key] = source
    _one_metrics_address(settings, sources)
    if "metrics-address" in sources:
        address = settings.pop("metrics_address")
        settings["metrics_host"], settings["metrics_port"] = address or (values.DEFAULT_METRICS_HOST, None)
    if policy_flags:
        settings["tenants"] = _parse_from(TENANT_FLAG, values.parse_tenant_flags, policy_flags)
    elif file_tenants is not None:
        settings["tenants"] = _parse_from(f"{file}: tenants", values.parse_tenants, file_tenants)
    return DaemonConfig(**settings)


def _one_metrics_address(settings: dict[str, Any], sources: dict[str, str]) -> None:
    """Keep one of ``metrics-address`` and ``metrics-port``: the one from the higher-ranked
    source (flag, then variable, then file); ``ConfigError`` when both come from one rank."""
    if "metrics-address" not in sources or "metrics-port" not in sources:
        return
    address, port = (_rank(key, sources[key]) for key in ("metrics-address", "metrics-port"))
    if address == port:
        raise ConfigError(
            f"give the metrics address once: {sources['metrics-address']} and "
            f"{sources['metrics-port']} are both set"
        )
    loser = "metrics-port" if address < port else "metrics-address"
    del sources[loser]
    settings.pop(KEYS[loser].attr)


def _rank(key: str, source: str) -> int:
    """0 for a flag, 1 for a variable, 2 for the file (``_pick``'s order)."""
    spec = KEYS[key]
    return 0 if source == spec.flag else 1 if source == spec.env else 2


def dir_from(flag: str | Path | None, env: Mapping[str, str], file: Path | None = None) -> Path:
    """The daemon directory alone: ``flag`` > ``KVDAEMON_DIR`` in ``env`` > ``dir`` in
    the TOML ``file`` > the default. The file is read whichever wins (a file that cannot
    be read or parsed is a ``ConfigError``); its other keys are checked by name only."""
    file_values = _read_toml(file)[0] if file is not None else {}
    if flag is not None:
        return _parse_from("--dir", values.parse_dir, flag)
    if env.get("KVDAEMON_DIR"):
        return _parse_from("KVDAEMON_DIR", values.parse_dir, env["KVDAEMON_DIR"])
    if "dir" in file_values:
        return _parse_from(f"{file}: dir", values.parse_dir, file_values["dir"][1])
    return values.parse_dir(default_dir())


PATH_KEYS = frozenset({"dir", "log-file"})  # relative in a file: from the file's folder
TENANT_FLAG = "--tenant-policy"  # hidden: how a detached start hands [tenants] to its child


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
        shown = repr(raw) if len(repr(raw)) <= 80 else repr(raw)[:77] + "..."  # a whole table can be long
        named = isinstance(raw, (dict, list)) or str(raw) in err.message  # a table's message names its entry
        given = "" if named else f" (given {shown})"
        raise ConfigError(f"{source}: {err.message}{given}") from err


def _read_toml(file: Path) -> tuple[dict[str, tuple[str, Any]], Any]:
    """The file's keys (as ``KEYS`` spells them) -> (spelling in the file, value), and
    its ``tenants`` table (``None`` without one). A relative path (``dir``, ``log-file``)
    is taken from the file's folder, so one file means one daemon from any working directory."""
    try:
        with open(file, "rb") as stream:
            table = tomllib.load(stream)
    except OSError as err:
        raise ConfigError(f"cannot read config file {file}: {err.strerror}") from err
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file {file} is not valid TOML: {err}") from err
    except UnicodeDecodeError as err:  # TOML is UTF-8 text
        raise ConfigError(f"config file {file} is not valid TOML: not UTF-8 text (byte {err.start})") from err
    tenants = table.pop("tenants", None)
    values_by_key = _normalised(table, f"config file {file}: key", " and the [tenants] table")
    for key in PATH_KEYS & values_by_key.keys():
        spelling, raw = values_by_key[key]
        if isinstance(raw, str) and raw and not raw.startswith(("/", "~")):
            values_by_key[key] = (spelling, str(Path(file).absolute().parent / raw))
    return values_by_key, tenants


def _normalised(given: Mapping[str, Any], what: str, more_known: str = "") -> dict[str, tuple[str, Any]]:
    """``given`` keyed by the spelling of ``KEYS`` (``page_size`` -> ``page-size``),
    each with its own spelling. Raises ``ConfigError`` for an unknown key or one
    given in both spellings."""
    out: dict[str, tuple[str, Any]] = {}
    for key, value in given.items():
        name = key.replace("_", "-")
        if name not in KEYS:
            raise ConfigError(f"{what} {key!r} is unknown; known are {', '.join(KEYS)}{more_known} "
                              "(a dash or an underscore between words)")
        if name in out:
            raise ConfigError(f"{what} {name!r} is given twice, as {out[name][0]} and {key}")
        out[name] = (key, value)
    return out


def _key(name: str, attr: str, parse: Callable[[Any], Any]) -> _Key:
    """A setting spelled ``name`` in files and ``--name`` as a flag, read from ``KVDAEMON_NAME``."""
    return _Key(attr, f"--{name}", "KVDAEMON_" + name.upper().replace("-", "_"), parse)


KEYS: dict[str, _Key] = {
    key.flag[2:]: key
    for key in (
        _key("dir", "dir", values.parse_dir),
        _key("backend", "backend", values.parse_backend),
        _key("device", "device", values.parse_device),
        _key("capacity", "capacity", values.parse_capacity),
        _key("page-size", "page_size_bytes", values.parse_page_size),
        _key("metrics-address", "metrics_address", values.parse_metrics_address),
        _key("metrics-port", "metrics_port", values.parse_port),
        _key("idle-sleep", "idle_sleep_s", values.parse_idle_sleep),
        _key("idle-mode", "idle_mode", values.parse_idle_mode),
        _key("reclaim-sleep", "reclaim_sleep", values.parse_reclaim_sleep),
        _key("warm-memory", "warm_memory", values.parse_warm_memory),
        _key("log-level", "log_level", values.parse_log_level),
        _key("log-file", "log_file", values.parse_log_file),
    )
}
