"""Engine: continuous batching over daemon KV gives transformers' own greedy outputs."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvdaemon.client import KVClient, KVPool, PoolExhausted  # noqa: E402
from kvdaemon.client.local_pool import LocalPool  # noqa: E402
from kvdaemon.errors import BadRequest, Conflict, DaemonUnreachable  # noqa: E402
from kvdaemon.integrations import hf_attention, stall_watch  # noqa: E402
from kvdaemon.integrations.hf import Engine, kv_spec_for  # noqa: E402

from tests.conftest import RunningDaemon, short_dir, start_daemon, wait_until  # noqa: E402
from .conftest import PAGE_BYTES  # noqa: E402
from .models import VOCAB, random_prompts, reference_outputs, tiny_model  # noqa: E402

BLOCK = 4  # a logical page of the tiny model (4 segments of 64 KiB) holds 128 blocks of 4 tokens
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NEW = 12
MIXED = [3, 9, 17, 30, 41, 6]


_names = itertools.count()


def daemon_pool(client: KVClient, model: Any, **kwargs: Any) -> KVPool:
    return client.register(f"engine-{next(_names)}", kv_spec_for(model, BLOCK), **kwargs)


def run(model: Any, pool: Any, prompts: list[list[int]], new: int = NEW, **engine_args: Any) -> tuple[Any, Engine]:
    engine = Engine(model, pool, **engine_args)
    try:
        return engine.generate(prompts, new), engine
    finally:
        engine.close()


def test_mixed_lengths_equal_generate_on_daemon_kv(client: KVClient, model: Any) -> None:
    prompts = random_prompts(MIXED)
    pool = daemon_pool(client, model)
    outputs, engine = run(model, pool, prompts)
    assert outputs == reference_outputs(model, prompts, NEW)
    assert engine.num_preemptions == 0
    assert pool.num_used_blocks == 0  # close gave every block back, cached ones too
    assert model.config._attn_implementation == "sdpa"  # close restored the model
    pool.close()


def test_small_chunks_equal_generate(client: KVClient, model: Any) -> None:
    prompts = random_prompts([29, 7, 40])
    pool = daemon_pool(client, model)
    outputs, engine = run(model, pool, prompts, max_num_batched_tokens=5)
    assert outputs == reference_outputs(model, prompts, NEW)
    # 76 prompt tokens in chunks of at most 5 new tokens per step, then the decodes.
    assert engine.num_steps >= 76 // 5
    pool.close()


def test_shared_prefixes_are_computed_once(client: KVClient, model: Any) -> None:
    shared = random_prompts([24], seed=7)[0]
    prompts = random_prompts([5, 11, 2], seed=8, prefix=shared)
    pool = daemon_pool(client, model)
    engine = Engine(model, pool)
    first = engine.add_request(prompts[0], NEW)
    while not first.finished:
        engine.step()
    computed_before = engine.num_computed_tokens
    outputs = engine.generate(prompts[1:], NEW)
    # The 24 shared tokens (6 full blocks) come from the cache for the later prompts.
    new_prompt_tokens = sum(len(p) for p in prompts[1:]) - 2 * 24
    assert engine.num_computed_tokens - computed_before == new_prompt_tokens + 2 * (NEW - 1)
    assert [first.output_ids, *outputs] == reference_outputs(model, prompts, NEW)
    engine.close()
    pool.close()


class ScarcePool(LocalPool):
    """A local pool that, while ``scarce``, says only two blocks are free without asking its
    provider for more (as a ``KVPool`` does while the daemon has nothing to spare)."""

    scarce = False

    def scarce_free_blocks(self) -> int | None:
        return min(2, self.num_free_blocks) if self.scarce else None


@pytest.mark.parametrize("scarce", [False, True])
def test_a_scarce_pool_makes_the_engine_reuse_its_own_cache_first(model: Any, scarce: bool) -> None:
    pool = ScarcePool(kv_spec_for(model, BLOCK), num_blocks=64)
    engine = Engine(model, pool)
    prompts = random_prompts([40, 40], seed=3)
    engine.generate(prompts[:1], NEW)
    cached = engine.manager.num_cached_tokens(prompts[0])
    assert cached >= 36  # the first prompt's full blocks are cached
    pool.scarce = scarce
    outputs = engine.generate(prompts[1:], NEW)  # 10 blocks for the prompt, none shared
    assert outputs == reference_outputs(model, prompts[1:], NEW)
    if scarce:  # the blocks past the two free ones came from the first prompt's cached blocks
        assert engine.manager.num_cached_tokens(prompts[0]) < cached
    else:  # blocks free in the pool: the cache is kept
        assert engine.manager.num_cached_tokens(prompts[0]) == cached
    engine.close()


def test_a_tiny_local_pool_preempts_and_still_matches(model: Any) -> None:
    prompts = random_prompts([30, 25, 33, 28, 20])
    pool = LocalPool(kv_spec_for(model, BLOCK), num_blocks=24)  # one request's worst case is 12
    outputs, engine = run(model, pool, prompts)
    assert engine.num_preemptions > 0
    assert outputs == reference_outputs(model, prompts, NEW)
    assert pool.num_used_blocks == 0


def test_a_capped_daemon_pool_preempts_and_still_matches(client: KVClient, model: Any) -> None:
    prompts = random_prompts([200] * 8, seed=3)  # 8 x 13 blocks fit with headroom; 8 x 17 at the end do not
    logical_page = kv_spec_for(model, BLOCK).num_segments * PAGE_BYTES  # 128 blocks = 512 tokens
    pool = daemon_pool(client, model, max_bytes=logical_page, num_prefetch_pages=0)
    outputs, engine = run(model, pool, prompts, new=60)
    assert engine.num_preemptions > 0
    assert outputs == reference_outputs(model, prompts, 60)
    pool.close()


def test_requests_join_and_leave_between_steps(model: Any) -> None:
    prompts = random_prompts([8, 8, 8])
    engine = Engine(model, LocalPool(kv_spec_for(model, BLOCK), num_blocks=64))
    short = engine.add_request(prompts[0], 2)
    long = engine.add_request(prompts[1], 8)
    finished: list[Any] = []
    while not short.finished:
        finished += engine.step()
    late = engine.add_request(prompts[2], 3)  # joins while `long` is decoding
    while engine.has_unfinished:
        batch_before = len(engine.scheduler.running)
        finished += engine.step()
        assert batch_before <= 2
    assert [r.request_id for r in finished] == [short.request_id, late.request_id, long.request_id]
    assert late.first_token_s < long.finish_s  # it did not wait for the batch to drain
    for request in finished:
        assert request.arrival_s <= request.first_token_s <= request.finish_s
        assert request.ttft_s is not None and request.latency_s is not None
    assert [r.output_ids for r in (short, long, late)] == [
        reference_outputs(model, [p], n)[0] for p, n in zip(prompts, (2, 8, 3))
    ]
    engine.close()


def test_stop_tokens_finish_a_request(model: Any) -> None:
    prompt = random_prompts([10])[0]
    expected = reference_outputs(model, [prompt], NEW)[0]
    engine = Engine(model, LocalPool(kv_spec_for(model, BLOCK), num_blocks=32))
    request = engine.add_request(prompt, NEW, stop_token_ids=[expected[3]])
    while not request.finished:
        engine.step()
    cut = expected.index(expected[3]) + 1
    assert request.output_ids == expected[:cut] and request.finish_reason == "stop"
    engine.close()


def test_stop_token_ids_must_be_a_collection_of_ids(model: Any) -> None:
    pool = LocalPool(kv_spec_for(model, BLOCK), num_blocks=32)
    for bad, match in ((2, "for one id, pass [id]"), ("ab", "for one id, pass [id]"),
                       (torch.tensor(2), "for one id, pass [id]"), (["a"], "got 'a'"), ([True], "got True"),
                       ([-1], "got -1"), ([2.0], "got 2.0")):  # fmt: skip
        with pytest.raises(BadRequest, match=re.escape(match)):
            Engine(model, pool, stop_token_ids=bad)
        assert pool.quiesce_hook is None and pool.reclaim_hook is None, "a refused engine kept the pool"
    engine = Engine(model, pool, stop_token_ids=np.array([7, 9]))
    assert engine.stop_token_ids == {7, 9}
    for bad in (2, ["a"], [None]):
        with pytest.raises(BadRequest, match="stop_token_ids must"):
            engine.add_request([1, 2], 4, stop_token_ids=bad)
    assert not engine.has_unfinished
    assert engine.add_request([1, 2], 4, stop_token_ids=torch.tensor([5])).stop_token_ids == {5}
    engine.close()


def test_abort_takes_only_this_engines_requests(model: Any) -> None:
    prompts = random_prompts([9, 14], seed=3)
    first = Engine(model, LocalPool(kv_spec_for(model, BLOCK), num_blocks=64))
    second = Engine(model, LocalPool(kv_spec_for(model, BLOCK), num_blocks=64))
    mine, theirs = first.add_request(prompts[0], 5), second.add_request(prompts[1], 5)
    first.step()
    second.step()
    for bad, match in ((None, "got NoneType"), (theirs.request_id, "got int"), (theirs, "another engine's")):
        with pytest.raises(BadRequest, match=match):
            first.abort(bad)  # type: ignore[arg-type]
    assert not theirs.finished and second.has_unfinished, "the other engine's request was touched"
    first.abort(mine)
    first.abort(mine)  # finished: a no-op
    assert mine.finish_reason == "abort" and not first.has_unfinished and first.manager.num_held_blocks == 0
    while second.has_unfinished:
        second.step()
    assert theirs.output_ids == reference_outputs(model, [prompts[1]], 5)[0]
    first.abort(theirs)  # finished elsewhere: nothing to drop
    assert theirs.finish_reason == "length"
    first.close()
    second.close()


def test_a_request_that_can_never_fit_stalls_then_fails_cleanly(client: KVClient, model: Any) -> None:
    logical_page = kv_spec_for(model, BLOCK).num_segments * PAGE_BYTES
    pool = daemon_pool(client, model, max_bytes=logical_page, num_prefetch_pages=0)
    engine = Engine(model, pool, max_model_len=1024)  # past the model's 512 positions: RoPE runs on
    with pytest.raises(PoolExhausted) as info:
        engine.generate([random_prompts([600])[0]], 4, stall_timeout_s=0.3)
    assert re.match(r"generate gave up: nothing computed for \d+ s: 1 request\(s\) waiting, 0 running; "
                    r"the first waiting needs 150 block\(s\)", info.value.message)  # 0 s, or 1 under load
    assert info.value.message.endswith(  # the limit is named as the cause, with the fix
        f"limit 256.0 KiB; the limit holds at most 128 block(s), so it waits until the limit is raised "
        f"(kvdaemon limit {pool.name} --max SIZE)"
    )
    assert not engine.has_unfinished and engine.manager.num_held_blocks == 0  # cached blocks may stay
    assert engine.generate(random_prompts([10]), 3) == reference_outputs(model, random_prompts([10]), 3)
    engine.close()
    pool.close()


def test_a_stall_is_logged_with_its_cause_and_counted_by_the_daemon(
    client: KVClient, model: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    logical_page = kv_spec_for(model, BLOCK).num_segments * PAGE_BYTES
    pool = daemon_pool(client, model, max_bytes=logical_page, num_prefetch_pages=0)
    engine = Engine(model, pool, max_model_len=1024)
    monkeypatch.setattr(stall_watch, "WARN_S", 0.05)
    request = engine.add_request(random_prompts([600])[0], 4)
    with caplog.at_level("WARNING", logger="kvdaemon.engine"):
        wait_until(lambda: engine.step() == [] and "the limit holds at most 128 block(s)" in caplog.text, 5,
                   "the stall was not logged")  # fmt: skip
        row = lambda: next(t for t in client.status()["tenants"] if t["name"] == pool.name)  # noqa: E731
        wait_until(lambda: row()["refused_grows"] > 0, 5, "the pool's own refusals never reached the daemon")
        engine.abort(request)
        engine.generate(random_prompts([10]), 3)  # steps compute again: said once
    assert caplog.text.count("steps compute again after") == 1
    engine.close()
    pool.close()


def test_bad_requests_are_refused_and_change_nothing(model: Any) -> None:
    engine = Engine(model, LocalPool(kv_spec_for(model, BLOCK), num_blocks=8))
    for prompt, new, match in (
        ([], 4, "empty"), ([1, VOCAB], 4, "not an id"), ([1, -1], 4, "not an id"), (["a"], 4, "not an id"),
        ([1, 2], 0, "max_new_tokens"), ([1, 2], True, "max_new_tokens"), ([1] * 30, 4, "virtual capacity"),
        (torch.ones(2, 2, dtype=torch.long), 4, "1-D"), (np.ones((2, 2), dtype=np.int64), 4, "1-D"),
        ("hello", 4, "not text"), (7, 4, "a sequence of token ids"), ([1, 2.0], 4, "2.0 at position 1"),
        ([True, 1], 4, "True at position 0"), ([1, 2], np.float64(2.0), "max_new_tokens"),
    ):
        with pytest.raises(BadRequest, match=re.escape(match)):
            engine.add_request(prompt, new)
    assert not engine.has_unfinished
    with pytest.raises(BadRequest, match=re.escape("for one prompt, pass [prompt_ids]")):
        engine.generate([1, 2, 3], 2)  # a flat prompt
    assert not engine.has_unfinished
    with pytest.raises(BadRequest, match="not an id"):
        engine.generate([[1, 2], [3, VOCAB + 5]], 2)
    assert not engine.has_unfinished  # the good prompt before the bad one was not left queued
    engine.close()
    with pytest.raises(BadRequest, match="closed"):
        engine.add_request([1, 2], 2)


def test_integer_types_of_numpy_and_torch_are_token_ids(model: Any) -> None:
    engine = Engine(model, LocalPool(kv_spec_for(model, BLOCK), num_blocks=32))
    prompt = random_prompts([9])[0]
    expected = engine.generate([prompt], 3)
    assert engine.generate([np.array(prompt, dtype=np.int64)], np.int64(3)) == expected  # return_tensors="np"
    assert engine.generate([torch.tensor(prompt)], 3) == expected
    assert engine.generate([[np.int32(t) for t in prompt]], 3) == expected
    engine.close()


def test_a_pool_that_does_not_fit_the_model_is_refused(model: Any) -> None:
    spec = kv_spec_for(model, BLOCK)
    for wrong in (
        LocalPool(type(spec)(spec.num_layers + 1, spec.num_kv_heads, spec.head_dim, BLOCK, "float32"), 4),
        LocalPool(type(spec)(spec.num_layers, spec.num_kv_heads, spec.head_dim, BLOCK, "float16"), 4),
    ):
        with pytest.raises(BadRequest, match="does not fit"):
            Engine(model, wrong)
    assert model.config._attn_implementation == "sdpa"


def test_a_pool_another_engine_runs_over_is_refused(client: KVClient, model: Any) -> None:
    """A second engine once took the first one's sleep hooks: a sleep then unmapped pages under
    the first engine's step (a segfault)."""
    pool = daemon_pool(client, model)
    try:
        first = Engine(model, pool)
        with pytest.raises(Conflict, match="already has an engine"):
            Engine(model, pool)
        assert pool.quiesce_hook == first._quiesce  # the first keeps its hooks
        assert first.generate([[1, 2, 3]], 2)
        first.close()
        second = Engine(model, pool)  # once the first is closed, another may run over the pool
        assert second.generate([[1, 2, 3]], 2)
        second.close()
    finally:
        pool.close()


