"""Packages whose heavy names load on first use: the CLI imports no backend and no pool."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvdaemon.lazy_names import lazy_names

HEAVY = ("kvdaemon.client.pool", "kvdaemon.client.pool_core", "kvdaemon.cuda_vmm.host", "kvdaemon.cuda_vmm.cuda",
         "torch")


def test_the_cli_imports_no_backend_pool_or_torch() -> None:
    code = f"import sys, kvdaemon.cli.commands; print([m for m in {HEAVY!r} if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]", done.stdout


def test_a_lazy_name_loads_its_module_once_and_others_are_attribute_errors() -> None:
    namespace: dict[str, object] = {}
    getattr_ = lazy_names("pkg", {"JSONDecoder": "json.decoder"}, namespace)
    import json.decoder

    assert getattr_("JSONDecoder") is json.decoder.JSONDecoder
    assert namespace == {"JSONDecoder": json.decoder.JSONDecoder}  # kept: the next lookup finds it
    with pytest.raises(AttributeError, match="module 'pkg' has no attribute 'nothing'"):
        getattr_("nothing")


def test_the_packages_lazy_names_are_what_they_name() -> None:
    from kvdaemon import client, cuda_vmm
    from kvdaemon.client.pool import KVPool
    from kvdaemon.cuda_vmm.host import HostBackend

    assert client.KVPool is KVPool and cuda_vmm.HostBackend is HostBackend
