"""vLLM on kvdaemon: a vLLM engine's KV cache lives in the daemon's shared, elastic pool.

Installed with kvdaemon, ``register`` is an entry point of vLLM's
``vllm.general_plugins`` group, which vLLM calls once in every process it
starts (front end, engine core, workers; ``VLLM_PLUGINS`` is an allow-list).
It does nothing unless ``KVDAEMON_VLLM_TENANT`` names a tenant (see
``config``). Then it checks the installed vLLM (``gate``: the tested release
series, and every class, method and field the plugin touches) and, only if
all is there, patches vLLM (``patches``); otherwise it raises ``Unsupported``
naming the version or what is missing, and vLLM does not start.

Importing this package imports neither vLLM nor torch.
"""

from __future__ import annotations

import os

from kvdaemon.integrations.vllm.config import PluginConfig


def register() -> None:
    """vLLM's plugin hook: enable kvdaemon for this engine if ``KVDAEMON_VLLM_TENANT`` is set."""
    config = PluginConfig.from_env(os.environ)
    if config is None:
        return
    from kvdaemon.integrations.vllm.gate import check_vllm
    from kvdaemon.integrations.vllm.patches import install

    install(check_vllm(), config)


__all__ = ["PluginConfig", "register"]