def test_a_pool_claimed_by_an_engine_being_built_is_refused_to_another(
    client: KVClient, model: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two engines built at once from two threads both passed the check, then both set hooks."""
    from kvdaemon.integrations import hf_probe

    pool = daemon_pool(client, model)
    probing, go_on = threading.Event(), threading.Event()
    real_probe = hf_probe.probe_layout

    def slow_probe(probed: Any) -> Any:
        probing.set()
        assert go_on.wait(10)
        return real_probe(probed)

    built: list[Engine] = []
    with monkeypatch.context() as patched:
        patched.setattr(hf_probe, "probe_layout", slow_probe)
        first = threading.Thread(target=lambda: built.append(Engine(model, pool)))
        first.start()
        assert probing.wait(10)
    try:
        with pytest.raises(Conflict, match="already has an engine"):
            Engine(model, pool)  # the first is still probing: its claim holds
    finally:
        go_on.set()
        first.join(30)
    assert len(built) == 1 and pool.quiesce_hook == built[0]._quiesce
    built[0].close()
    with pytest.raises(BadRequest):
        Engine(model, pool, max_model_len=-1)  # a failed build gives its claim back
    assert pool.quiesce_hook is None and pool.reclaim_hook is None
    Engine(model, pool).close()
    pool.close()


def test_max_model_len_defaults_to_the_model_positions(model: Any) -> None:
    engine = Engine(model, LocalPool(kv_spec_for(model, BLOCK), num_blocks=256))  # 1024 tokens of pool
    assert engine.max_model_len == model.config.max_position_embeddings == 512
    with pytest.raises(BadRequest, match="exceed max_model_len 512"):
        engine.add_request([1] * 510, 3)
    assert not engine.has_unfinished
    engine.close()
    short = Engine(model, LocalPool(kv_spec_for(model, BLOCK), num_blocks=256), max_model_len=16)
    assert short.generate(random_prompts([8]), 8) == reference_outputs(model, random_prompts([8]), 8)
    with pytest.raises(BadRequest, match="exceed max_model_len 16"):
        short.add_request([1] * 9, 8)
    short.close()


def test_a_max_model_len_past_the_model_positions_is_taken_as_asked(model: Any) -> None:
    """By design (RoPE runs on; rope scaling): the caller's length; the pool still bounds requests."""
    engine = Engine(model, LocalPool(kv_spec_for(model, BLOCK), num_blocks=8), max_model_len=10**9)
    assert engine.max_model_len == 10**9 > model.config.max_position_embeddings
    with pytest.raises(BadRequest, match="32 tokens of virtual capacity"):
        engine.add_request([1] * 30, 4)
    engine.close()


def test_kv_spec_for_needs_a_transformers_model(model: Any) -> None:
    pool = LocalPool(kv_spec_for(model, BLOCK), num_blocks=8)
    for bad, got in (("llama", "got str"), (None, "got NoneType"), (model.config, "got LlamaConfig|got Qwen2Config")):
        with pytest.raises(BadRequest, match=f"a transformers model .* is needed, ({got})"):
            kv_spec_for(bad)
        with pytest.raises(BadRequest, match="a transformers model"):
            Engine(bad, pool)
    with pytest.raises(BadRequest, match=r"from_config\(config\)"):
        kv_spec_for(model.config)
    with pytest.raises(BadRequest, match="is needed, got Linear$"):
        kv_spec_for(torch.nn.Linear(2, 2))  # a module, but no transformers model
    assert pool.quiesce_hook is None


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "64"])
def test_a_bad_max_model_len_is_refused(model: Any, bad: Any) -> None:
    with pytest.raises(BadRequest, match="max_model_len"):
        Engine(model, LocalPool(kv_spec_for(model, BLOCK), num_blocks=8), max_model_len=bad)


