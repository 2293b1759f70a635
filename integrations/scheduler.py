"""``Scheduler``: iteration-level batching with chunked prefill, prefix caching and preemption.

Every step, under a budget of ``max_num_batched_tokens`` new tokens:

1. running requests, oldest admission first, each get what they still need
   (one token for a decode, the rest of the prompt for a prefill), cut to the
   budget left (a prefill chunk);
2. if nothing was preempted, waiting requests join in arrival order while
   budget and ``max_num_seqs`` allow: their prompt is matched against the
   prefix cache and only the uncached part is computed, chunked the same way.
   A request joins only if, besides its prompt's blocks, one more block per
   running request could be taken (decode headroom, like vLLM's watermark):
   admitting up to the last free block would make the next decodes preempt;
   and the blocks the pool owes back (``owed_blocks``: pages the daemon asked
   for another tenant's need) could be taken too, so they go back as running
   requests free them instead of into new requests.

Blocks for the tokens a step computes are taken before the forward. When the
pool cannot give them (``PoolExhausted``) for a running request, the youngest
running request is preempted (its blocks freed; its full blocks stay in the
prefix cache) and goes back to the head of the queue to be recomputed; if the
request that needs blocks is itself the youngest, it is the one preempted. A
waiting request that does not fit waits. A pool that cannot reach its daemon
(``DaemonUnreachable``: it is down or restarting) is short the same way: the
engine keeps stepping what its mapped blocks hold (its cached blocks evicted
first, then the youngest preempted). When the pool is asleep (``Asleep``) the
step runs with what it has so far and the rest waits. Nothing is ever lost or
raised.

Invariants: a request is in exactly one of ``waiting``, ``running``, or
finished (in neither); a running request is a sequence of the ``BlockManager``
holding exactly ``num_computed`` tokens between steps; the tokens of a step's
batch are registered in the manager before the forward that writes their K/V.

Cost: O(requests + new tokens) Python work per step, plus the manager's
per-block work.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvdaemon.client.block_manager import BlockManager
from kvdaemon.errors import Asleep, BadRequest, DaemonUnreachable, PoolExhausted
from kvdaemon.integrations.request import Request


SHORT = (PoolExhausted, DaemonUnreachable)
"""Errors after which a running request's blocks come from preempting the youngest."""
TRANSIENT = (Asleep, DaemonUnreachable)
"""Errors after which admission stops taking blocks (and tries again next step)."""


@dataclass
class Batch:
    """One step's work: ``(request, number of new tokens)`` in batch order."""

    items: list[tuple[Request, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    def __bool__(self) -> bool:
        return bool(self.items)


class Scheduler:
    """Waiting and running queues over a ``BlockManager``; see the module docstring."""

    def __init__(
        self, manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int,
        owed_blocks: Callable[[], int] = lambda: 0,
    ) -> None:
        for name, value in (("max_num_batched_tokens", max_num_batched_tokens), ("max_num_seqs", max_num_seqs)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise BadRequest(f"{name} must be a positive integer, got {value!r}")
        self.manager = manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.owed_blocks = owed_blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    # -- one step ----------------------------------------------------------------

    def schedule(self) -> Batch:
        """Pick this step's batch and take its blocks (see the module docstring)."""
        batch = Batch()
        budget = self._schedule_running(batch, self.max_num_batched_tokens)
        if len(batch.items) == len(self.running):  # nobody was preempted
            self._admit_waiting(batch, budget)
        return batch

    def _schedule_running(self, batch: Batch, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed, budget)
            start = request.num_computed
            try:
                self.manager.append_tokens(request.request_id, request.token_ids[start:start + num_new])
            except SHORT:
                victim = self.running[-1]
                self.preempt(victim)
                if victim is request:
                    break
                continue
            except Asleep:
                return 0
            batch.items.append((request, num_new))
            budget -= num_new
            i += 1
        return budget

    def _admit_waiting(self, batch: Batch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            cached = self.manager.num_cached_tokens(request.token_ids)
            end = cached + min(request.num_tokens - cached, budget)
            try:  # admitted only with a block to spare for each running request, and what is owed
                computed = self.manager.add_sequence(request.request_id, request.token_ids[:end],
                                                     headroom_blocks=len(self.running) + self.owed_blocks())
            except (PoolExhausted, *TRANSIENT):
                return  # it waits; the pool may have room at a later step
            self.waiting.popleft()
            self.running.append(request)
            request.num_computed = computed
            batch.items.append((request, end - computed))
            budget -= end - computed

    def complete(self, batch: Batch, next_token_ids: list[int], now: float) -> list[Request]:
        """Account a finished forward: ``next_token_ids`` for the requests whose context is now
        computed, in batch order. Frees finished requests; returns them."""
        tokens = iter(next_token_ids)
        finished: list[Request] = []
        for request, num_new in batch.items:
            request.num_computed += num_new
            if request.num_computed < request.num_tokens:
                continue  # a prefill chunk: no token yet
            request.append_token(next(tokens), now)
            if request.finished:
                self.manager.free_sequence(request.request_id)
                self.running.remove(request)
                finished.append(request)
        return finished

    def blocks_needed_next(self) -> int:
        """Blocks the next step will take: each running request's next tokens (a decode,
        or the rest of a prefill within the budget), then the prompts of the waiting
        requests the budget left would admit (cache hits not counted). Requests that may
        arrive before it are the engine's floor ahead of need (``budget_blocks``), not
        counted here. O(requests the budget covers)."""
        size, budget, need = self.manager.block_size, self.max_num_batched_tokens, 0
        for request in self.running:
            if budget <= 0:
                return need
            end = min(request.num_tokens + 1, request.num_computed + budget)
            need += max(0, -(-end // size) - -(-request.num_computed // size))
            budget -= max(1, request.num_tokens - request.num_computed)
        for request in self.waiting:
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            tokens = min(request.num_tokens + 1, budget)
            need += -(-tokens // size)
            budget -= tokens
        return need

    @property
    def budget_blocks(self) -> int:
        """Blocks one full step's budget of new tokens takes."""
        return -(-self.max_num_batched_tokens // self.manager.block_size)

    # -- preemption and removal ----------------------------------------------------

    def preempt(self, request: Request) -> None:
        """Free a running request's blocks and queue it first, to be recomputed."""
        self.running.remove(request)
        self.manager.free_sequence(request.request_id)
        request.num_computed = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def forget_cache(self) -> None:
        """The pool lost every block (a cold sleep): requeue all running requests, oldest first."""
        self.manager.drop_all()
        for request in reversed(self.running):
            request.num_computed = 0
            request.num_preemptions += 1
            self.num_preemptions += 1
            self.waiting.appendleft(request)
        self.running = []

    def abort(self, request: Request) -> None:
        """Drop an unfinished request wherever it is; its blocks go back."""
        if request in self.running:
            self.running.remove(request)
            self.manager.free_sequence(request.request_id)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.finish_reason = "abort"
