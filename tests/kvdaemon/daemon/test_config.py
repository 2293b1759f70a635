"""kvdaemon.daemon.config: layering flags > env > TOML file > defaults, and validation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvdaemon.daemon.config import KEYS, DaemonConfig, dir_from, load_config
from kvdaemon.errors import ConfigError
from kvdaemon.wire.paths import default_dir
from kvdaemon.wire.sizes import bytes_of, parse_size, percent_of

REPO = Path(__file__).resolve().parents[3]

MiB = 1024 * 1024
GiB = 1024 * MiB


def write_toml(tmp_path: Path, body: str) -> Path:
    """A config file with ``body`` as its text."""
    path = tmp_path / "kvdaemon.toml"
    path.write_text(body)
    return path


def flags_from_argv(argv: list[str]) -> dict[str, str]:
    """The ``load_config`` flags that ``start`` would build from ``argv``."""
    by_flag = {key.flag: name for name, key in KEYS.items()}
    return {by_flag[flag]: value for flag, value in zip(argv[::2], argv[1::2])}


@pytest.fixture(autouse=True)
def _no_ambient_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVDAEMON_DIR", raising=False)


def test_defaults() -> None:
    config = load_config({}, {}, None)
    assert config == DaemonConfig(
        dir=default_dir(),
        backend="auto",
        device=0,
        capacity=percent_of(50),
        page_size_bytes=2 * MiB,
        metrics_port=None,
        idle_sleep_s=None,
        log_level="INFO",
    )


def test_file_sets_every_key(tmp_path: Path) -> None:
    file = write_toml(
        tmp_path,
        'dir = "/tmp/kvd-file"\nbackend = "cuda"\ndevice = 2\ncapacity = "1GiB"\n'
        'page_size = "4MiB"\nmetrics_port = 9400\nidle_sleep = "5m"\nlog_level = "debug"\n',
    )
    config = load_config({}, {}, file)
    assert config == DaemonConfig(
        dir=Path("/tmp/kvd-file"), backend="cuda", device=2, capacity=bytes_of(GiB),
        page_size_bytes=4 * MiB, metrics_port=9400, idle_sleep_s=300.0, log_level="DEBUG",
    )  # fmt: skip


def test_relative_paths_in_a_file_are_from_its_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = write_toml(tmp_path, 'dir = "run/kvd"\nlog_file = "logs/kvdaemon.log"\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # a command's working directory does not change the daemon
    config = load_config({}, {}, file)
    assert (config.dir, config.log_file) == (tmp_path / "run/kvd", tmp_path / "logs/kvdaemon.log")
    assert dir_from(None, {}, file) == tmp_path / "run/kvd"
    assert load_config({"dir": "mine"}, {}, file).dir == elsewhere / "mine"  # a flag: from the cwd
    assert load_config({}, {"KVDAEMON_DIR": "env"}, file).dir == elsewhere / "env"
    absolute = write_toml(tmp_path, 'dir = "/tmp/kvd-abs"\n')
    assert load_config({}, {}, absolute).dir == Path("/tmp/kvd-abs")


def test_file_accepts_plain_numbers(tmp_path: Path) -> None:
    file = write_toml(tmp_path, "capacity = 67108864\npage_size = 2097152\nidle_sleep = 30\n")
    config = load_config({}, {}, file)
    assert (config.capacity, config.page_size_bytes, config.idle_sleep_s) == (
        bytes_of(64 * MiB), 2 * MiB, 30.0,
    )  # fmt: skip


def test_env_overrides_file_and_flags_override_env(tmp_path: Path) -> None:
    file = write_toml(
        tmp_path, 'backend = "cuda"\ndevice = 1\ncapacity = "10%"\nlog_level = "ERROR"\n'
    )
    env = {"KVDAEMON_DEVICE": "3", "KVDAEMON_CAPACITY": "20%", "KVDAEMON_LOG_LEVEL": "WARNING"}
    flags = {"capacity": "30%", "backend": None}
    config = load_config(flags, env, file)
    assert config.backend == "cuda"  # file (the flag is unset)
    assert config.device == 3  # env over file
    assert config.capacity == percent_of(30)  # flag over env over file
    assert config.log_level == "WARNING"  # env over file
    assert config.page_size_bytes == 2 * MiB  # default


def test_every_env_variable_is_read() -> None:
    env = {
        "KVDAEMON_DIR": "/tmp/kvd-env", "KVDAEMON_BACKEND": "CUDA", "KVDAEMON_DEVICE": "1",
        "KVDAEMON_CAPACITY": "256MiB", "KVDAEMON_PAGE_SIZE": "64KiB",
        "KVDAEMON_METRICS_PORT": "9100", "KVDAEMON_IDLE_SLEEP": "90s",
        "KVDAEMON_LOG_LEVEL": "error",
    }  # fmt: skip
    assert load_config({}, env, None) == DaemonConfig(
        dir=Path("/tmp/kvd-env"), backend="cuda", device=1, capacity=bytes_of(256 * MiB),
        page_size_bytes=64 * 1024, metrics_port=9100, idle_sleep_s=90.0, log_level="ERROR",
    )  # fmt: skip


def test_relative_dir_becomes_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert load_config({"dir": "kvd"}, {}, None).dir == tmp_path / "kvd"


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("backend", "tpu"),
        ("backend", 3),
        ("device", "-1"),
        ("device", "zero"),
        ("device", "1.5"),
        ("device", True),
        ("capacity", "lots"),
        ("capacity", "0"),
        ("capacity", "0%"),
        ("capacity", "150%"),
        ("capacity", "-1GiB"),
        ("page-size", "1000"),
        ("page-size", "0"),
        ("page-size", "50%"),
        ("page-size", "6KiB"),
        ("metrics-port", "0"),
        ("metrics-port", "65536"),
        ("metrics-port", "http"),
        ("idle-sleep", "0"),
        ("idle-sleep", "-5s"),
        ("idle-sleep", "soon"),
        ("idle-sleep", "inf"),
        ("idle-sleep", "nan"),
        ("log-level", "LOUD"),
        ("dir", ""),
        ("dir", "/tmp/" + "d" * 120),
    ],
)
def test_bad_flag_raises_config_error_naming_flag_and_value(key: str, value: Any) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config({key: value}, {}, None)
    assert caught.value.code == "CONFIG"
    assert caught.value.message.startswith(KEYS[key].flag + ":")
    if value:
        assert str(value) in caught.value.message or repr(value) in caught.value.message


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("KVDAEMON_BACKEND", "gpu"),
        ("KVDAEMON_DEVICE", "-2"),
        ("KVDAEMON_CAPACITY", "12 parsecs"),
        ("KVDAEMON_PAGE_SIZE", "3000"),
        ("KVDAEMON_METRICS_PORT", "70000"),
        ("KVDAEMON_IDLE_SLEEP", "later"),
        ("KVDAEMON_LOG_LEVEL", "chatty"),
        ("KVDAEMON_METRICS_ADDRESS", "9400:localhost"),
    ],
)
def test_bad_env_raises_config_error_naming_variable(name: str, value: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config({}, {name: value}, None)
    assert caught.value.message.startswith(name + ":")


@pytest.mark.parametrize(
    ("line", "key"),
    [
        ('backend = "metal"', "backend"),
        ("device = -1", "device"),
        ("device = 1.0", "device"),
        ("capacity = true", "capacity"),
        ("page_size = 100", "page_size"),
        ("metrics_port = 0", "metrics_port"),
        ("idle_sleep = -3", "idle_sleep"),
        ("idle_sleep = false", "idle_sleep"),
        ("log_level = 10", "log_level"),
        ("dir = 5", "dir"),
    ],
)
def test_bad_file_value_raises_config_error_naming_file_and_key(
    tmp_path: Path, line: str, key: str
) -> None:
    file = write_toml(tmp_path, line + "\n")
    with pytest.raises(ConfigError) as caught:
        load_config({}, {}, file)
    assert caught.value.message.startswith(f"{file}: {key}:")


def test_unknown_file_key_is_refused(tmp_path: Path) -> None:
    file = write_toml(tmp_path, 'capacity = "1GiB"\ncapacty = "2GiB"\n')
    with pytest.raises(ConfigError, match="key .capacty. is unknown") as caught:
        load_config({}, {}, file)
    assert "log-file and the [tenants] table (a dash or an underscore between words)" in caught.value.message


def test_invalid_toml_is_refused(tmp_path: Path) -> None:
    file = write_toml(tmp_path, "capacity = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config({}, {}, file)


def test_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config({}, {}, tmp_path / "absent.toml")


def test_unknown_flag_is_refused() -> None:
    with pytest.raises(ConfigError, match="setting .colour. is unknown"):
        load_config({"colour": "blue"}, {}, None)


def test_bad_direct_construction_is_refused() -> None:
    with pytest.raises(ConfigError):
        DaemonConfig(backend="tpu")
    with pytest.raises(ConfigError):
        DaemonConfig(device=-1)
    with pytest.raises(ConfigError, match="device 1 with backend host: --device chooses a CUDA GPU"):
        DaemonConfig(backend="host", device=1)
    with pytest.raises(ConfigError):
        DaemonConfig(page_size_bytes=4097)
    with pytest.raises(ConfigError):
        DaemonConfig(metrics_port=0)
    with pytest.raises(ConfigError):
        DaemonConfig(capacity=bytes_of(0))
    with pytest.raises(ConfigError):
        DaemonConfig(log_level="info")


@pytest.mark.parametrize(
    ("capacity", "total_bytes", "expected_bytes"),
    [
        ("64MiB", 16 * GiB, 64 * MiB),
        ("65MiB", 16 * GiB, 64 * MiB),  # rounded down to whole 2 MiB pages
        ("2MiB", 16 * GiB, 2 * MiB),
        ("50%", 16 * GiB, 8 * GiB),
        ("50%", 5 * MiB, 2 * MiB),
        ("100%", 16 * GiB, 16 * GiB),
    ],
)
def test_capacity_bytes(capacity: str, total_bytes: int, expected_bytes: int) -> None:
    config = load_config({"capacity": capacity}, {}, None)
    assert config.capacity_bytes(total_bytes) == expected_bytes


@pytest.mark.parametrize(
    ("capacity", "total_bytes", "message"),
    [
        ("1MiB", 16 * GiB, "less than one page"),
        ("10%", 10 * MiB, "less than one page"),
        ("32GiB", 16 * GiB, "exceeds the device"),
    ],
)
def test_capacity_bytes_refuses_impossible_sizes(
    capacity: str, total_bytes: int, message: str
) -> None:
    config = load_config({"capacity": capacity}, {}, None)
    with pytest.raises(ConfigError, match=message):
        config.capacity_bytes(total_bytes)


@pytest.mark.parametrize(
    "flags",
    [
        {},
        {"dir": "/tmp/kvd-argv", "backend": "cuda", "capacity": "12.5%", "device": "1"},
        {"capacity": "1.5GiB", "page-size": "64KiB", "metrics-port": "9400",
         "idle-sleep": "2.5m", "log-level": "debug"},
        {"warm-memory": "12GiB"}, {"warm-memory": "0"},
    ],
)
def test_to_argv_round_trips(flags: dict[str, str]) -> None:
    config = load_config(flags, {}, None)
    assert load_config(flags_from_argv(config.to_argv()), {}, None) == config


def test_warm_memory_from_flag_env_and_file(tmp_path: Path) -> None:
    assert load_config({}, {}, None).warm_memory == parse_size("50%")
    assert load_config({"warm-memory": "8GiB"}, {}, None).warm_memory == parse_size("8GiB")
    assert load_config({}, {"KVDAEMON_WARM_MEMORY": "25%"}, None).warm_memory == parse_size("25%")
    file = write_toml(tmp_path, 'warm-memory = "1GiB"\n')
    assert load_config({}, {}, file).warm_memory == parse_size("1GiB")
    with pytest.raises(ConfigError, match="warm-memory"):
        load_config({"warm-memory": "lots"}, {}, None)


def test_to_argv_overrides_any_environment() -> None:
    config = load_config({"backend": "host", "capacity": "64MiB"}, {}, None)
    env = {"KVDAEMON_BACKEND": "cuda", "KVDAEMON_CAPACITY": "90%", "KVDAEMON_LOG_LEVEL": "ERROR"}
    assert load_config(flags_from_argv(config.to_argv()), env, None) == config


def test_dir_from_precedence(tmp_path: Path) -> None:
    env = {"KVDAEMON_DIR": "/tmp/kvd-env"}
    file = write_toml(tmp_path, 'dir = "/tmp/kvd-file"\ncapacity = "nonsense, unread here"\n')
    assert dir_from(Path("/tmp/kvd-flag"), env, file) == Path("/tmp/kvd-flag")
    assert dir_from(None, env, file) == Path("/tmp/kvd-env")
    assert dir_from(None, {}, file) == Path("/tmp/kvd-file")
    assert dir_from(None, {}) == default_dir()
    assert dir_from(None, {"KVDAEMON_DIR": ""}) == default_dir()  # empty counts as unset
    with pytest.raises(ConfigError, match="capcity"):
        dir_from(None, {}, write_toml(tmp_path, "capcity = 1\n"))


@pytest.mark.parametrize("where", ["flag", "env"])
def test_a_config_file_that_cannot_be_read_is_an_error_whatever_names_the_dir(tmp_path: Path, where: str) -> None:
    flag = Path("/tmp/kvd-flag") if where == "flag" else None
    env = {"KVDAEMON_DIR": "/tmp/kvd-env"} if where == "env" else {}
    with pytest.raises(ConfigError, match="cannot read"):
        dir_from(flag, env, tmp_path / "missing.toml")
    with pytest.raises(ConfigError):
        dir_from(flag, env, write_toml(tmp_path, "dir = [unclosed\n"))
    with pytest.raises(ConfigError, match="capcity"):
        dir_from(flag, env, write_toml(tmp_path, "capcity = 1\n"))


def test_idle_mode_from_env_and_file(tmp_path: Path) -> None:
    assert load_config({}, {}, None).idle_mode == "warm"
    file = write_toml(tmp_path, 'idle_sleep = 60\nidle_mode = "cold"\n')
    assert load_config({}, {}, file).idle_mode == "cold"
    env = {"KVDAEMON_IDLE_MODE": "WARM"}
    assert load_config({}, env, file).idle_mode == "warm"
    config = load_config({"idle-sleep": "60", "idle-mode": "cold"}, {}, None)
    assert config.to_argv()[-4:] == ["--idle-sleep", "60.0", "--idle-mode", "cold"]
    with pytest.raises(ConfigError, match="idle mode"):
        load_config({}, {"KVDAEMON_IDLE_MODE": "lukewarm"}, None)


def test_reclaim_sleep_is_on_unless_turned_off(tmp_path: Path) -> None:
    assert load_config({}, {}, None).reclaim_sleep is True
    off = load_config({"reclaim-sleep": False}, {}, None)
    assert off.reclaim_sleep is False and off.to_argv()[-1] == "--no-reclaim-sleep"
    assert load_config({}, {"KVDAEMON_RECLAIM_SLEEP": "off"}, None).reclaim_sleep is False
    assert load_config({}, {}, write_toml(tmp_path, "reclaim_sleep = false\n")).reclaim_sleep is False
    with pytest.raises(ConfigError, match="reclaim sleep"):
        load_config({}, {"KVDAEMON_RECLAIM_SLEEP": "maybe"}, None)


def test_file_keys_are_spelled_like_the_flags(tmp_path: Path) -> None:
    hyphens = write_toml(tmp_path, 'page-size = "64KiB"\nidle-sleep = "5m"\nlog-level = "debug"\n')
    underscores = tmp_path / "old.toml"
    underscores.write_text('page_size = "64KiB"\nidle_sleep = "5m"\nlog_level = "debug"\n')
    assert load_config({}, {}, hyphens) == load_config({}, {}, underscores)
    assert load_config({}, {}, hyphens).page_size_bytes == 64 * 1024
    assert sorted(KEYS) == sorted(key.flag[2:] for key in KEYS.values())


def test_a_key_in_both_spellings_is_refused(tmp_path: Path) -> None:
    file = write_toml(tmp_path, 'page-size = "64KiB"\npage_size = "2MiB"\n')
    with pytest.raises(ConfigError, match="'page-size' is given twice, as page-size and page_size"):
        load_config({}, {}, file)


@pytest.mark.parametrize(
    ("text", "host", "port", "address"),
    [
        ("127.0.0.1:9400", "127.0.0.1", 9400, "127.0.0.1:9400"),
        ("0.0.0.0:9400", "0.0.0.0", 9400, "0.0.0.0:9400"),
        ("[::1]:9400", "::1", 9400, "[::1]:9400"),
        ("localhost:80", "localhost", 80, "localhost:80"),
        ("9400", "127.0.0.1", 9400, "127.0.0.1:9400"),
    ],
)
def test_metrics_address(text: str, host: str, port: int, address: str) -> None:
    config = load_config({"metrics-address": text}, {}, None)
    assert (config.metrics_host, config.metrics_port, config.metrics_address) == (host, port, address)
    assert load_config(flags_from_argv(config.to_argv()), {}, None) == config


@pytest.mark.parametrize("text", ["", ":9400", "host:", "host:port", "a b:1", "1.2.3.4:70000", "[::1]"])
def test_bad_metrics_address_is_refused(text: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config({"metrics-address": text}, {}, None)
    assert caught.value.message.startswith("--metrics-address:")


def test_metrics_port_is_short_for_a_loopback_address_and_the_higher_source_wins(tmp_path: Path) -> None:
    assert load_config({"metrics-port": "9400"}, {}, None).metrics_address == "127.0.0.1:9400"
    assert load_config({}, {}, None).metrics_address is None
    file = write_toml(tmp_path, 'metrics-address = "0.0.0.0:9400"\n')
    assert load_config({"metrics-port": "9500"}, {}, file).metrics_address == "127.0.0.1:9500"
    assert load_config({}, {"KVDAEMON_METRICS_PORT": "9501"}, file).metrics_address == "127.0.0.1:9501"
    assert load_config({"metrics-address": "off"}, {}, file).metrics_address is None
    assert load_config({"metrics-address": "none"}, {"KVDAEMON_METRICS_PORT": "9501"}, None).metrics_address is None
    both = write_toml(tmp_path, 'metrics-address = "0.0.0.0:9400"\nmetrics-port = 9500\n')
    with pytest.raises(ConfigError) as caught:
        load_config({}, {}, both)
    assert caught.value.message == (
        f"give the metrics address once: {both}: metrics-address and {both}: metrics-port are both set"
    )
    with pytest.raises(ConfigError, match="both set"):
        load_config({"metrics-address": "9400", "metrics-port": "9500"}, {}, None)


def test_log_file_becomes_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = load_config({"log-file": "kvd.log"}, {}, None)
    assert config.log_file == tmp_path / "kvd.log"
    assert config.to_argv()[-2:] == ["--log-file", str(tmp_path / "kvd.log")]
    assert load_config({}, {}, None).log_file is None


def test_the_example_config_sets_every_key() -> None:
    example = REPO / "deploy" / "kvdaemon.toml"
    text = example.read_text()
    commented = {line.split("=")[0].strip("# ").strip() for line in text.splitlines() if "=" in line}
    assert set(KEYS) <= commented  # every key is shown, set or as a comment
    config = load_config({}, {}, example)
    assert config.metrics_address is not None


# -- [tenants.NAME]: operator policies ------------------------------------------------------


TENANTS_TOML = """
capacity = "64MiB"

