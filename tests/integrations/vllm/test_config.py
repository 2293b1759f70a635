"""The plugin's settings from the environment, and the engines it refuses (no vLLM needed)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvdaemon.errors import ConfigError, Unsupported
from kvdaemon.integrations.vllm.config import PluginConfig
from kvdaemon.integrations.vllm.tenant import check_parallel, current_tenant


def test_no_tenant_no_config() -> None:
    assert PluginConfig.from_env({}) is None
    assert PluginConfig.from_env({"KVDAEMON_VLLM_TENANT": "", "KVDAEMON_VLLM_MAX": "1GiB"}) is None


def test_every_variable_is_read() -> None:
    config = PluginConfig.from_env({
        "KVDAEMON_VLLM_TENANT": " llama-a ", "KVDAEMON_DIR": "/tmp/kvd-x", "KVDAEMON_VLLM_MAX": "25%",
        "KVDAEMON_VLLM_MIN": "1MiB", "KVDAEMON_VLLM_WEIGHT": "2.5",
    })
    assert config is not None
    assert (config.tenant, config.dir, config.weight) == ("llama-a", "/tmp/kvd-x", 2.5)
    assert config.max_bytes(4 << 20) == 1 << 20 and config.min_bytes(4 << 20) == 1 << 20


def test_defaults() -> None:
    config = PluginConfig.from_env({"KVDAEMON_VLLM_TENANT": "a"})
    assert config == PluginConfig(tenant="a")
    assert config.max_bytes(100) is None and config.min_bytes(100) == 0


@pytest.mark.parametrize("var, value, reason", [
    ("KVDAEMON_VLLM_MAX", "lots", "KVDAEMON_VLLM_MAX='lots'"),
    ("KVDAEMON_VLLM_MIN", "150%", "KVDAEMON_VLLM_MIN='150%'"),
    ("KVDAEMON_VLLM_WEIGHT", "0", "KVDAEMON_VLLM_WEIGHT='0': a weight is a positive number"),
    ("KVDAEMON_VLLM_WEIGHT", "nan", "KVDAEMON_VLLM_WEIGHT='nan'"),
    ("KVDAEMON_VLLM_WEIGHT", "1e7", r"KVDAEMON_VLLM_WEIGHT='1e7': a weight is within \[1e-06, 1e\+06\]"),
    ("KVDAEMON_VLLM_WEIGHT", "1e-9", r"KVDAEMON_VLLM_WEIGHT='1e-9': a weight is within"),
    ("KVDAEMON_VLLM_MAX", "0", "KVDAEMON_VLLM_MAX='0': a limit of 0 bytes leaves the engine no KV cache"),
    ("KVDAEMON_VLLM_MAX", "0%", "KVDAEMON_VLLM_MAX='0%': a limit of 0 bytes"),
    ("KVDAEMON_VLLM_TENANT", "bad name!", "KVDAEMON_VLLM_TENANT='bad name!': a tenant name is 1-128 characters"),
    ("KVDAEMON_VLLM_TENANT", "x" * 129, "KVDAEMON_VLLM_TENANT='x{129}': a tenant name"),
])
def test_a_bad_value_names_its_variable(var: str, value: str, reason: str) -> None:
    with pytest.raises(ConfigError, match=reason):
        PluginConfig.from_env({"KVDAEMON_VLLM_TENANT": "a", var: value})


def test_none_is_no_limit_as_for_kvdaemon_limit() -> None:
    config = PluginConfig.from_env({"KVDAEMON_VLLM_TENANT": "a", "KVDAEMON_VLLM_MAX": "None",
                                    "KVDAEMON_VLLM_MIN": "none"})
    assert config == PluginConfig(tenant="a")
    assert config.limits(1 << 30) == (None, 0)


def test_a_guarantee_above_the_limit_is_refused_once_both_are_resolved() -> None:
    config = PluginConfig.from_env({"KVDAEMON_VLLM_TENANT": "a", "KVDAEMON_VLLM_MAX": "10%",
                                    "KVDAEMON_VLLM_MIN": "8MiB"})
    assert config is not None
    assert config.limits(100 << 20) == (10 << 20, 8 << 20)  # 10% of 100 MiB is above 8 MiB
    with pytest.raises(ConfigError) as err:
        config.limits(50 << 20)  # 10% of 50 MiB is not
    assert err.value.message == (
        "KVDAEMON_VLLM_MIN means 8.00 MiB, above KVDAEMON_VLLM_MAX's 5.00 MiB (against this daemon's "
        "50.0 MiB): a guarantee cannot exceed the limit")


def test_a_limit_under_one_page_of_every_layer_names_its_variable() -> None:
    config = PluginConfig.from_env({"KVDAEMON_VLLM_TENANT": "a", "KVDAEMON_VLLM_MAX": "1MiB"})
    assert config is not None
    assert config.limits(64 << 20, logical_page_bytes=1 << 20) == (1 << 20, 0)  # one page: fits
    with pytest.raises(ConfigError, match=r"^KVDAEMON_VLLM_MAX means 1\.00 MiB, less than one page of every "
                       r"layer's K and V \(4\.00 MiB"):
        config.limits(64 << 20, logical_page_bytes=4 << 20)


def engine_config(**parallel: Any) -> SimpleNamespace:
    sizes = {
        "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": 1,
        "decode_context_parallel_size": 1, "prefill_context_parallel_size": 1,
        "distributed_executor_backend": "uni", **parallel,
    }
    return SimpleNamespace(parallel_config=SimpleNamespace(**sizes), kv_transfer_config=None)


def test_one_gpu_in_one_process_is_supported() -> None:
    check_parallel(engine_config())


@pytest.mark.parametrize("parallel, reason", [
    ({"tensor_parallel_size": 2}, "runs engines on one GPU; this one has tensor_parallel_size=2"),
    ({"pipeline_parallel_size": 2, "data_parallel_size": 4}, "pipeline_parallel_size=2, data_parallel_size=4"),
    ({"distributed_executor_backend": "mp"}, "distributed_executor_backend='uni'.*uses 'mp'"),
])
def test_multi_gpu_engines_are_refused_clearly(parallel: dict, reason: str) -> None:
    with pytest.raises(Unsupported, match=reason) as info:
        check_parallel(engine_config(**parallel))
    assert info.value.code == "UNSUPPORTED"


def test_kv_connectors_are_refused() -> None:
    config = engine_config()
    config.kv_transfer_config = object()
    with pytest.raises(Unsupported, match="KV connectors"):
        check_parallel(config)


def test_a_scheduler_without_a_tenant_in_its_process_is_refused() -> None:
    with pytest.raises(Unsupported, match="engine core and its worker in one process"):
        current_tenant()


def test_a_guarantee_above_the_capacity_is_refused_naming_its_variable() -> None:
    config = PluginConfig.from_env({"KVDAEMON_VLLM_TENANT": "a", "KVDAEMON_VLLM_MIN": "128MiB"})
    assert config is not None
    with pytest.raises(ConfigError, match="KVDAEMON_VLLM_MIN means 128.0 MiB, more than this daemon's capacity of 64.0 MiB"):
        config.limits(64 << 20)
