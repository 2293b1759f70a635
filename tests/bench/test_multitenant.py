"""bench/multitenant.py: the per-seed ratios, the floor that says which contended targets can be
met, and the unbounded replay that measures it (each tenant mapped to the whole capacity)."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import multitenant  # noqa: E402
import multitenant_replay  # noqa: E402
from traces import Arrival  # noqa: E402

MiB = 1 << 20


def summary(mean_s: float, p99_s: float, tokens_per_s: float = 100.0, preemptions: int = 0) -> dict[str, Any]:
    return {"overall": {"requests": 10, "ttft_mean_s": mean_s, "ttft_p99_s": p99_s,
                        "tokens_per_s": tokens_per_s, "preemptions": preemptions}}


def test_ratios_are_elastic_over_static_and_each_mode_over_the_floor() -> None:
    results = {"static": summary(0.04, 0.12, 100, 3), "elastic": summary(0.03, 0.08, 99, 1),
               "unbounded": summary(0.02, 0.07)}
    r = multitenant.ratios(results)
    assert r["ttft_p99"] == pytest.approx(0.08 / 0.12)
    assert r["ttft_mean"] == pytest.approx(0.75)
    assert r["throughput"] == pytest.approx(0.99)
    assert r["preemptions"] == -2
    assert r["elastic_floor_p99"] == pytest.approx(0.08 / 0.07)
    assert r["static_floor_p99"] == pytest.approx(0.12 / 0.07)


def test_without_a_floor_run_there_is_no_floor_ratio_and_every_target_counts_as_reachable() -> None:
    r = multitenant.ratios({"static": summary(0.04, 0.12), "elastic": summary(0.03, 0.08)})
    assert "elastic_floor_p99" not in r and "static_floor_p99" not in r
    assert multitenant.reachable(r)


@pytest.mark.parametrize(("static_over_floor", "expected"), [(1.7, False), (1.999, False), (2.0, True), (5.0, True)])
def test_a_contended_target_is_reachable_only_where_static_is_twice_the_floor(
    static_over_floor: float, expected: bool
) -> None:
    assert multitenant.reachable({"static_floor_p99": static_over_floor}) is expected


def test_an_unreachable_seed_still_misses_its_target_and_is_left_out_of_the_reachable_worst(
    capsys: pytest.CaptureFixture[str],
) -> None:
    hard = {"ttft_p99": 0.2, "ttft_mean": 0.5, "throughput": 1.0, "preemptions": 0,
            "elastic_floor_p99": 1.0, "static_floor_p99": 5.0}
    barely = {"ttft_p99": 0.7, "ttft_mean": 1.0, "throughput": 1.0, "preemptions": 0,
              "elastic_floor_p99": 1.1, "static_floor_p99": 1.57}
    assert multitenant.verdicts("contended", barely) == {"throughput": True, "ttft_p99": False}
    worst = multitenant.print_worst([{"class": "contended", "ratios": hard},
                                     {"class": "contended", "ratios": barely}])
    assert worst["contended"]["ttft_p99"] == pytest.approx(0.7)  # the class's worst keeps every seed
    line = next(t for t in capsys.readouterr().out.splitlines() if t.startswith("worst contended"))
    assert "TTFT p99 0.700x (<= 0.5x MISS)" in line
    assert "where reachable (1 seed(s)) 0.200x PASS" in line
    assert "elastic p99 at most 1.10x the floor" in line


def test_an_unknown_mode_is_refused_before_a_daemon_starts() -> None:
    with pytest.raises(ValueError, match="'dynamic' is not one of static, elastic, unbounded"):
        multitenant_replay.replay("dynamic", [], [], 36 * MiB, 512)


def test_the_unbounded_replay_maps_the_whole_capacity_for_each_tenant_and_serves_every_request() -> None:
    from engine import build_model

    models = [build_model(seed) for seed in range(3)]
    trace = [Arrival(0.01 * i, i % 3, [3 + i] * 40, 2) for i in range(6)]
    capacity = 4 * MiB
    run = multitenant_replay.replay("unbounded", models, trace, capacity, 512)
    spec = multitenant_replay.kv_spec_for(models[0], multitenant_replay.BLOCK)
    whole = multitenant_replay.third_bytes(capacity * 3, spec)
    assert whole == capacity  # three tenants' daemon, a third each: the whole capacity
    assert [max(mapped) for mapped in run.timeline["mapped"]] == [whole] * 3
    assert len(run.requests) == 6 and all(r.num_output_tokens == 2 for _, r in run.requests)
    assert run.preemptions == [0, 0, 0]


def test_repeats_run_the_modes_in_abba_order_and_pool_every_run(monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    pins: set[frozenset[int] | None] = set()

    def fake_replay(mode: str, models: list[Any], trace: list[Arrival], capacity: int, budget: int,
                    cores: frozenset[int] | None = None) -> Any:
        order.append(mode)
        pins.add(cores)
        run = multitenant_replay.ModeRun(mode, makespan_s=1.0, preemptions=[len(order)], computed_tokens=[0],
                                         steps=[0], peak_used_bytes=[0])
        request = multitenant_replay.Request(0, [1], 1, frozenset(), arrival_s=0.0, first_token_s=0.5)
        run.requests = [(0, request)]
        return run

    monkeypatch.setattr(multitenant, "replay", fake_replay)
    done = multitenant.run_seed([object()], [], 36 * MiB, 512, repeats=4, cores=frozenset({1}))
    assert order == ["static", "elastic", "elastic", "static", "static", "elastic", "elastic", "static"]
    assert pins == {frozenset({1})}  # every replay's driver on the bench's cores
    static = done["runs"]["static"]
    assert static.makespan_s == 4.0 and len(static.requests) == 4
    assert static.preemptions == [1 + 4 + 5 + 8]  # the static runs' own counts, summed
    assert [r["preemptions"] for r in done["repeat_runs"]["static"]] == [1, 4, 5, 8]  # each repeat kept
    assert set(done["repeat_runs"]["elastic"][0]) == set(multitenant.REPEAT_FIGURES)


def _fake_replays(monkeypatch: pytest.MonkeyPatch, order: list[str], peak_bytes: int = 0) -> None:
    def fake_replay(mode: str, models: list[Any], trace: list[Arrival], capacity: int, budget: int,
                    cores: frozenset[int] | None = None) -> Any:
        order.append(mode)
        run = multitenant_replay.ModeRun(mode, makespan_s=1.0, preemptions=[0], computed_tokens=[0],
                                         steps=[0], peak_used_bytes=[peak_bytes])
        run.requests = [(0, multitenant_replay.Request(0, [1], 1, frozenset(), arrival_s=0.0, first_token_s=0.5))]
        return run

    monkeypatch.setattr(multitenant, "replay", fake_replay)


@pytest.mark.parametrize(("peak_bytes", "num_runs"), [(0, 8), (12 * MiB, 4)])
def test_an_uncontended_seed_gets_its_extra_repeats_in_abba_order(
    monkeypatch: pytest.MonkeyPatch, peak_bytes: int, num_runs: int
) -> None:
    order: list[str] = []
    _fake_replays(monkeypatch, order, peak_bytes)
    third, page = 12 * MiB, 256 * 1024

    def more(results: dict[str, Any]) -> int:
        return multitenant.extra_repeats(results, third, page, repeats=2, quiet_repeats=4)

    done = multitenant.run_seed([object()], [], 36 * MiB, 512, repeats=2, more=more)
    assert order == ["static", "elastic", "elastic", "static", "static", "elastic", "elastic", "static"][:num_runs]
    assert len(done["runs"]["elastic"].requests) == num_runs // 2  # every run pooled
    assert len(done["repeat_p99"]["static"]) == num_runs // 2


def test_extra_repeats_never_go_below_the_repeats_asked() -> None:
    quiet = {"static": {"tenants": [{"peak_used_bytes": 0, "preemptions": 0}]}}
    assert multitenant.extra_repeats(quiet, MiB, 1024, repeats=6, quiet_repeats=4) == 0
    assert multitenant.extra_repeats(quiet, MiB, 1024, repeats=1, quiet_repeats=4) == 3
    preempted = {"static": {"tenants": [{"peak_used_bytes": 0, "preemptions": 1}]}}
    assert multitenant.extra_repeats(preempted, MiB, 1024, repeats=1, quiet_repeats=4) == 0


def test_seed_lists_name_ranges_and_single_seeds() -> None:
    assert multitenant.seed_list("0-3") == [0, 1, 2, 3]
    assert multitenant.seed_list("0,3, 5") == [0, 3, 5]
    assert multitenant.seed_list("") == []
    opts = multitenant.options([])
    assert (opts.seeds, opts.light_seeds, opts.overload_seeds) == (list(range(8)), [0, 1, 2, 3], [0, 1])


def test_the_forward_leaves_a_core_to_the_control_plane_unless_told() -> None:
    assert multitenant.options([]).torch_threads is None
    assert multitenant.options(["--torch-threads", "3"]).torch_threads == 3
    assert [multitenant.num_forward_threads(None, cores) for cores in (1, 2, 16)] == [1, 1, 15]
    assert multitenant.num_forward_threads(2, 2) == 2


@pytest.mark.parametrize(("argv", "complaint"), [
    (["--seeds", "abc"], "argument --seeds: 'abc' is not a seed list"),
    (["--light-seeds", "3-1"], "argument --light-seeds: '3-1' is not a seed list"),
    (["--overload-seeds", "-1"], "argument --overload-seeds: '-1' is not a seed list"),
    (["--repeats", "0"], "argument --repeats: '0' is not a whole number above 0"),
    (["--repeats", "1.5"], "argument --repeats: '1.5' is not a whole number above 0"),
    (["--uncontended-repeats", "0"], "argument --uncontended-repeats: '0' is not a whole number above 0"),
    (["--seeds", "1-"], "argument --seeds: '1-' is not a seed list"),
    (["--seeds", "0-99999999999"], "argument --seeds: '0-99999999999' is not a seed list: give seeds below 1000"),
    (["--scale", "nan"], "argument --scale: 'nan' is not a number above 0"),
    (["--rate-scale", "inf"], "argument --rate-scale: 'inf' is not a number above 0"),
    (["--capacity-mib", "lots"], "argument --capacity-mib: 'lots' is not a whole number above 0"),
    (["--torch-threads", "0"], "argument --torch-threads: '0' is not a whole number above 0"),
])
def test_a_bad_option_is_a_usage_error_before_any_work(
    argv: list[str], complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        multitenant.options(argv)
    assert exit_info.value.code == 2
    assert complaint in capsys.readouterr().err


def test_a_seed_is_unreachable_only_when_the_pooled_runs_and_every_repeat_say_so() -> None:
    results = {"static": summary(0.04, 0.15), "elastic": summary(0.03, 0.10), "unbounded": summary(0.02, 0.10)}
    agreeing = {"static": [0.14, 0.16], "elastic": [0.1, 0.1], "unbounded": [0.1, 0.1]}
    r = multitenant.ratios(results, agreeing)
    assert r["static_floor_p99_max"] == pytest.approx(1.6)
    assert not multitenant.reachable(r)
    one_repeat_disagrees = {"static": [0.14, 0.16], "elastic": [0.1, 0.1], "unbounded": [0.1, 0.07]}
    r = multitenant.ratios(results, one_repeat_disagrees)
    assert r["static_floor_p99_max"] == pytest.approx(0.16 / 0.07)
    assert multitenant.reachable(r)


def row_results() -> dict[str, Any]:
    return {"static": summary(0.04, 0.12, 100), "elastic": summary(0.03, 0.08, 90),
            "unbounded": summary(0.02, 0.07)}


def test_a_seed_line_shows_the_floor_and_calls_only_a_p99_miss_unreachable(
    capsys: pytest.CaptureFixture[str],
) -> None:
    results = row_results()
    r = multitenant.ratios(results, {"static": [0.12], "elastic": [0.08], "unbounded": [0.07]})
    multitenant.print_seed("contended", "3", results, r)
    line = capsys.readouterr().out
    assert "   0.070   1.14x" in line  # the floor's p99 and elastic over it
    assert "MISS throughput,ttft_p99 (unreachable: static p99 at most 1.71x the floor)" in line
    r["ttft_p99"] = 0.4  # the p99 target met: only throughput missed, nothing to call unreachable
    multitenant.print_seed("contended", "3", results, r)
    line = capsys.readouterr().out
    assert line.rstrip().endswith("MISS throughput")


def test_a_tenant_without_requests_is_reported_as_not_measured() -> None:
    run = multitenant_replay.ModeRun("static", makespan_s=2.0, preemptions=[0, 0], computed_tokens=[0, 0],
                                     steps=[0, 0], peak_used_bytes=[0, 0])
    request = multitenant_replay.Request(0, [1], 1, frozenset(), arrival_s=0.0, first_token_s=0.25)
    request.token_ids.append(7)
    run.requests = [(0, request)]
    summary_ = multitenant_replay.summarize(run, 2)
    assert summary_["tenants"][0]["ttft_p99_s"] == 0.25
    idle = summary_["tenants"][1]
    assert idle["requests"] == 0 and math.isnan(idle["ttft_mean_s"]) and math.isnan(idle["ttft_p99_s"])


def test_overload_throughput_is_paired_by_repeat_and_printed_with_its_interval(
    capsys: pytest.CaptureFixture[str],
) -> None:
    paired = multitenant.paired_throughput({"static": [100.0, 200.0, 100.0], "elastic": [101.0, 204.0, 103.0]})
    assert paired["num_pairs"] == 3
    assert paired["throughput_paired"] == pytest.approx((1.01 * 1.02 * 1.03) ** (1 / 3))
    assert paired["throughput_paired_low"] < 1.01 and paired["throughput_paired_high"] > 1.03
    results = {"static": summary(2.0, 7.0, 1500, 140), "elastic": summary(2.2, 6.9, 1530, 90)}
    multitenant.print_seed("overload", "0", results, {**multitenant.ratios(results), **paired})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].rstrip().endswith("1.020x  PASS")
    assert "throughput paired by repeat: 1.020x over 3 pairs, 95% interval" in lines[1]


def test_the_overload_worst_line_gives_the_worst_seeds_paired_interval(capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"class": "overload", "ratios": {"throughput": t, "preemptions": -1, "ttft_p99": 1.0, "ttft_mean": 1.0,
                                            "throughput_paired": t, "throughput_paired_low": t - 0.02,
                                            "throughput_paired_high": t + 0.02}}
            for t in (1.01, 0.98)]
    worst = multitenant.print_worst(rows)
    out = capsys.readouterr().out
    assert worst["overload"]["throughput"] == 0.98
    assert "throughput 0.980x (>= 1.0x MISS), its repeats paired 0.980x, 95% interval 0.960-1.000x" in out
    del rows[1]["ratios"]["throughput_paired_low"]  # a row without pairs: no interval printed
    multitenant.print_worst(rows)
    assert "interval" not in capsys.readouterr().out.splitlines()[-1]


def repeat_figures(makespan_s: float, driver_cpu_s: float, steps: int) -> dict[str, Any]:
    return {"makespan_s": makespan_s, "driver_cpu_s": driver_cpu_s, "steal_s": 0.0, "steps": steps,
            "computed_tokens": 10 * steps, "preemptions": 1}


def test_the_extreme_pairs_are_the_lowest_and_highest_paired_ratio_with_both_runs_figures() -> None:
    runs = {"static": [repeat_figures(10.0, 9.5, 100), repeat_figures(10.0, 9.6, 101), repeat_figures(9.0, 8.9, 99)],
            "elastic": [repeat_figures(10.0, 9.4, 100), repeat_figures(12.5, 9.7, 102), repeat_figures(8.0, 7.9, 98)]}
    lowest, highest = multitenant.extreme_pairs(runs)
    assert lowest.startswith("lowest pair 1: 0.800x; static/elastic makespan 10.00/12.50 s, driver CPU 9.60/9.70 s")
    assert "steps 101/102, computed tokens 1010/1020" in lowest
    assert highest.startswith("highest pair 2: 1.125x; static/elastic makespan 9.00/8.00 s")


def test_a_replay_records_its_drivers_cpu_time_and_the_pooled_run_sums_them() -> None:
    from engine import build_model

    models = [build_model(seed) for seed in range(3)]
    trace = [Arrival(0.01 * i, i % 3, [3 + i] * 40, 4) for i in range(6)]
    runs = [multitenant_replay.replay("static", models, trace, 4 * MiB, 512) for _ in range(2)]
    for run in runs:
        assert 0.0 < run.driver_cpu_s <= run.makespan_s + 0.05  # the driver's thread only, while it served
        assert run.steal_s >= 0.0
    pooled = multitenant_replay.pooled(runs)
    assert pooled.driver_cpu_s == pytest.approx(sum(run.driver_cpu_s for run in runs))
    overall = multitenant_replay.summarize(pooled, 3)["overall"]
    assert overall["driver_cpu_s"] == pooled.driver_cpu_s and overall["steal_s"] == pooled.steal_s


def test_the_hosts_steal_is_read_from_proc_stat_and_never_goes_back() -> None:
    first = multitenant_replay.host_steal_s()
    assert first >= 0.0 and multitenant_replay.host_steal_s() >= first
