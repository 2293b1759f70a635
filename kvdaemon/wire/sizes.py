"""Byte sizes as people write them: ``1048576``, ``512MiB``, ``2GB``, ``40%``.

``parse_size`` turns text (or an int) into a :class:`SizeSpec`, which is
either an exact byte count or a percentage of some total that is only known
later (the device's memory, the daemon's capacity); ``SizeSpec.resolve``
applies it. ``format_bytes`` is the inverse for display. Everything here is
pure and O(length of the text).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import ROUND_DOWN, Decimal, InvalidOperation

from kvdaemon.errors import ConfigError
from kvdaemon.wire.protocol import MAX_INT

_UNIT_BYTES: dict[str, int] = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "pb": 1000**5,
    "eb": 1000**6,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "pib": 1024**5,
    "eib": 1024**6,
}

_SIZE_RE = re.compile(r"^\s*(?P<number>[0-9]+(?:\.[0-9]+)?)\s*(?P<unit>[a-z%]*)\s*$", re.IGNORECASE)

_ACCEPTED = "bytes (1048576), 512MiB, 2GiB, 4KiB, 1TiB, 500MB, 2GB or a percentage (40%)"

PERCENT_STEP = Decimal("0.000001")  # a percentage is kept to this, rounded down: short text, wherever kept

_DISPLAY_UNITS: tuple[tuple[str, int], ...] = (
    ("TiB", 1024**4),
    ("GiB", 1024**3),
    ("MiB", 1024**2),
    ("KiB", 1024),
)


@dataclass(frozen=True)
class SizeSpec:
    """An exact size (``exact_bytes``) or a share of a total (``percent``); exactly one is set.

    ``str(spec)`` gives text that ``parse_size`` reads back to an equal spec,
    so a spec can cross a command line unchanged.
    """

    exact_bytes: int | None = None
    percent: Decimal | None = None

    def __post_init__(self) -> None:
        if (self.exact_bytes is None) == (self.percent is None):
            raise ConfigError("a size is either a byte count or a percentage, not both or neither")
        if self.exact_bytes is not None and self.exact_bytes < 0:
            raise ConfigError(f"size must not be negative, got {self.exact_bytes}")
        if self.percent is not None and not Decimal(0) <= self.percent <= Decimal(100):
            raise ConfigError(f"percentage must be between 0% and 100%, got {self.percent}%")
        if self.percent is not None:  # kept to PERCENT_STEP, rounded down: its text stays short
            kept = self.percent.quantize(PERCENT_STEP, rounding=ROUND_DOWN).normalize()
            object.__setattr__(self, "percent", kept)

    @property
    def is_percent(self) -> bool:
        return self.percent is not None

    def resolve(self, total_bytes: int) -> int:
        """Bytes this spec means against ``total_bytes`` (a percentage rounds down)."""
        if self.exact_bytes is not None:
            return self.exact_bytes
        assert self.percent is not None
        return int(Decimal(total_bytes) * self.percent / 100)

    def __str__(self) -> str:
        if self.exact_bytes is not None:
            return str(self.exact_bytes)
        assert self.percent is not None
        return f"{self.percent.normalize():f}%"  # never an exponent ('1E-7%' reads back as no size)


def bytes_of(count: int) -> SizeSpec:
    """An exact size of ``count`` bytes."""
    return SizeSpec(exact_bytes=count)


def percent_of(share: int | float | str | Decimal) -> SizeSpec:
    """A size of ``share`` percent of whatever total it is resolved against."""
    return SizeSpec(percent=Decimal(str(share)))


def parse_size(text: str | int) -> SizeSpec:
    """Parse a size; raises ``ConfigError`` naming ``text`` when it is not one.

    Units are case-insensitive: ``B``, binary ``KiB MiB GiB TiB`` (powers of
    1024), decimal ``KB MB GB TB`` (powers of 1000) and ``%``. A fractional
    number is allowed with a unit when the result is a whole number of bytes
    (``1.5GiB``), and with ``%`` (kept to ``PERCENT_STEP``, rounded down). A byte
    count is at most ``MAX_INT`` (2^63 - 1, what the wire carries).
    """
    if isinstance(text, bool):
        raise ConfigError(f"invalid size {text!r}: expected {_ACCEPTED}")
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"invalid size {text!r}: must not be negative")
        return _checked(text, text)
    if not isinstance(text, str):
        raise ConfigError(f"invalid size {text!r}: expected {_ACCEPTED}")
    match = _SIZE_RE.match(text)
    if match is None:
        raise ConfigError(f"invalid size {text!r}: expected {_ACCEPTED}")
    return _spec_of(text, match["number"], match["unit"].lower())


def _spec_of(text: str, number: str, unit: str) -> SizeSpec:
    try:
        value = Decimal(number)
    except InvalidOperation as err:
        raise ConfigError(f"invalid size {text!r}: {number!r} is not a number") from err
    if unit == "%":
        if value > 100:
            raise ConfigError(f"invalid size {text!r}: a percentage is at most 100%")
        return SizeSpec(percent=value)
    if unit == "":
        unit = "b"
    if unit not in _UNIT_BYTES:
        raise ConfigError(f"invalid size {text!r}: unknown unit {unit!r}; expected {_ACCEPTED}")
    exact = value * _UNIT_BYTES[unit]
    if exact != exact.to_integral_value():
        raise ConfigError(f"invalid size {text!r}: not a whole number of bytes")
    return _checked(text, int(exact))


def _checked(text: str | int, num_bytes: int) -> SizeSpec:
    if num_bytes > MAX_INT:
        raise ConfigError(f"invalid size {text!r}: at most {MAX_INT} bytes (8 EiB)")
    return bytes_of(num_bytes)


def format_bytes(num_bytes: int) -> str:
    """Human-readable size in binary units: ``0 B``, ``512 B``, ``1.50 GiB``, ``512.0 MiB``.

    Two decimals below 10 of a unit, one above; plain bytes are whole.
    """
    sign = "-" if num_bytes < 0 else ""
    magnitude = abs(num_bytes)
    for name, unit_bytes in _DISPLAY_UNITS:
        if magnitude >= unit_bytes:
            value = magnitude / unit_bytes
            digits = 2 if value < 10 else 1
            return f"{sign}{value:.{digits}f} {name}"
    return f"{sign}{magnitude} B"


def format_bytes_short(num_bytes: int) -> str:
    """At most six characters, for narrow columns: ``0``, ``512B``, ``8.00M``, ``24.0G``, ``0.99G``.

    Binary units as one letter (K, M, G, T), three significant digits; a value
    that would need four digits is written in the next unit up (``0.99G``).
    """
    sign = "-" if num_bytes < 0 else ""
    magnitude = abs(num_bytes)
    if magnitude < 1000:
        return f"{sign}{magnitude}B" if magnitude else "0"
    units = [(name[0], unit_bytes) for name, unit_bytes in reversed(_DISPLAY_UNITS)]
    index = max(i for i, (_, unit_bytes) in enumerate(units) if magnitude >= unit_bytes or i == 0)
    value = magnitude / units[index][1]
    if value >= 999.5 and index + 1 < len(units):
        index += 1
        value = magnitude / units[index][1]
    text = f"{value:.2f}" if value < 9.995 else f"{value:.1f}" if value < 99.95 else f"{value:.0f}"
    return f"{sign}{text}{units[index][0]}"
