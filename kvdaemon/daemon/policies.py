"""Operator policies: the limits an operator sets for a tenant *name*, registered or not.

A :class:`Policy` holds up to three fields: ``max`` and ``min`` (a
``SizeSpec``: bytes, or a percentage of the daemon's capacity, resolved when
applied) and ``weight``. Each field is a value, ``REMOVED`` (written ``none``:
the operator sets nothing for it) or unset (``None``: another layer decides,
see ``kvdaemon.daemon.policy_book``).

:func:`bound` turns a tenant's own request (``OwnLimits``: what it asked at
registration) and the operator's policy into the limits the daemon applies.
The operator's policy bounds the tenant:

- max: the smaller of the tenant's own max and the policy's (one missing: the
  other; both missing: the capacity), and never above the capacity;
- min: the policy's when it sets one, else the tenant's own; never above max;
- weight: the policy's when it sets one, else the tenant's own.

Where a value had to be lowered (a policy's max above the capacity, a min
above the max) the result carries a :class:`Clamp` saying so: nothing is
rewritten silently. Pure; O(1) per call.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Union

from kvdaemon.errors import BadRequest, ConfigError
from kvdaemon.wire.messages import describe_clamp
from kvdaemon.wire.sizes import SizeSpec, format_bytes, parse_size

MIN_WEIGHT = 1e-6
MAX_WEIGHT = 1e6
FIELDS = ("max", "min", "weight")


class Removed(enum.Enum):
    """A field the operator removed (``--max none``): no operator value for it."""

    NONE = "none"


REMOVED = Removed.NONE
SizeField = Union[SizeSpec, Removed, None]
WeightField = Union[float, Removed, None]


@dataclass(frozen=True)
class Policy:
    """The operator's ``max``/``min``/``weight`` for one tenant name (see the module docstring)."""

    max: SizeField = None
    min: SizeField = None
    weight: WeightField = None

    def over(self, base: Policy) -> Policy:
        """This policy's fields where set, ``base``'s elsewhere."""
        return Policy(*(
            mine if mine is not None else getattr(base, f.name)
            for f, mine in ((f, getattr(self, f.name)) for f in fields(self))
        ))  # fmt: skip

    def settled(self) -> Policy:
        """The same with ``REMOVED`` fields unset: what ``bound`` applies."""
        return Policy(*(None if getattr(self, f.name) is REMOVED else getattr(self, f.name)
                        for f in fields(self)))  # fmt: skip

    @property
    def is_empty(self) -> bool:
        return all(getattr(self, name) is None for name in FIELDS)

    def to_json(self) -> dict[str, Any]:
        """The fields that are set: a size as bytes (an integer) or ``"N%"``, a weight as a
        number, ``"none"`` for a removed field; ``parse_policy`` reads it back."""
        out: dict[str, Any] = {}
        for name in FIELDS:
            value = getattr(self, name)
            if value is REMOVED:
                out[name] = REMOVED.value
            elif isinstance(value, SizeSpec):
                out[name] = str(value) if value.is_percent else value.resolve(0)
            elif value is not None:
                out[name] = value
        return out

    def describe(self) -> str:
        """``max 40%, min 1.00 GiB, weight 2`` (``no operator limits`` when nothing is set)."""
        parts = []
        for name in FIELDS:
            value = getattr(self, name)
            if value is REMOVED:
                parts.append(f"{name} none")
            elif isinstance(value, SizeSpec):
                shown = str(value) if value.is_percent else format_bytes(value.resolve(0))
                parts.append(f"{name} {shown}")
            elif value is not None:
                parts.append(f"{name} {value:g}")
        return ", ".join(parts) or "no operator limits"


EMPTY = Policy()


def parse_policy(raw: Mapping[str, Any], where: str) -> Policy:
    """A policy from a map of ``max``/``min``/``weight`` (a TOML table, the policy file).

    Sizes are bytes or text (``8GiB``, ``40%``); any field may be ``"none"``.
    Raises ``ConfigError`` naming ``where`` for an unknown key or a bad value.
    """
    unknown = sorted(set(raw) - set(FIELDS))
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; known are {', '.join(FIELDS)}")
    try:
        return Policy(
            max=parse_size_field("max", raw.get("max")),
            min=parse_size_field("min", raw.get("min")),
            weight=parse_weight_field(raw.get("weight")),
        )
    except ConfigError as err:
        raise ConfigError(f"{where}: {err.message}") from err


