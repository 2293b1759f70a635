"""``Engine``: continuous batching for a transformers causal LM whose KV lives in a pool.

``Engine(model, pool)`` serves greedy generation requests over a ``KVPool``
(daemon memory) or a ``LocalPool`` (plain tensors), any ``EnginePool``:
``add_request`` queues, ``step`` runs one iteration, ``generate`` runs prompts
to completion.

Construction probes the model (``hf_probe``): its KV layout from what its
attention computes, then a short sequence through the paged attention compared
with the model's own logits. A model that fails either is refused there, with
a ``BadRequest`` naming its family and the reason; one that passes is served
exactly. Sliding windows and logit soft-capping run on the torch attention path.

One step = the ``Scheduler``'s batch (decodes, prefill chunks, newly admitted
prompts after their prefix-cache hit) packed into one row of tokens, one
forward of the model with attention through ``hf_attention`` (each layer
writes its new K/V into the pool and attends over the blocks; nothing is
gathered), one ``argmax`` for every request whose context is now complete.

Guarantees:

- Greedy outputs equal the model's own ``generate`` (up to float ties), for any
  batching, chunk size, prefix sharing or preemption: a preempted request
  recomputes its whole context.
- A request longer than ``max_model_len`` (by default the model's
  ``max_position_embeddings``; one asked for may exceed it, see
  ``_max_model_len``; with ``attention_impl="triton"``, which has no
  sliding window, at most the model's shortest window) or than the pool's
  virtual capacity is refused by ``add_request``, never failed mid-generation.
- ``PoolExhausted`` never escapes ``step``: the scheduler preempts or waits.
  ``generate`` raises ``PoolExhausted`` only after ``stall_timeout_s`` seconds
  without a step that computed anything.
- Sleep: the pool's ``quiesce_hook`` returns once the current step is over and
  holds off the next one until the pool's ``resume_hook`` (the pool is asleep,
  or the sleep was refused); a pool moving its pages to a restarted daemon
  does the same. A step that finds the pool asleep wakes it when there is
  work. After a cold sleep every running request is recomputed.
- The pool's cached-only blocks are offered to the daemon's reclaim
  (``BlockManager.serve_reclaim_for``), and grows do not wait for other
  tenants (``grow_wait_s``, default 0): a step never stalls on the daemon.
  After each step the pool is told what the next one will take
  (``keep_free``): it maps that ahead in the background, so prefills rarely
  wait for a grow, and a reclaim never takes it. A budget's worth more is
  mapped ahead of need (for requests arriving before the next step, or the
  first of a burst on an idle engine) where memory is plentiful; a reclaim,
  or the daemon's ask at its low water, takes that floor.

The model runs with ``hf_attention.ATTENTION_NAME`` inside the engine's
forwards only: between steps it is unchanged (its own ``generate`` works). The
pool stays the caller's. One thread drives ``step``.

Cost per step: one forward over ``batch.num_tokens`` tokens; O(requests +
tokens + blocks) Python work to build the index tensors.
"""

from __future__ import annotations

import operator
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvdaemon.client.block_manager import BlockManager
from kvdaemon.client.engine_pool import EnginePool
from kvdaemon.client.spec import KVSpec
from kvdaemon.errors import Asleep, BadRequest, Conflict, DaemonUnreachable, NoMemory, OverLimit, PoolExhausted
from kvdaemon.integrations import hf_attention, hf_probe
from kvdaemon.integrations.request import Request
from kvdaemon.integrations.scheduler import Batch, Scheduler
from kvdaemon.integrations.stall_watch import StallWatch, stall_text
from kvdaemon.integrations.step_gate import StepGate

STALL_SLEEP_S = 0.002
"""How long ``generate`` sleeps after a step that could compute nothing."""


def kv_spec_for(model: Any, block_size: int = 16, dtype: Any = None) -> KVSpec:
    """The ``KVSpec`` of ``model``'s KV cache, from one probe forward of its attention.

    Layers, KV heads, head dim and dtype (unless ``dtype`` is given) are those of
    the K/V the attention layers compute (``hf_probe.probe_layout``); BadRequest,
    naming the family, when they cannot be determined, and for anything but a
    transformers model (a name or a config: build the model first).
    """
    return hf_probe.probe_layout(model).kv_spec(block_size, dtype)


