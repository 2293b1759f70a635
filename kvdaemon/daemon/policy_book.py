"""The operator's policies by tenant name, in two layers, the second kept across restarts.

- *configured*: the config file's ``[tenants.NAME]`` tables, read at start;
- *set*: what ``kvdaemon limit NAME`` set (``set_limit`` without a token),
  written to ``policies.json`` in the daemon directory on every change
  (``kvdaemon.daemon.policy_file``) and read back by the next daemon.

Which wins: field by field, a value set with ``limit`` wins over the config
file's (it is the later word), ``limit NAME --max none`` removes the max
whatever the file says, and ``limit NAME --reset`` forgets what ``limit`` set
for NAME, so the config file's values apply again. A name may have a policy
long before (or long after) a tenant of that name is registered.

At most ``MAX_POLICIES`` names have a policy set with ``limit`` (as many as
tenants may be registered at once), so the file stays far within what the
next daemon reads (``MAX_FILE_BYTES``) and ``status`` within one message; a
new name past that is refused (``Conflict``) until one is reset.

A min the operator set for a name is a promise kept while no tenant of that
name is registered (``promised``): a tenant's own min (one its policy does not
set) must fit beside those promises and the registered tenants' guarantees, so
no tenant can take by asking what the operator promised to another.

Only the service loop uses a book; nothing here locks. O(1) per lookup;
``promised`` O(names); a change costs one file write (``store``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from kvdaemon.daemon.policies import EMPTY, FIELDS, REMOVED, OwnLimits, Policy, bound, sets_min
from kvdaemon.daemon.policy_file import read_policies, write_policies
from kvdaemon.daemon.tenant import MAX_TENANTS
from kvdaemon.errors import Conflict

CONFIG, LIMIT = "config", "limit"
MAX_POLICIES = MAX_TENANTS  # names with a policy set by ``limit``


class PolicyBook:
    """Policies by tenant name (see the module docstring); ``path`` ``None`` keeps nothing on disk."""

    def __init__(
        self, configured: Mapping[str, Policy] | None = None, path: Path | None = None
    ) -> None:
        self._configured = dict(configured or {})
        self._set: dict[str, Policy] = {}
        self.path = path

    def load(self) -> None:
        """Read what ``limit`` set before a restart; ``ConfigError`` for a file it cannot use."""
        if self.path is not None:
            self._set = read_policies(self.path)

    def layer(self, name: str) -> Policy:
        """What ``limit`` set for ``name`` (empty when nothing)."""
        return self._set.get(name, EMPTY)

    def effective(self, name: str, layer: Policy | None = None) -> Policy:
        """The policy of ``name``: ``layer`` (default: the stored one) over the config file's."""
        top = self.layer(name) if layer is None else layer
        return top.over(self._configured.get(name, EMPTY))

    def sources(self, name: str) -> dict[str, str]:
        """Where each set field of ``name``'s policy comes from: ``config`` or ``limit``."""
        top, base = self.layer(name), self._configured.get(name, EMPTY)
        found = {}
        for field in FIELDS:
            if getattr(top, field) is not None:
                found[field] = LIMIT
            elif getattr(base, field) is not None:
                found[field] = CONFIG
        return found

    def store(self, name: str, layer: Policy) -> None:
        """Make ``layer`` what ``limit`` set for ``name`` (an empty one forgets it), on disk
        first: ``KVDaemonError`` when the file cannot be written, and then nothing changed;
        ``Conflict`` for a new name once ``MAX_POLICIES`` names have one.

        A ``none`` where the config file sets nothing is nothing, and is not kept.
        """
        base = self._configured.get(name, EMPTY)
        layer = Policy(*(
            None if getattr(layer, field) is REMOVED and getattr(base, field) is None
            else getattr(layer, field)
            for field in FIELDS
        ))  # fmt: skip
        kept = dict(self._set)
        if layer.is_empty:
            kept.pop(name, None)
        elif name not in kept and len(kept) >= MAX_POLICIES:
            raise Conflict(
                f"the daemon keeps policies for at most {MAX_POLICIES} names; forget one first "
                "(kvdaemon limit NAME --reset)"
            )
        else:
            kept[name] = layer
        if kept == self._set:
            return
        if self.path is not None:
            write_policies(self.path, kept)
        self._set = kept

    def promised(self, capacity_bytes: int, registered: Iterable[str], other_than: str = "") -> dict[str, int]:
        """The mins the operator's policies give names not ``registered`` (nor ``other_than``),
        as applied (bounded by the policy's max and the capacity), by name; zero ones left out."""
        present = {*registered, other_than}
        promised = {}
        for name in self.names():
            policy = self.effective(name)
            if name in present or not sets_min(policy):
                continue
            min_bytes = bound(OwnLimits(None, 0, 1.0), policy, capacity_bytes).limits.min_bytes
            if min_bytes:
                promised[name] = min_bytes
        return promised

    def names(self) -> list[str]:
        """Every name with a policy from either layer, sorted."""
        return sorted(set(self._configured) | set(self._set))

    def row(self, name: str, registered: bool) -> dict[str, Any]:
        """``name``'s entry of ``status``'s ``policies``: each field (``null`` unset, ``"none"``
        removed, else a size or weight), where each comes from, and whether it is registered."""
        policy = self.effective(name).to_json()
        return {
            "name": name, "registered": registered,
            **{field: policy.get(field) for field in FIELDS},
            "sources": self.sources(name),
        }  # fmt: skip

    def rows(self, registered: Iterable[str]) -> list[dict[str, Any]]:
        present = set(registered)
        return [self.row(name, name in present) for name in self.names()]
