"""The import graph of the package: no cycles, and the daemon side free of torch.

Every ``import`` and ``from ... import`` of a ``kvdaemon`` module counts, at any
depth (inside functions and ``if TYPE_CHECKING:`` blocks too), so no module
imports one that imports it back, directly or around a longer loop.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {  # import prefix -> folder, as pyproject.toml maps them
    "kvdaemon.client": ROOT / "client",
    "kvdaemon.cuda_vmm": ROOT / "cuda_vmm",
    "kvdaemon.integrations": ROOT / "integrations",
    "kvdaemon": ROOT / "kvdaemon",
}


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for prefix, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found.setdefault(".".join([prefix, *parts]), path)
    return found


def imported(path: Path, known: dict[str, Path]) -> set[str]:
    """The known modules ``path`` imports (a name imported from a package counts as its
    submodule when one exists)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                names.add(sub if sub in known else node.module)
    return {name for name in names if name in known}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported(path, known) - {name} for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_one_that_imports_it_back() -> None:
    assert cycles(graph()) == []


def test_the_finder_sees_the_whole_tree() -> None:
    edges = graph()
    assert {"kvdaemon.daemon.service", "kvdaemon.client.pool", "kvdaemon.wire.messages"} <= edges.keys()
    assert "kvdaemon.client.pool_core" in edges["kvdaemon.client.pool"]


def test_cycles_are_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