def test_what_cannot_run_is_refused_at_construction(model: Any) -> None:
    pool = LocalPool(kv_spec_for(model, BLOCK), num_blocks=8)
    with pytest.raises(BadRequest, match="impl='triton' needs CUDA"):
        Engine(model, pool, attention_impl="triton")  # CPU tensors
    with pytest.raises(BadRequest, match="impl must be"):
        Engine(model, pool, attention_impl="fast")  # type: ignore[arg-type]
    with pytest.raises(BadRequest, match="not a pool the engine can run over"):
        Engine(model, object())  # type: ignore[arg-type]
    model.train()
    try:
        with pytest.raises(BadRequest, match="training mode"):
            Engine(model, pool)
    finally:
        model.eval()
    assert pool.num_used_blocks == 0 and model.config._attn_implementation == "sdpa"


def test_the_paged_attention_outside_the_engine_is_refused(model: Any) -> None:
    Engine(model, LocalPool(kv_spec_for(model, BLOCK), num_blocks=8)).close()  # registered it
    previous, model.config._attn_implementation = model.config._attn_implementation, hf_attention.ATTENTION_NAME
    try:
        with pytest.raises(BadRequest, match="runs only inside kvdaemon's paged_forward"):
            model(input_ids=torch.tensor([[3, 4, 5]]), use_cache=False)
    finally:
        model.config._attn_implementation = previous


