"""kvdaemon.wire.sizes: parsing, resolving and formatting sizes."""

from __future__ import annotations

from decimal import Decimal

import pytest

from kvdaemon.errors import ConfigError
from kvdaemon.wire.protocol import MAX_INT
from kvdaemon.wire.sizes import SizeSpec, bytes_of, format_bytes, parse_size, percent_of

KiB, MiB, GiB, TiB = 1024, 1024**2, 1024**3, 1024**4


@pytest.mark.parametrize(
    ("text", "expected_bytes"),
    [
        ("1048576", MiB),
        (1048576, MiB),
        (0, 0),
        ("0", 0),
        ("4KiB", 4 * KiB),
        ("512MiB", 512 * MiB),
        ("2GiB", 2 * GiB),
        ("1TiB", TiB),
        ("1.5GiB", 3 * GiB // 2),
        ("500MB", 500 * 1000**2),
        ("2GB", 2 * 1000**3),
        ("3kB", 3000),
        ("1TB", 1000**4),
        ("2PiB", 2 * 1024 * TiB),
        ("1PB", 1000**5),
        ("7EiB", 7 * 1024**6),  # the limit message says 8 EiB: the unit it names is taken
        ("9EB", 9 * 1000**6),
        ("64B", 64),
        ("8 gib", 8 * GiB),
        ("  16MiB  ", 16 * MiB),
    ],
)
def test_exact_sizes_parse_to_their_bytes(text: str | int, expected_bytes: int) -> None:
    spec = parse_size(text)
    assert not spec.is_percent
    assert spec.resolve(123) == expected_bytes
    assert spec == bytes_of(expected_bytes)


@pytest.mark.parametrize(
    ("text", "total_bytes", "expected_bytes"),
    [
        ("40%", 1000, 400),
        ("100%", 8 * GiB, 8 * GiB),
        ("0%", 8 * GiB, 0),
        ("12.5%", 8 * GiB, GiB),
        ("33%", 10, 3),  # rounds down
    ],
)
def test_percentages_resolve_against_the_total(
    text: str, total_bytes: int, expected_bytes: int
) -> None:
    spec = parse_size(text)
    assert spec.is_percent
    assert spec.resolve(total_bytes) == expected_bytes


@pytest.mark.parametrize(
    "text",
    ["", "abc", "-5", "-1MiB", "12XB", "1.5", "1.1KiB", "101%", "5 %%", "GiB", "1e6", "0x10",
     "1,000", "2 GiB extra", "nan"],
)
def test_bad_text_raises_config_error_naming_it(text: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_size(text)
    assert caught.value.code == "CONFIG"
    assert repr(text) in caught.value.message


@pytest.mark.parametrize(("text", "kept"), [
    ("0.000001%", "0.000001%"), ("0.0000010%", "0.000001%"), ("50.0000000%", "50%"), ("0.0000000000%", "0%"),
    ("100%", "100%"), ("12.5%", "12.5%"), ("0" * 500 + "7.25" + "0" * 500 + "%", "7.25%"),
    ("12.3456789%", "12.345678%"), ("0.0000001%", "0%"), ("99.9999990000000000000000000001%", "99.999999%"),
])
def test_a_percentage_is_kept_to_a_millionth_in_short_text_that_reads_back(text: str, kept: str) -> None:
    spec = parse_size(text)  # an older daemon's policies.json may hold more decimals: they read, rounded down
    assert str(spec) == kept and parse_size(str(spec)) == spec  # kept in policies.json: it must read back
    assert percent_of(text.rstrip("%").lstrip("0") or "0") == spec


@pytest.mark.parametrize("value", ["99999999999999999999999", "9223372036854775808", "9300000TB", "8EiB", 1 << 63])
def test_a_byte_count_past_what_the_wire_carries_is_refused(value: str | int) -> None:
    with pytest.raises(ConfigError, match=r"at most 9223372036854775807 bytes"):
        parse_size(value)
    assert parse_size(MAX_INT).exact_bytes == parse_size(str(MAX_INT)).exact_bytes == MAX_INT


@pytest.mark.parametrize("value", [-1, True, 1.5, None, [1]])
def test_bad_values_of_other_types_raise_config_error(value: object) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_size(value)  # type: ignore[arg-type]
    assert repr(value) in caught.value.message


@pytest.mark.parametrize("text", ["1048576", "512MiB", "40%", "12.5%", "0%", "1.5GiB", "2GB"])
def test_str_round_trips_through_parse(text: str) -> None:
    spec = parse_size(text)
    assert parse_size(str(spec)) == spec


def test_spec_needs_exactly_one_form() -> None:
    with pytest.raises(ConfigError):
        SizeSpec()
    with pytest.raises(ConfigError):
        SizeSpec(exact_bytes=1, percent=Decimal(1))
    with pytest.raises(ConfigError):
        SizeSpec(exact_bytes=-1)
    with pytest.raises(ConfigError):
        percent_of(101)


@pytest.mark.parametrize(
    ("num_bytes", "text"),
    [
        (0, "0 B"),
        (512, "512 B"),
        (1023, "1023 B"),
        (KiB, "1.00 KiB"),
        (512 * MiB, "512.0 MiB"),
        (3 * GiB // 2, "1.50 GiB"),
        (64 * MiB, "64.0 MiB"),
        (2 * TiB, "2.00 TiB"),
        (-2 * KiB, "-2.00 KiB"),
    ],
)
def test_format_bytes(num_bytes: int, text: str) -> None:
    assert format_bytes(num_bytes) == text
