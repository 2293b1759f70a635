"""Names of a package that import their module on first use (PEP 562), so that importing
the package does no work a caller may not need (the CLI needs no backend, no pool)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, MutableMapping
from typing import Any


def lazy_names(package: str, modules: dict[str, str], namespace: MutableMapping[str, Any]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: a name of ``modules`` (name -> module path)
    imports its module when first asked for and is kept in ``namespace`` (the package's globals),
    so later lookups cost nothing; any other name is an ``AttributeError``."""

    def getattr_(name: str) -> Any:
        module = modules.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return getattr_