@pytest.mark.parametrize("mode", ["warm", "cold", "warm-then-cold"])
def test_sleep_mid_generation_loses_nothing(client: KVClient, model: Any, mode: str) -> None:
    prompts = random_prompts([20, 9, 31], seed=5)
    pool = daemon_pool(client, model)
    engine = Engine(model, pool)
    requests = [engine.add_request(p, NEW) for p in prompts]
    for _ in range(4):
        engine.step()  # prefills done, a few tokens decoded
    assert all(r.num_output_tokens > 0 for r in requests)
    for each in mode.split("-then-"):  # quiesces between steps; a warm sleeper is then made cold
        client.sleep(pool.name, mode=each)
    assert pool.sleep_mode == mode.split("-then-")[0] and pool.mapped_bytes == 0
    while engine.has_unfinished:
        engine.step()  # the first step wakes the pool (warm made cold: it finds the blocks gone)
    assert [r.output_ids for r in requests] == reference_outputs(model, prompts, NEW)
    assert (engine.num_preemptions > 0) == mode.endswith("cold")  # cold: recomputed from the prompts
    engine.close()
    pool.close()


def test_an_engine_closes_after_a_wake_that_found_its_blocks_gone(client: KVClient, model: Any) -> None:
    pool = daemon_pool(client, model)
    engine = Engine(model, pool)
    run_prompts = random_prompts([33, 17], seed=6)
    assert engine.generate(run_prompts, NEW) == reference_outputs(model, run_prompts, NEW)  # blocks cached
    client.sleep(pool.name, mode="warm")
    client.sleep(pool.name, mode="cold")
    client.wake(pool.name)  # by the operator: no step of the engine between
    assert wait_until(lambda: pool.sleep_mode is None, 10) and pool.num_block_losses == 1
    engine.close()  # nothing of the lost blocks is freed (they were dropped with the pages)
    assert pool.num_used_blocks == 0
    pool.close()


