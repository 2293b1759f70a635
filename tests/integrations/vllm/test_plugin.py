"""The plugin: its entry point, inert without a tenant, loaded by vLLM's own loader, the version gate."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points
from typing import Any

import pytest

import kvdaemon.integrations.vllm as plugin
from kvdaemon.errors import Unsupported
from kvdaemon.integrations.vllm import gate, patches
from kvdaemon.integrations.vllm.tenant import current_tenant, set_current_tenant

from tests.conftest import RunningDaemon
from tests.integrations.vllm.conftest import VLLM_MISSING


@pytest.fixture
def installs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, Any]]:
    """Calls of ``patches.install`` (recorded instead of patching)."""
    calls: list[tuple[Any, Any]] = []
    monkeypatch.setattr(patches, "install", lambda surface, config: calls.append((surface, config)))
    return calls


def test_the_entry_point_is_in_vllms_plugin_group() -> None:
    (entry,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "kvdaemon"]
    assert entry.value == "kvdaemon.integrations.vllm:register"
    assert entry.load() is plugin.register


def test_without_a_tenant_the_plugin_does_nothing(monkeypatch: pytest.MonkeyPatch, installs: list) -> None:
    monkeypatch.delenv("KVDAEMON_VLLM_TENANT", raising=False)

    def no_gate() -> None:
        raise AssertionError("the gate ran without a tenant")

    monkeypatch.setattr(gate, "check_vllm", no_gate)
    plugin.register()
    monkeypatch.setenv("KVDAEMON_VLLM_TENANT", "  ")
    plugin.register()
    assert installs == []


def test_importing_the_plugin_imports_neither_vllm_nor_torch() -> None:
    code = "import sys, kvdaemon.integrations.vllm; print(sorted({'vllm', 'torch'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("version", ["0.34.0", "0.32.9", "1.0.0", "0.3.3"])
def test_the_version_gate_refuses_other_releases_by_name(version: str) -> None:
    with pytest.raises(Unsupported, match=rf"supports vLLM 0\.33\.x .*this is vLLM {version}\.") as info:
        gate.check_version(version)
    assert info.value.code == "UNSUPPORTED"


@pytest.mark.parametrize("version", ["0.33.0", "0.33.4", "0.33.1rc1", "0.33.0+cu130"])
def test_the_version_gate_admits_the_tested_series(version: str) -> None:
    gate.check_version(version)


def test_vllms_loader_runs_the_plugin_through_the_gate(
    monkeypatch: pytest.MonkeyPatch, installs: list, surface: Any,
) -> None:
    import vllm.plugins

    monkeypatch.setenv("KVDAEMON_VLLM_TENANT", "engine-a")
    monkeypatch.setenv("KVDAEMON_VLLM_MAX", "40%")
    monkeypatch.setenv("VLLM_PLUGINS", "kvdaemon")
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    vllm.plugins.load_general_plugins()
    ((checked, config),) = installs
    assert checked.version == "0.33.0" and checked.block_pool_cls is surface.block_pool_cls
    assert config.tenant == "engine-a" and config.max_bytes(1000) == 400


def test_vllms_allow_list_can_leave_the_plugin_out(monkeypatch: pytest.MonkeyPatch, installs: list) -> None:
    vllm_plugins = pytest.importorskip("vllm.plugins", reason=VLLM_MISSING)
    monkeypatch.setenv("KVDAEMON_VLLM_TENANT", "engine-a")
    monkeypatch.setenv("VLLM_PLUGINS", "some-other-plugin")
    monkeypatch.setattr(vllm_plugins, "plugins_loaded", False)
    vllm_plugins.load_general_plugins()
    assert installs == []


def test_the_installed_plugin_swaps_the_pool_the_coordinator_builds(surface: Any) -> None:
    built = surface.coordinator_module.BlockPool
    assert built.__name__ == "PooledBlockPool" and issubclass(built, surface.block_pool_cls)
    for cls, name in ((surface.coordinator_cls, "get_num_blocks_to_allocate"), (surface.scheduler_cls, "schedule"),
                      (surface.engine_core_cls, "step"), (surface.engine_core_cls, "shutdown"),
                      (surface.worker_cls, "initialize_from_config")):
        assert getattr(getattr(cls, name), "__kvdaemon_wrapped__", False), name
    from kvdaemon.integrations.vllm.config import PluginConfig

    assert not patches.install(surface, PluginConfig(tenant="again"))  # twice changes nothing


def test_a_missing_attribute_is_refused_before_anything_is_patched(
    monkeypatch: pytest.MonkeyPatch, installs: list, surface: Any,
) -> None:
    import vllm.v1.worker.utils as worker_utils

    monkeypatch.delattr(surface.block_pool_cls, "touch")
    monkeypatch.setattr(worker_utils, "allocate_kv_cache", lambda kv_cache_config, device: {})
    monkeypatch.setenv("KVDAEMON_VLLM_TENANT", "engine-a")
    with pytest.raises(Unsupported) as info:
        plugin.register()
    message = info.value.message
    assert "vLLM 0.33.0" in message and "BlockPool.touch()" in message
    assert "allocate_kv_cache('kv_cache_config', 'device', 'layout', 'kernel_block_sizes')" in message
    assert installs == []


def test_the_engines_shutdown_unregisters_its_tenant(surface: Any, kvd: RunningDaemon) -> None:
    """A vLLM engine that exits cleanly was logged as a lease ended without an unregister."""
    from tests.integrations.vllm.engines import start_tenant  # imports vLLM

    tenant = start_tenant(surface, kvd.dir, "a")
    set_current_tenant(tenant)
    calls: list[str] = []

    class Core:  # vLLM's EngineCore, as far as the wrapper sees it
        def shutdown(self) -> None:
            calls.append("vllm")

    patches._closing_tenant(Core.shutdown)(Core())
    assert calls == ["vllm"]
    with kvd.client() as client:
        assert client.status()["tenants"] == []  # unregistered, not dropped
    with pytest.raises(Unsupported):
        current_tenant()
    patches._closing_tenant(Core.shutdown)(Core())  # no tenant (a second shutdown): vLLM's alone
    assert calls == ["vllm", "vllm"]
