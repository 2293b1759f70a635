"""Operator policies: parsing, layering (config file, then ``limit``), bounding a tenant's own
request, and the policy file (atomic, private, never through a symlink)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from kvdaemon.daemon.policies import (
    REMOVED, Clamp, Limits, OwnLimits, Policy, bound, check_consistent, parse_policy,
    request_policy,
)  # fmt: skip
from kvdaemon.daemon.policy_book import MAX_POLICIES, PolicyBook
from kvdaemon.daemon import policy_file
from kvdaemon.daemon.policy_file import read_policies, write_policies
from kvdaemon.errors import BadRequest, ConfigError, Conflict, KVDaemonError
from kvdaemon.wire.sizes import parse_size

MiB = 1024 * 1024
CAPACITY = 1024 * MiB
NO_OWN = OwnLimits(max_bytes=None, min_bytes=0, weight=1.0)


def policy(**fields: object) -> Policy:
    return parse_policy(fields, "test")


# -- parsing ----------------------------------------------------------------------------------


def test_parse_policy_reads_sizes_percentages_weights_and_none() -> None:
    parsed = policy(max="40%", min=1048576, weight=2)
    assert parsed == Policy(max=parse_size("40%"), min=parse_size("1MiB"), weight=2.0)
    assert policy(max="none", weight="None") == Policy(max=REMOVED, weight=REMOVED)
    assert parsed.to_json() == {"max": "40%", "min": 1048576, "weight": 2.0}
    assert parse_policy(parsed.to_json(), "again") == parsed  # the JSON form reads back
    assert policy(max="none").to_json() == {"max": "none"}


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"maximum": "1GiB"}, "unknown key 'maximum'; known are max, min, weight"),
        ({"max": "eight gigs"}, "max: invalid size 'eight gigs'"),
        ({"min": "120%"}, "min: invalid size '120%'"),
        ({"weight": 0}, "weight must be a number in [1e-06, 1e+06] or none, got 0"),
        ({"weight": True}, "weight must be a number"),
        ({"weight": "heavy"}, "weight must be a number"),
    ],
)
def test_parse_policy_refuses_bad_fields(fields: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError, match="^tenants.a: ") as err:
        parse_policy(fields, "tenants.a")
    assert fragment in err.value.message
    with pytest.raises(BadRequest):
        request_policy(fields)


def test_check_consistent_compares_like_units_only() -> None:
    with pytest.raises(ConfigError, match="tenants.a: min 50% exceeds max 40%"):
        check_consistent(policy(max="40%", min="50%"), "tenants.a")
    with pytest.raises(ConfigError, match="min 2097152 exceeds max 1048576"):
        check_consistent(policy(max="1MiB", min="2MiB"), "tenants.a")
    check_consistent(policy(max="1MiB", min="50%"), "tenants.a")  # mixed: checked when applied
    check_consistent(policy(max="none", min="50%"), "tenants.a")


def test_over_takes_set_fields_from_the_top_layer() -> None:
    config = policy(max="40%", weight=3)
    assert policy(max="8GiB").over(config) == policy(max="8GiB", weight=3)
    assert policy(max="none").over(config).settled() == policy(weight=3)  # none removes it
    assert Policy().over(config) == config
    assert policy(min="1GiB").over(config).describe() == "max 40%, min 1.00 GiB, weight 3"
    assert Policy().describe() == "no operator limits"


# -- bound: the operator's policy bounds the tenant's own request ---------------------------


def test_bound_without_a_policy_is_the_tenants_own_request() -> None:
    assert bound(OwnLimits(64 * MiB, 16 * MiB, 2.0), Policy(), CAPACITY).limits == Limits(
        64 * MiB, 16 * MiB, 2.0
    )
    assert bound(NO_OWN, Policy(), CAPACITY).limits == Limits(CAPACITY, 0, 1.0)


def test_bound_takes_the_smaller_max_and_the_policys_min_and_weight() -> None:
    own = OwnLimits(max_bytes=512 * MiB, min_bytes=64 * MiB, weight=1.0)
    assert bound(own, policy(max="25%"), CAPACITY).limits.max_bytes == 256 * MiB  # policy smaller
    assert bound(own, policy(max="75%"), CAPACITY).limits.max_bytes == 512 * MiB  # own smaller
    bounded = bound(own, policy(min="8MiB", weight=4), CAPACITY)
    assert bounded.limits == Limits(512 * MiB, 8 * MiB, 4.0) and bounded.clamped == ()


def test_bound_reports_what_it_clamps() -> None:
    above = bound(NO_OWN, policy(max="20GiB"), CAPACITY)
    assert above.limits.max_bytes == CAPACITY
    assert above.clamped == (Clamp("max", 20 * 1024 * MiB, CAPACITY, "above the capacity"),)
    assert above.clamped[0].describe() == "max 20.0 GiB clamped to 1.00 GiB (above the capacity)"
    assert above.clamped[0].to_json() == {
        "field": "max", "requested_bytes": 20 * 1024 * MiB, "applied_bytes": CAPACITY,
        "reason": "above the capacity",
    }  # fmt: skip
    own_min = bound(OwnLimits(None, 300 * MiB, 1.0), policy(max="256MiB"), CAPACITY)
    assert own_min.limits == Limits(256 * MiB, 256 * MiB, 1.0)
    assert own_min.clamped == (Clamp("min", 300 * MiB, 256 * MiB, "above the max"),)
    no_max = bound(NO_OWN, policy(min="2GiB"), CAPACITY)  # no max but the capacity's
    assert no_max.clamped == (Clamp("min", 2048 * MiB, CAPACITY, "above the capacity"),)


# -- the book: which layer wins ---------------------------------------------------------------


def test_a_limit_wins_over_the_config_field_by_field_and_reset_restores_the_config() -> None:
    book = PolicyBook({"a": policy(max="40%", weight=3)})
    assert book.effective("a") == policy(max="40%", weight=3)
    assert book.sources("a") == {"max": "config", "weight": "config"}
    book.store("a", policy(max="8GiB"))
    assert book.effective("a") == policy(max="8GiB", weight=3)
    assert book.sources("a") == {"max": "limit", "weight": "config"}
    book.store("a", policy(max="none"))
    assert book.effective("a").settled() == policy(weight=3)
    assert book.row("a", registered=False) == {
        "name": "a", "registered": False, "max": "none", "min": None, "weight": 3.0,
        "sources": {"max": "limit", "weight": "config"},
    }  # fmt: skip
    book.store("a", Policy())  # --reset
    assert book.effective("a") == policy(max="40%", weight=3)
    assert book.names() == ["a"]


def test_the_book_keeps_what_limit_set_in_its_file(tmp_path: Path) -> None:
    path = tmp_path / "policies.json"
    book = PolicyBook({"a": policy(weight=2)}, path)
    book.load()  # no file yet: nothing set
    assert book.names() == ["a"]
    book.store("b", policy(max="40%", min=4 * MiB))
    book.store("a", policy(max="none", weight="none"))  # no max in the config: nothing to remove
    again = PolicyBook({}, path)
    again.load()
    assert again.layer("b") == policy(max="40%", min=4 * MiB)
    assert again.layer("a") == policy(weight="none")
    assert again.names() == ["a", "b"]
    book.store("a", policy(max="none"))
    assert book.layer("a") == policy() and book.effective("a") == policy(weight=2)


def test_the_book_refuses_a_new_name_past_its_cap_and_keeps_the_rest() -> None:
    book = PolicyBook({"configured": policy(weight=2)})
    for i in range(MAX_POLICIES):
        book.store(f"t{i}", policy(max="40%"))
    with pytest.raises(Conflict, match=f"at most {MAX_POLICIES} names"):
        book.store("one-more", policy(max="40%"))
    assert book.layer("one-more") == policy() and len(book.names()) == MAX_POLICIES + 1
    book.store("t0", policy(weight=3))  # a name it has may change
    book.store("t1", policy())  # ... or be forgotten, which makes room
    book.store("one-more", policy(max="40%"))
    assert book.layer("one-more") == policy(max="40%") and book.layer("t0") == policy(weight=3)


def test_a_full_book_of_the_longest_names_fits_the_file_the_next_daemon_reads(tmp_path: Path) -> None:
    path = tmp_path / "policies.json"
    widest = policy(max=(1 << 62) - 1, min="99.999999%", weight=0.30000000000000004)
    names = [f"{i:04d}" + "x" * 124 for i in range(MAX_POLICIES)]
    write_policies(path, dict.fromkeys(names, widest))
    assert path.stat().st_size < policy_file.MAX_FILE_BYTES // 2
    assert read_policies(path) == dict.fromkeys(names, widest)


# -- the file -----------------------------------------------------------------------------------


def test_the_file_is_written_whole_private_and_readable_as_json(tmp_path: Path) -> None:
    path = tmp_path / "policies.json"
    write_policies(path, {"b": policy(max="40%"), "a": policy(weight=2)})
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert json.loads(path.read_text()) == {
        "version": 1, "tenants": {"a": {"weight": 2.0}, "b": {"max": "40%"}},
    }  # fmt: skip
    assert read_policies(path) == {"a": policy(weight=2), "b": policy(max="40%")}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policies.json"]  # no leftover


def test_a_planted_leftover_or_symlink_is_never_followed(tmp_path: Path) -> None:
    path = tmp_path / "policies.json"
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "policies.json.tmp").symlink_to(victim)  # a planted temporary file
    write_policies(path, {"a": policy(max="1GiB")})
    assert victim.read_text() == "precious" and not (tmp_path / "policies.json.tmp").exists()
    path.unlink()
    path.symlink_to(victim)
    with pytest.raises(ConfigError, match="cannot use the policy file .*policies.json: "):
        read_policies(path)


def test_a_write_that_fails_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "missing-dir" / "policies.json"
    book = PolicyBook({}, path)
    with pytest.raises(KVDaemonError, match="cannot keep the policy in .*; nothing changed") as err:
        book.store("a", policy(max="1GiB"))
    assert err.value.code == "INTERNAL"
    assert book.layer("a") == Policy()


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("{not json", "not JSON"),
        ('{"version": 2, "tenants": {}}', "not a version 1 policy file"),
        ('{"version": 1, "tenants": []}', "'tenants' is not an object"),
        ('{"version": 1, "tenants": {"a b": {}}}', "tenant name 'a b' must be"),
        ('{"version": 1, "tenants": {"a": 3}}', "the policy of 'a' is not an object"),
        ('{"version": 1, "tenants": {"a": {"max": "lots"}}}', "tenant 'a': max: invalid size"),
    ],
)
def test_a_bad_file_is_refused_with_how_to_recover(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "policies.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        read_policies(path)
    assert fragment in err.value.message
    assert "remove it to forget the policies set with `kvdaemon limit`" in err.value.message


def test_a_directory_in_the_files_place_is_refused_with_how_to_recover(tmp_path: Path) -> None:
    path = tmp_path / "policies.json"
    path.mkdir()
    with pytest.raises(ConfigError) as err:
        read_policies(path)
    assert "not a regular file" in err.value.message
    assert "remove it to forget the policies set with `kvdaemon limit`" in err.value.message


def test_a_file_past_the_size_cap_is_refused_without_reading_it_all(tmp_path: Path) -> None:
    path = tmp_path / "policies.json"
    path.write_bytes(b" " * (policy_file.MAX_FILE_BYTES + 10))
    with pytest.raises(ConfigError, match=f"larger than {policy_file.MAX_FILE_BYTES} bytes"):
        read_policies(path)