def test_a_sleep_waits_for_the_running_step(client: KVClient, model: Any) -> None:
    pool = daemon_pool(client, model)
    engine = Engine(model, pool)
    requests = [engine.add_request(p, 40) for p in random_prompts([30, 30])]
    asleep = threading.Event()

    def sleep_soon() -> None:
        client.sleep(pool.name)
        asleep.set()

    sleeper = threading.Thread(target=sleep_soon)
    steps = 0
    while not asleep.is_set() and engine.has_unfinished:
        engine.step()
        steps += 1
        if steps == 2:
            sleeper.start()
    sleeper.join(10)
    assert asleep.is_set()
    while engine.has_unfinished:
        engine.step()
    assert [r.output_ids for r in requests] == reference_outputs(model, [r.prompt_ids for r in requests], 40)
    engine.close()
    pool.close()


class EngineProcess:
    """``tests.integrations.engine_worker`` in a subprocess, spoken to in JSON lines."""

    def __init__(self, kvd: RunningDaemon, name: str, arch: str, seed: int) -> None:
        argv = [sys.executable, "-m", "tests.integrations.engine_worker", str(kvd.dir), name,
                "--arch", arch, "--seed", str(seed)]
        self.name = name
        self.proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert self.read()["event"] == "ready"

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"engine {self.name} exited with {self.proc.wait(5)}"
        return json.loads(line)

    def send(self, **command: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.send(cmd="close")
            assert self.read()["event"] == "closed"
        assert self.proc.wait(10) == 0


def test_two_engine_processes_share_a_daemon_across_sleep_and_wake(kvd: RunningDaemon, client: KVClient) -> None:
    models = {"a": tiny_model("llama", seed=1), "b": tiny_model("qwen2", seed=2)}
    engines = {"a": EngineProcess(kvd, "proc-a", "llama", 1), "b": EngineProcess(kvd, "proc-b", "qwen2", 2)}
    try:
        for round_no in range(3):
            prompts = random_prompts([13, 27, 6], seed=10 + round_no)
            for engine in engines.values():
                engine.send(cmd="generate", prompts=prompts, new=NEW)
            for key, engine in engines.items():
                event = engine.read()
                assert event["outputs"] == reference_outputs(models[key], prompts, NEW), (key, round_no)
            client.sleep("proc-a", mode="warm" if round_no % 2 == 0 else "cold")
            rows = {t["name"]: t for t in client.status()["tenants"]}
            assert rows["proc-a"]["state"].startswith("sleeping") and rows["proc-a"]["mapped_bytes"] == 0
            assert rows["proc-b"]["state"] == "active"
            # the next generate wakes proc-a (its engine finds the pool asleep)
    finally:
        for engine in engines.values():
            engine.close()
    kvd.check_invariants()
    assert {t["name"] for t in client.status()["tenants"]}.isdisjoint({"proc-a", "proc-b"})


def test_an_engine_serves_through_a_daemon_restart(model: Any) -> None:
    root = short_dir()
    first = start_daemon(root)
    client = KVClient(root)
    second = None
    try:
        pool = client.register("restart", kv_spec_for(model, BLOCK), num_prefetch_pages=0)
        engine = Engine(model, pool)
        prompts = random_prompts([40, 70, 15], seed=9)
        requests = [engine.add_request(p, 300) for p in prompts]  # they will need more pages
        for _ in range(3):
            engine.step()
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
        wait_until(lambda: pool.lease.lost.is_set(), 5, "lease not lost")
        outputs_before = sum(r.num_output_tokens for r in requests)
        for _ in range(5):
            engine.step()  # what is mapped still serves; no new page can come
        assert sum(r.num_output_tokens for r in requests) > outputs_before
        second = start_daemon(root)
        while engine.has_unfinished:
            engine.step()
        assert [r.output_ids for r in requests] == reference_outputs(model, prompts, 300)
        assert not pool.lease.lost.is_set()  # it moved to the new daemon
        engine.close()
        pool.close()
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
        client.close()
        shutil.rmtree(root, ignore_errors=True)


def test_an_engine_asleep_through_a_daemon_restart_recomputes_and_finishes(model: Any) -> None:
    root = short_dir()
    daemons = [start_daemon(root)]
    client = KVClient(root)
    try:
        pool = client.register("asleep", kv_spec_for(model, BLOCK), num_prefetch_pages=0)
        engine = Engine(model, pool)
        prompts = random_prompts([25, 11], seed=12)
        requests = [engine.add_request(p, NEW) for p in prompts]
        for _ in range(3):
            engine.step()
        client.sleep(pool.name, mode="warm")  # its warm copy lives in the daemon about to die
        asked, relink, wake = threading.Event(), pool.agent.relink, pool.lease.wake

        def held_relink() -> Any:  # the pool re-joins only once the engine's wake asked the new daemon
            if not asked.is_set():
                raise DaemonUnreachable("held back by the test")
            return relink()

        def asking_wake() -> Any:
            try:
                return wake()
            finally:
                asked.set()

        pool.agent.relink, pool.lease.wake = held_relink, asking_wake
        os.kill(daemons[0].pid, signal.SIGKILL)
        daemons[0].wait(10)
        wait_until(lambda: pool.lease.lost.is_set(), 5, "lease not lost")
        daemons.append(start_daemon(root))
        while engine.has_unfinished:
            engine.step()  # the first wakes it: the new daemon knew no such tenant; it re-joins, empty
        assert asked.is_set() and pool.num_block_losses == 1 and engine.num_preemptions == len(prompts)
        assert [r.output_ids for r in requests] == reference_outputs(model, prompts, NEW)
        engine.close()
        pool.close()
    finally:
        for proc in daemons:
            if proc.poll() is None:
                proc.kill()
        client.close()
        shutil.rmtree(root, ignore_errors=True)


def test_with_the_daemon_down_new_requests_run_in_the_evicted_cache(model: Any) -> None:
    """The daemon is gone and the pool cannot grow: what it has mapped, its cached blocks
    evicted, still serves requests that need more than its free blocks."""
    root = short_dir()
    first = start_daemon(root)
    client = KVClient(root)
    try:
        pool = client.register("down", kv_spec_for(model, BLOCK), num_prefetch_pages=0)
        engine = Engine(model, pool)
        engine.generate(random_prompts([400] * 4, seed=3), 4)  # their full blocks stay cached
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
        wait_until(lambda: pool.lease.lost.is_set(), 5, "lease not lost")
        free, cached = pool.num_free_blocks, engine.manager.num_evictable_blocks
        prompts = random_prompts([380] * (free // 96 + 1), seed=4)  # 96 + 3 blocks each
        need = len(prompts) * (380 + NEW) // BLOCK
        assert free < need <= free + cached - len(prompts), (free, cached, need)
        assert engine.generate(prompts, NEW, stall_timeout_s=10) == reference_outputs(model, prompts, NEW)
        assert pool.lease.lost.is_set()
        engine.close()
        pool.close()
    finally:
        if first.poll() is None:
            first.kill()
        client.close()
        shutil.rmtree(root, ignore_errors=True)