[tenants.llama-a]
max = "40%"
min = "1GiB"
weight = 2

[tenants."qwen:7b"]
max = 8589934592
"""


def test_tenant_tables_are_policies(tmp_path: Path) -> None:
    config = load_config({}, {}, write_toml(tmp_path, TENANTS_TOML))
    policies = config.tenant_policies
    assert sorted(policies) == ["llama-a", "qwen:7b"]
    assert policies["llama-a"].to_json() == {"max": "40%", "min": GiB, "weight": 2.0}
    assert policies["qwen:7b"].to_json() == {"max": 8 * GiB}
    assert load_config({}, {}, None).tenants == ()
    # `dir_from` (every command but start) reads past them
    assert dir_from(None, {}, write_toml(tmp_path, 'dir = "/tmp/kvd-t"\n' + TENANTS_TOML)) == Path("/tmp/kvd-t")


def test_tenant_policies_cross_a_detached_start(tmp_path: Path) -> None:
    config = load_config({"backend": "host"}, {}, write_toml(tmp_path, TENANTS_TOML))
    argv = config.to_argv()
    pairs = list(zip(argv[::2], argv[1::2]))  # every flag of to_argv takes one value
    policies = tuple(value for flag, value in pairs if flag == "--tenant-policy")
    assert len(policies) == 2
    plain = [item for flag, value in pairs if flag != "--tenant-policy" for item in (flag, value)]
    again = load_config({**flags_from_argv(plain), "tenant-policy": policies}, {}, None)
    assert again == config


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ('tenants = 3\n', "tenants must be tables [tenants.NAME]"),
        ('[tenants]\nllama = 3\n', "tenants.llama must be a table of max, min, weight"),
        ('[tenants."bad name"]\nmax = "1GiB"\n', "tenant name 'bad name' must be"),
        ('[tenants.a]\nmaximum = "1GiB"\n', "tenants.a: unknown key 'maximum'; known are max, min, weight"),
        ('[tenants.a]\nmax = "lots"\n', "tenants.a: max: invalid size 'lots'"),
        ('[tenants.a]\nweight = -1\n', "tenants.a: weight must be a number"),
        ('[tenants.a]\nmax = "10%"\nmin = "20%"\n', "tenants.a: min 20% exceeds max 10%"),
    ],
)
def test_bad_tenant_tables_are_refused(tmp_path: Path, body: str, fragment: str) -> None:
    file = write_toml(tmp_path, body)
    with pytest.raises(ConfigError) as err:
        load_config({}, {}, file)
    assert err.value.message.startswith(f"{file}: tenants: ")
    assert fragment in err.value.message
    assert "(given {" not in err.value.message  # the entry is named, not the table's dict printed


def test_the_example_config_shows_a_tenant_table_that_loads(tmp_path: Path) -> None:
    text = (REPO / "deploy" / "kvdaemon.toml").read_text()
    start = text.index("# [tenants.llama-a]")
    table = "\n".join(line.removeprefix("# ") for line in text[start:].splitlines())
    config = load_config({}, {}, write_toml(tmp_path, table))
    assert config.tenant_policies["llama-a"].to_json() == {"max": "40%", "min": 4 * GiB, "weight": 2.0}


def test_a_config_file_that_is_not_utf8_is_refused_as_not_toml(tmp_path: Path) -> None:
    file = tmp_path / "kvdaemon.toml"
    file.write_bytes(b'capacity = "1GiB"\n\xff\xfe\n')
    with pytest.raises(ConfigError, match=r"is not valid TOML: not UTF-8 text \(byte 18\)"):
        load_config({}, {}, file)


def test_a_bad_tenants_table_is_named_without_repeating_all_of_it(tmp_path: Path) -> None:
    long_name = "x" * 300
    file = write_toml(tmp_path, f'[tenants."{long_name}"]\nmax = "1GiB"\n')
    with pytest.raises(ConfigError) as err:
        load_config({}, {}, file)
    assert "tenant name" in err.value.message and "(300 characters)" in err.value.message
    assert len(err.value.message) < len(str(file)) + 260  # neither the whole name nor the table again