class Engine:
    """A continuous-batching engine over ``pool``; see the module docstring."""

    def __init__(
        self,
        model: Any,
        pool: EnginePool,
        *,
        max_model_len: int | None = None,
        max_num_batched_tokens: int = 512,
        max_num_seqs: int = 256,
        enable_prefix_cache: bool = True,
        stop_token_ids: Iterable[int] | None = None,
        grow_wait_s: float | None = 0.0,
        attention_impl: hf_attention.Impl = "auto",
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not isinstance(pool, EnginePool):
            raise BadRequest(f"{type(pool).__name__} is not a pool the engine can run over (see EnginePool)")
        stops = None if stop_token_ids is None else _stop_ids(stop_token_ids)
        _claim(pool)  # another engine built over it now, in another thread, is refused from here on
        try:
            layout = hf_probe.probe_layout(model)
            self._check_pool(model, layout, pool)
            self.max_model_len = _max_model_len(model, max_model_len, layout, attention_impl)
            hf_probe.check_paged(model, layout, pool.spec.block_size, attention_impl, self.max_model_len)
            self.model = model
            self.pool = pool
            self.clock = clock
            self.attention_impl = attention_impl
            self.stop_token_ids = frozenset(_default_stops(model)) if stops is None else stops
            self.manager = BlockManager(pool, enable_prefix_cache=enable_prefix_cache,
                                        scarce_free_blocks=getattr(pool, "scarce_free_blocks", None))
            self.scheduler = Scheduler(self.manager, max_num_batched_tokens, max_num_seqs,
                                       owed_blocks=lambda: pool.owed_pages * pool.blocks_per_page)
            self.max_num_tokens = pool.num_blocks * pool.block_size
            self.device = pool.key_cache(0).device
            self.num_steps = 0
            self.num_generated_tokens = 0
            self.num_computed_tokens = 0  # tokens whose K/V a forward computed (prefix-cache hits excluded)
            self.last_num_scheduled_tokens = 0
            self._next_request_id = 0
            self._step_lock = StepGate()  # held by a step, and from quiesce to resume; quiesce first
            self._reserve = (0, 0, 0)  # what the pool was last told to keep free, spare and ahead
            self._num_block_losses = pool.num_block_losses
            self._caches = (
                [pool.key_cache(i) for i in range(pool.spec.num_layers)],
                [pool.value_cache(i) for i in range(pool.spec.num_layers)],
            )
            self._closed = False
            self.stall_watch = StallWatch(self._stall_facts)
            hf_attention.register()
            self.manager.serve_reclaim_for(pool)
            pool.quiesce_hook, pool.resume_hook = self._quiesce, self._resume
            pool.grow_wait_s = grow_wait_s
        except BaseException:
            _release(pool)
            raise

    @staticmethod
    def _check_pool(model: Any, layout: hf_probe.AttentionLayout, pool: EnginePool) -> None:
        want = layout.kv_spec(pool.spec.block_size)
        got = pool.spec
        if (got.num_layers, got.num_kv_heads, got.head_dim, got.dtype_name) != (
            want.num_layers, want.num_kv_heads, want.head_dim, want.dtype_name
        ):
            raise BadRequest(f"the pool's layout {got} does not fit the model's KV {want}")
        device = next(model.parameters()).device
        if pool.key_cache(0).device != device:
            raise BadRequest(f"the model is on {device}, the pool on {pool.key_cache(0).device}")

    # -- requests ----------------------------------------------------------------

    def add_request(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int = 32,
        *,
        stop_token_ids: Iterable[int] | None = None,
        arrival_s: float | None = None,
    ) -> Request:
        """Queue a request; it joins a batch at a coming step. BadRequest (nothing queued) on bad input.

        ``stop_token_ids``: a collection of token ids (not one int) that end the
        request, else the engine's. ``arrival_s`` (engine clock) backdates the
        arrival, for replaying traces.
        """
        if self._closed:
            raise BadRequest("the engine is closed")
        prompt = _token_list(prompt_ids, self.model.config.vocab_size)
        max_new_tokens = _count(max_new_tokens, "max_new_tokens")
        if len(prompt) + max_new_tokens > self.max_num_tokens:
            raise BadRequest(
                f"{len(prompt)} prompt + {max_new_tokens} new tokens exceed the pool's "
                f"{self.max_num_tokens} tokens of virtual capacity"
            )
        if self.max_model_len is not None and len(prompt) + max_new_tokens > self.max_model_len:
            raise BadRequest(
                f"{len(prompt)} prompt + {max_new_tokens} new tokens exceed max_model_len {self.max_model_len}"
            )
        stops = self.stop_token_ids if stop_token_ids is None else _stop_ids(stop_token_ids)
        request = Request(
            self._next_request_id, prompt, max_new_tokens, stops,
            self.clock() if arrival_s is None else arrival_s,
        )
        self._next_request_id += 1
        self.scheduler.add(request)
        return request

    def abort(self, request: Request) -> None:
        """Drop an unfinished request; its blocks go back (cached full blocks stay cached).

        A finished request is left as it is (aborting twice is a no-op).
        ``BadRequest`` (nothing changed) for anything but a ``Request`` of this
        engine's ``add_request``: an unfinished one it does not hold is another
        engine's. O(requests).
        """
        if not isinstance(request, Request):
            raise BadRequest(f"abort takes a Request that add_request returned, got {type(request).__name__}")
        with self._step_lock:
            if request.finished:
                return
            if request not in self.scheduler.running and request not in self.scheduler.waiting:
                raise BadRequest(f"request {request.request_id} is not one of this engine's (another engine's?)")
            self.scheduler.abort(request)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    # -- stepping ----------------------------------------------------------------

    def step(self) -> list[Request]:
        """Run one iteration; the requests that finished in it. Never raises ``PoolExhausted``.
        Steps that compute nothing while requests wait are logged after a while (``StallWatch``)."""
        finished = self._step()
        self.stall_watch.note(self.last_num_scheduled_tokens > 0, self.scheduler.has_work and not self._closed)
        return finished

    def _step(self) -> list[Request]:
        with self._step_lock:
            self.last_num_scheduled_tokens = 0
            if self._closed or not self.scheduler.has_work or not self._awake():
                self._keep_free(0)
                return []
            batch = self.scheduler.schedule()
            if not batch:
                self._keep_free(self.scheduler.blocks_needed_next())
                return []
            next_ids = self._forward(batch)
            self.pool.note_activity()  # busy, however slowly its blocks fill
            self.num_steps += 1
            self.num_generated_tokens += len(next_ids)
            self.last_num_scheduled_tokens = batch.num_tokens
            self.num_computed_tokens += batch.num_tokens
            finished = self.scheduler.complete(batch, next_ids, self.clock())
            self._keep_free(self.scheduler.blocks_needed_next())
            return finished

    def _stall_facts(self) -> dict[str, Any]:
        """What ``StallWatch`` says of a stall: the queues, the first waiting request's blocks,
        and the pool's free blocks, mapped bytes, limit (and the blocks it maps) and sleep."""
        pool, scheduler = self.pool, self.scheduler
        first = scheduler.waiting[0].num_tokens if scheduler.waiting else 0  # its context: what admission maps
        max_bytes, per_page = getattr(pool, "max_bytes", None), pool.blocks_per_page
        page_bytes = pool.spec.block_bytes * pool.spec.num_segments * per_page
        return {
            "num_waiting": len(scheduler.waiting), "num_running": len(scheduler.running),
            "first_blocks": -(-first // pool.block_size), "num_free_blocks": getattr(pool, "num_free_blocks", 0),
            "mapped_bytes": getattr(pool, "mapped_bytes", None), "max_bytes": max_bytes,
            "limit_blocks": None if max_bytes is None else max_bytes // page_bytes * per_page,
            "sleep_mode": pool.sleep_mode, "name": getattr(pool, "name", "NAME"),
        }  # fmt: skip

    def _keep_free(self, num_blocks: int) -> None:
        """Tell the pool what the next step will take (it maps that ahead, in the background),
        and that a budget's worth of blocks may be mapped ahead of need and stay mapped while
        nobody needs them (the daemon grants those only from memory above its low water and
        asks them back first), so the first prefill of a burst finds them mapped."""
        budget = 0 if self._closed else min(self.scheduler.budget_blocks, self.pool.num_blocks)
        reserve = (min(num_blocks, self.pool.num_blocks), budget, budget)
        if reserve != self._reserve:
            self._reserve = reserve
            self.pool.keep_free(*reserve)

    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 32, *, stall_timeout_s: float = 30.0
    ) -> list[list[int]]:
        """Generate for every prompt (greedy); the new token ids per prompt, in order.

        Raises ``PoolExhausted`` (the unfinished requests aborted) after
        ``stall_timeout_s`` seconds in which no step could compute anything, and
        ``BadRequest`` (nothing queued) for a bad prompt.
        """
        if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__iter__"):
            raise BadRequest(f"generate takes a list of prompts, got {type(prompts).__name__}")
        prompts = list(prompts)
        if prompts and not hasattr(prompts[0], "__len__"):
            raise BadRequest("generate takes a list of prompts, each a list of token ids: for one prompt, "
                             "pass [prompt_ids] (add_request takes one)")  # fmt: skip
        requests: list[Request] = []
        try:
            for prompt in prompts:
                requests.append(self.add_request(prompt, max_new_tokens))
        except BadRequest:
            for request in requests:
                self.abort(request)
            raise
        stalled_since: float | None = None
        while not all(r.finished for r in requests):
            self.step()
            if self.last_num_scheduled_tokens:
                stalled_since = None
                continue
            now = time.monotonic()
            stalled_since = now if stalled_since is None else stalled_since
            if now - stalled_since > stall_timeout_s:
                why = stall_text(now - stalled_since, **self._stall_facts())
                for request in requests:
                    self.abort(request)
                raise PoolExhausted(f"generate gave up: {why}")
            time.sleep(STALL_SLEEP_S)
        return [r.output_ids for r in requests]

    def _awake(self) -> bool:
        """True when the pool is mapped; wakes a sleeping pool (False if it cannot yet). A wake
        that found the pool's blocks gone (a warm sleep the daemon made cold meanwhile: the
        resume hook ran at the sleep, when they were still kept) requeues everything first."""
        if self.pool.sleep_mode is not None:
            try:
                self.pool.wake()
            except (Asleep, NoMemory, OverLimit, DaemonUnreachable):
                return False
            if self.pool.sleep_mode is not None:
                return False
        self._forget_lost_blocks()
        return True

    def _forward(self, batch: Batch) -> list[int]:
        """One forward over the batch; the greedy next token of each request that completes its context."""
        input_ids, positions, step, keep = hf_attention.build_step(
            batch, self.manager, self._caches, self.device, self.attention_impl)
        logits = hf_attention.paged_forward(self.model, input_ids, positions, step, keep)
        if not keep.numel():
            return []
        return logits.argmax(-1).tolist()

    # -- sleep hooks ---------------------------------------------------------------

    def _quiesce(self) -> None:
        """Wait for the running step; no step starts until ``_resume``."""
        self._step_lock.quiesce()

    def _resume(self) -> None:
        """After a sleep (or a refused one) or a move to a restarted daemon: if the pool lost its
        blocks (cold sleep, woken empty), requeue everything; let steps run again."""
        try:
            self._forget_lost_blocks()
        finally:
            self._step_lock.resume()

    def _forget_lost_blocks(self) -> None:
        """If the pool lost every block since the engine last looked, requeue every request. O(1)
        when it did not."""
        if self.pool.num_block_losses != self._num_block_losses:
            self._num_block_losses = self.pool.num_block_losses
            self.scheduler.forget_cache()

    # -- lifecycle -------------------------------------------------------------------

    def close(self) -> None:
        """Abort every request and give the pool its blocks back (cached ones too). Idempotent."""
        with self._step_lock:
            if self._closed:
                return
            self._closed = True
            self._forget_lost_blocks()  # a wake that found them gone, with no step since
            for request in list(self.scheduler.running) + list(self.scheduler.waiting):
                self.scheduler.abort(request)
            self.manager.evict_cached(self.manager.num_evictable_blocks)
            self._keep_free(0)
            _release(self.pool)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def _max_model_len(
    model: Any, asked: int | None, layout: hf_probe.AttentionLayout, impl: hf_attention.Impl
) -> int | None:
    """``asked``, else the model's ``max_position_embeddings`` (``None``: no limit known).

    An ``asked`` length past ``max_position_embeddings`` is taken as asked, by
    design: many models run past it (RoPE extrapolates; rope scaling, or a
    config that understates what the model was tuned for), and the caller who
    asks knows the model; requests are still bounded by the pool's virtual
    capacity (``add_request``). With ``impl="triton"``, which has no sliding
    window, at most the shortest window: there it cannot bind, so the model
    runs exactly.
    """
    if asked is not None and (isinstance(asked, bool) or not isinstance(asked, int) or asked <= 0):
        raise BadRequest(f"max_model_len must be a positive integer, got {asked!r}")
    limit = getattr(model.config, "max_position_embeddings", None)
    length = asked if asked is not None else limit if isinstance(limit, int) and limit > 0 else None
    windows = [w for w in layout.sliding_windows if w is not None]
    if impl != "triton" or not windows or (length is not None and length <= min(windows)):
        return length
    if asked is not None:
        raise BadRequest(
            f"max_model_len {asked} is longer than the model's sliding window {min(windows)}, which "
            "impl='triton' does not compute; use impl='auto' or a max_model_len within the window"
        )
    return min(windows)


def _default_stops(model: Any) -> list[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def _stop_ids(stop_token_ids: Any) -> frozenset[int]:
    """``stop_token_ids`` (a collection of integer ids: a list, set, tuple, 1-D tensor or array) as a
    frozenset; ``BadRequest`` for one int, text, or an element that is not an integer id >= 0."""
    if isinstance(stop_token_ids, (str, bytes)) or not hasattr(stop_token_ids, "__iter__") \
            or getattr(stop_token_ids, "ndim", 1) != 1:  # fmt: skip
        raise BadRequest(
            f"stop_token_ids must be a collection of token ids (for one id, pass [id]), got {stop_token_ids!r}"
        )
    if hasattr(stop_token_ids, "tolist"):  # a tensor or an array: its elements as Python numbers
        stop_token_ids = stop_token_ids.tolist()
    stops = []
    for token in stop_token_ids:
        try:
            value = operator.index(token) if not isinstance(token, bool) else -1
        except TypeError:
            value = -1
        if value < 0:
            raise BadRequest(f"stop_token_ids must hold token ids (integers >= 0), got {token!r}")
        stops.append(value)
    return frozenset(stops)


def _token_list(prompt_ids: Sequence[int], vocab_size: int) -> list[int]:
    """``prompt_ids`` (a sequence, a 1-D tensor or array of integers) as a list of ints, each
    checked against the vocabulary; ``BadRequest`` saying what is wrong."""
    if isinstance(prompt_ids, (str, bytes)):
        raise BadRequest("prompt_ids must be token ids, not text (tokenize it first)")
    shape = getattr(prompt_ids, "shape", None)
    if shape is not None and len(shape) != 1:
        raise BadRequest(f"prompt_ids must be 1-D, got shape {list(shape)}")
    if hasattr(prompt_ids, "tolist"):  # a tensor or an array: its elements as Python numbers
        prompt_ids = prompt_ids.tolist()
    try:
        prompt = [_token_id(token, i, vocab_size) for i, token in enumerate(prompt_ids)]
    except TypeError as exc:
        raise BadRequest(f"prompt_ids must be a sequence of token ids, got {type(prompt_ids).__name__}") from exc
    if not prompt:
        raise BadRequest("prompt_ids is empty")
    return prompt


def _token_id(token: Any, position: int, vocab_size: int) -> int:
    """``token`` as an int in ``[0, vocab_size)``: any integer type (numpy's too), never a bool."""
    try:
        value = operator.index(token) if not isinstance(token, bool) else None
    except TypeError:
        value = None
    if value is None or not 0 <= value < vocab_size:
        raise BadRequest(f"prompt token {token!r} at position {position} is not an id in [0, {vocab_size})")
    return value


def _count(value: Any, name: str) -> int:
    """``value`` as a positive int (any integer type, never a bool); ``BadRequest`` otherwise."""
    try:
        number = operator.index(value) if not isinstance(value, bool) else 0
    except TypeError:
        number = 0
    if number <= 0:
        raise BadRequest(f"{name} must be a positive integer, got {value!r}")
    return number


_claim_lock = threading.Lock()


def _nothing_to_evict(num_blocks: int) -> int:
    """The reclaim hook of a pool whose engine is being built: no cache yet, nothing evicted."""
    return 0


def _claim(pool: EnginePool) -> None:
    """Claim ``pool`` for an engine being built (its reclaim hook marks it), or ``Conflict``."""
    with _claim_lock:
        _check_unclaimed(pool)
        pool.reclaim_hook = _nothing_to_evict


def _release(pool: EnginePool) -> None:
    """Give a claimed pool back (its engine closed, or failed to build): the hooks it set go."""
    pool.quiesce_hook = pool.resume_hook = pool.reclaim_hook = None


def _check_unclaimed(pool: EnginePool) -> None:
    """Refuse a pool another engine (or a block manager) already runs over: its sleep hooks would
    be replaced, so a sleep would unmap pages under the first engine's running step."""
    if pool.quiesce_hook is not None or pool.resume_hook is not None or pool.reclaim_hook is not None:
        name = getattr(pool, "name", "")
        raise Conflict(
            f"pool {name!r} already has an engine, or a BlockManager serving its reclaims (its sleep or "
            "reclaim hooks are set): close that engine first, or register another pool for this one"
        )