def parse_size_field(name: str, raw: Any) -> SizeField:
    """``None`` (unset), ``"none"`` (``REMOVED``), or a size; ``ConfigError`` otherwise."""
    if raw is None:
        return None
    if isinstance(raw, str) and raw.strip().lower() == REMOVED.value:
        return REMOVED
    try:
        return parse_size(raw)
    except ConfigError as err:
        raise ConfigError(f"{name}: {err.message}") from err


def parse_weight_field(raw: Any) -> WeightField:
    """``None`` (unset), ``"none"`` (``REMOVED``), or a weight in [1e-6, 1e6]."""
    if raw is None:
        return None
    if isinstance(raw, str) and raw.strip().lower() == REMOVED.value:
        return REMOVED
    number = isinstance(raw, (int, float)) and not isinstance(raw, bool)
    if not number or not MIN_WEIGHT <= raw <= MAX_WEIGHT:
        raise ConfigError(
            f"weight must be a number in [{MIN_WEIGHT:g}, {MAX_WEIGHT:g}] or none, got {raw!r}"
        )
    return float(raw)


def request_policy(raw: Mapping[str, Any]) -> Policy:
    """A ``set_limit`` request's policy fields, as ``parse_policy`` but ``BadRequest``."""
    try:
        return parse_policy({k: v for k, v in raw.items() if v is not None}, "set_limit")
    except ConfigError as err:
        raise BadRequest(err.message) from err


@dataclass(frozen=True)
class OwnLimits:
    """What a tenant asked for itself at registration (``max_bytes`` ``None``: no limit)."""

    max_bytes: int | None
    min_bytes: int
    weight: float


@dataclass(frozen=True)
class Limits:
    """The limits the daemon applies to a tenant."""

    max_bytes: int
    min_bytes: int
    weight: float


@dataclass(frozen=True)
class Clamp:
    """A limit lowered from what was asked: ``field`` (``max``/``min``) and why."""

    field: str
    requested_bytes: int
    applied_bytes: int
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"field": self.field, "requested_bytes": self.requested_bytes,
                "applied_bytes": self.applied_bytes, "reason": self.reason}  # fmt: skip

    def describe(self) -> str:
        """``max 20.00 GiB clamped to 1.00 GiB (above the capacity)``."""
        return describe_clamp(self.to_json())


@dataclass(frozen=True)
class Bounded:
    """``bound``'s answer: the limits to apply and what was clamped on the way."""

    limits: Limits
    clamped: tuple[Clamp, ...] = ()


def bound(own: OwnLimits, policy: Policy, capacity_bytes: int) -> Bounded:
    """The limits of a tenant asking ``own`` under ``policy`` (see the module docstring)."""
    policy = policy.settled()
    clamped: list[Clamp] = []
    policy_max = _resolved(policy.max, capacity_bytes)
    if policy_max is not None and policy_max > capacity_bytes:
        clamped.append(Clamp("max", policy_max, capacity_bytes, "above the capacity"))
    candidates = [capacity_bytes, own.max_bytes, policy_max]
    max_bytes = min(c for c in candidates if c is not None)
    policy_min = _resolved(policy.min, capacity_bytes)
    min_bytes = own.min_bytes if policy_min is None else policy_min
    if min_bytes > max_bytes:
        clamped.append(Clamp("min", min_bytes, max_bytes, "above the capacity" if max_bytes >= capacity_bytes
                             else "above the max"))
        min_bytes = max_bytes
    weight = own.weight if not isinstance(policy.weight, float) else policy.weight
    return Bounded(Limits(max_bytes, min_bytes, weight), tuple(clamped))


def sets_min(policy: Policy) -> bool:
    """Whether ``policy`` sets the min (a tenant's own min applies where it does not)."""
    return isinstance(policy.settled().min, SizeSpec)


def check_consistent(policy: Policy, where: str) -> None:
    """``ConfigError`` when ``policy``'s min exceeds its max in the same units (both
    bytes, or both percentages); mixed units are only comparable once applied."""
    settled = policy.settled()
    low, high = settled.min, settled.max
    if isinstance(low, SizeSpec) and isinstance(high, SizeSpec) and _exceeds(low, high):
        raise ConfigError(f"{where}: min {low} exceeds max {high}")


def _exceeds(low: SizeSpec, high: SizeSpec) -> bool:
    if low.percent is not None and high.percent is not None:
        return low.percent > high.percent
    if low.exact_bytes is not None and high.exact_bytes is not None:
        return low.exact_bytes > high.exact_bytes
    return False


def _resolved(spec: SizeField, capacity_bytes: int) -> int | None:
    return spec.resolve(capacity_bytes) if isinstance(spec, SizeSpec) else None
