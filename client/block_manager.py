"""``BlockManager``: per-sequence block tables over a ``BlockSource``, with prefix caching.

A sequence of ``n`` tokens owns ``ceil(n / block_size)`` blocks; token ``i``
lives in slot ``table[i // block_size] * block_size + i % block_size``. Every
full block is registered in the ``PrefixCache`` as soon as it becomes full (at
``add_sequence`` or ``append_tokens``), so the caller must write the KV of the
tokens it adds in the same forward pass, before any other sequence reads them
(``store_kv`` runs before attention in every layer, so one batch is enough).

Invariants (the tests check them after every step):

- every block this manager got from the source is exactly one of: held (ref
  count = the number of sequences whose table lists it, >= 1) or cached and
  evictable (ref 0); every other block is free in the source;
- only full blocks are shared: a sequence's partial last block has ref count 1,
  so the caller only ever writes into blocks no other sequence reads;
- each call is all-or-nothing: when it raises, no table, ref count or source
  allocation has changed (cached blocks a failed ``add_sequence`` matched count
  as just used in the LRU order).

Running out of blocks: when ``source.alloc(n)`` raises ``PoolExhausted`` and
``E`` cached blocks are evictable, the manager first allocates ``d = max(0, n - E)``
blocks directly (if that fails, even evicting everything could not help: it
raises before evicting anything), then evicts ``n - d`` blocks (page-aware LRU,
see ``prefix_cache``), frees them to the source and allocates ``n - d``. The
source does not report how many blocks it has free (``f < n``), so up to ``f``
more blocks than strictly needed may be evicted; they stay in the source's free
list. This assumes the source can hand back blocks it was just given (``free(k)``
then ``alloc(k)`` succeeds); if it cannot, the call still raises cleanly, but the
evicted blocks stay evicted.

Own cache first (``scarce_free_blocks``, a ``KVPool``'s): while the source says
its provider has nothing to spare (it returns the blocks free without asking,
an int, not ``None``), an allocation of ``n`` more than that ``f`` whose
shortfall the cache holds takes ``f`` blocks first, then evicts ``n - f``
(the order above: if the first part fails nothing was evicted), so the blocks
come from this engine's own cached blocks instead of the daemon's last free
pages (kept for other tenants' real need, and asked back from the largest
holder anyway). A shortfall the cache cannot cover goes the ordinary way.
Eviction here is O(1) per block and needs no round trip.

Costs: ``add_sequence`` O(len(tokens)) (hashing); ``append_tokens`` O(len(tokens));
``fork`` O(blocks of the sequence) plus one ``copy_blocks``; ``free_sequence``
O(blocks); eviction O(1) per victim.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Hashable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from kvdaemon.client.prefix_cache import ROOT, ChainLink, PrefixCache, token_array
from kvdaemon.errors import BadRequest, DaemonUnreachable, KVDaemonError, PoolExhausted

_T = TypeVar("_T")


class BlockSource(Protocol):
    """Where blocks come from (``KVPool``). Block ``b`` lies on logical page ``b // blocks_per_page``."""

    block_size: int
    blocks_per_page: int

    def alloc(self, n: int) -> list[int]:
        """``n`` free blocks; raises PoolExhausted and allocates nothing when short."""
        ...

    def free(self, block_ids: list[int]) -> None:
        """Return blocks; raises on a double free or an unknown id."""
        ...

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy K and V of every layer from ``src[i]`` to ``dst[i]``."""
        ...


@dataclass
class _Sequence:
    """One sequence: its block table, token count, the tokens of its partial block, its chain."""

    blocks: list[int]
    num_tokens: int
    tail: list[int] = field(default_factory=list)
    chain: ChainLink = ROOT


def _locked(method: Callable[..., _T]) -> Callable[..., _T]:
    """Run ``method`` under the manager's lock."""

    @functools.wraps(method)
    def wrapper(self: BlockManager, *args: Any, **kwargs: Any) -> _T:
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


class BlockManager:
    """Block tables for sequences over ``source``; see the module docstring for invariants."""

    def __init__(
        self, source: BlockSource, salt: bytes = b"", enable_prefix_cache: bool = True,
        scarce_free_blocks: Callable[[], int | None] | None = None,
    ) -> None:
        if source.block_size <= 0:
            raise BadRequest(f"block_size must be positive, got {source.block_size}")
        self.source = source
        self.scarce_free_blocks = scarce_free_blocks  # see "Own cache first" in the module docstring
        self.block_size = source.block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.cache = PrefixCache(source.blocks_per_page, salt)
        self._seqs: dict[Hashable, _Sequence] = {}
        # Serialises the engine's calls with ``evict_cached`` from a pool's agent thread.
        self._lock = threading.RLock()

    # -- accounting ------------------------------------------------------------

    def __contains__(self, seq_id: Hashable) -> bool:
        """Whether ``seq_id`` is a live sequence (an unhashable id never is)."""
        try:
            return seq_id in self._seqs
        except TypeError:
            return False

    def __len__(self) -> int:
        """Number of live sequences."""
        return len(self._seqs)

    @property
    def num_held_blocks(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.cache.num_held

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks no sequence references: reclaimable on demand."""
        return self.cache.num_evictable

    @property
    def num_owned_blocks(self) -> int:
        """Blocks taken from the source and not yet returned (held + evictable)."""
        return self.cache.num_held + self.cache.num_evictable

    def num_tokens(self, seq_id: Hashable) -> int:
        return self._get(seq_id).num_tokens

    def block_table(self, seq_id: Hashable) -> list[int]:
        """A copy of the sequence's block ids, in token order."""
        return list(self._get(seq_id).blocks)

    def slot_mapping(self, seq_id: Hashable, start: int, end: int) -> list[int]:
        """Slots of tokens ``start .. end-1`` (``block * block_size + offset``); O(end - start)."""
        seq = self._get(seq_id)
        if not 0 <= start <= end <= seq.num_tokens:
            raise BadRequest(
                f"slot range [{start}, {end}) is outside sequence {seq_id!r} of {seq.num_tokens} tokens"
            )
        size, blocks = self.block_size, seq.blocks
        return [blocks[pos // size] * size + pos % size for pos in range(start, end)]

    @_locked
    def evict_cached(self, num_blocks: int) -> int:
        """Evict up to ``num_blocks`` unreferenced cached blocks (whole pages first) to the source.

        What a pool's agent calls when the daemon wants pages back: emptied
        pages become spare and can be returned. Returns the blocks evicted.
        ``BadRequest`` (nothing evicted) unless ``num_blocks`` is an int >= 0.
        """
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise BadRequest(f"evict_cached takes a count of blocks >= 0, got {num_blocks!r}")
        victims = self.cache.evict(min(num_blocks, self.cache.num_evictable))
        if victims:
            self.source.free(victims)
        return len(victims)

    @_locked
    def num_cached_tokens(self, token_ids: Sequence[int]) -> int:
        """Tokens ``add_sequence(.., token_ids)`` would find cached now; changes nothing. O(len)."""
        hits, _ = self._match_prefix(token_array(token_ids).tolist())
        return len(hits) * self.block_size

    @_locked
    def drop_all(self) -> None:
        """Forget every sequence and cached block without returning them to the source.

        For a source that lost its blocks (a pool woken from a cold sleep): the
        ids are no longer the manager's to free. O(1).
        """
        self._seqs = {}
        self.cache = PrefixCache(self.source.blocks_per_page, self.cache.salt)

    def serve_reclaim_for(self, pool: Any) -> None:
        """Let ``pool`` (a ``KVPool``) evict this manager's cached blocks to answer a reclaim."""
        pool.reclaim_hook = self.evict_cached

    # -- sequences -------------------------------------------------------------

    @_locked
    def add_sequence(self, seq_id: Hashable, token_ids: Sequence[int], headroom_blocks: int = 0) -> int:
        """Allocate the prompt's blocks, reusing cached full blocks; the number of cached tokens.

        At most ``(len - 1) // block_size`` blocks are reused, so at least one
        token is left to compute and the caller writes only into fresh blocks.
        ``headroom_blocks``: the prompt is taken only if that many more blocks
        could be taken too (they are allocated and given straight back, so they
        stay free in the source: mapped, or cached blocks evicted for them;
        O(headroom) more per admission, nothing when it is refused).
        Raises PoolExhausted (nothing changed), or BadRequest (nothing changed) for
        a live or unhashable ``seq_id``, token ids that are not int64 integers or
        ``headroom_blocks`` that is not an int >= 0.
        """
        self._check_new(seq_id)
        if isinstance(headroom_blocks, bool) or not isinstance(headroom_blocks, int) or headroom_blocks < 0:
            raise BadRequest(f"headroom_blocks must be an integer >= 0, got {headroom_blocks!r}")
        tokens = token_array(token_ids).tolist()
        hits, chain = self._match_prefix(tokens)
        for block_id in hits:
            self.cache.acquire(block_id)
        num_fresh = self._blocks_for(len(tokens)) - len(hits)
        try:
            fresh = self._allocate(num_fresh + headroom_blocks)
        except KVDaemonError:  # whatever the source refused with (exhausted, unreachable, asleep): no hit kept
            for block_id in reversed(hits):
                self.cache.release(block_id)
            raise
        fresh, headroom = fresh[:num_fresh], fresh[num_fresh:]
        if headroom:
            self.source.free(headroom)
        self.cache.adopt(fresh)
        seq = _Sequence(blocks=hits + fresh, num_tokens=len(hits) * self.block_size, chain=chain)
        self._seqs[seq_id] = seq
        self._extend(seq, tokens[seq.num_tokens:])
        return len(hits) * self.block_size

    @_locked
    def append_tokens(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        """Add tokens to a sequence, allocating blocks as needed; PoolExhausted leaves it unchanged."""
        seq = self._get(seq_id)
        tokens = token_array(token_ids).tolist()
        fresh = self._allocate(self._blocks_for(seq.num_tokens + len(tokens)) - len(seq.blocks))
        self.cache.adopt(fresh)
        seq.blocks.extend(fresh)
        self._extend(seq, tokens)

    @_locked
    def free_sequence(self, seq_id: Hashable) -> None:
        """Drop a sequence: cached full blocks stay (evictable at ref 0), the rest go to the source.

        Blocks are released last first, so a chain's tail is evicted before its head.
        """
        seq = self._get(seq_id)
        del self._seqs[seq_id]
        to_free = [block_id for block_id in reversed(seq.blocks) if self.cache.release(block_id)]
        if to_free:
            self.source.free(to_free)

    @_locked
    def fork(self, src_seq_id: Hashable, new_seq_id: Hashable) -> None:
        """A new sequence with the same tokens: full blocks shared, the partial last block copied."""
        src = self._get(src_seq_id)
        self._check_new(new_seq_id)
        partial = src.num_tokens % self.block_size != 0
        shared = src.blocks[:-1] if partial else list(src.blocks)
        fresh = self._allocate(1) if partial else []
        if partial:
            with ExitStack() as undo:
                undo.callback(self.source.free, fresh)
                self.source.copy_blocks([src.blocks[-1]], fresh)
                undo.pop_all()
        for block_id in shared:
            self.cache.acquire(block_id)
        self.cache.adopt(fresh)
        self._seqs[new_seq_id] = _Sequence(shared + fresh, src.num_tokens, list(src.tail), src.chain)

    # -- internals -------------------------------------------------------------

    def _get(self, seq_id: Hashable) -> _Sequence:
        try:
            seq = self._seqs.get(seq_id)
        except TypeError:  # unhashable: never a sequence
            seq = None
        if seq is None:
            raise BadRequest(f"unknown sequence {seq_id!r}")
        return seq

    def _check_new(self, seq_id: Hashable) -> None:
        """BadRequest unless ``seq_id`` can name a new sequence: hashable and not live."""
        try:
            live = seq_id in self._seqs
        except TypeError:
            raise BadRequest(f"a sequence id must be hashable, got {type(seq_id).__name__} {seq_id!r}") from None
        if live:
            raise BadRequest(f"sequence {seq_id!r} already exists")

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _match_prefix(self, tokens: list[int]) -> tuple[list[int], ChainLink]:
        """Cached blocks for the longest verified prefix of ``tokens``, leaving >= 1 token; no changes."""
        hits: list[int] = []
        chain = ROOT
        if not self.enable_prefix_cache:
            return hits, chain
        size = self.block_size
        for start in range(0, (len(tokens) - 1) // size * size, size):
            found = self.cache.match(chain, tokens[start:start + size])
            if found is None:
                break
            hits.append(found[0])
            chain = found[1]
        return hits, chain

    def _extend(self, seq: _Sequence, tokens: list[int]) -> None:
        """Record ``tokens`` (blocks already allocated); register each block that becomes full."""
        size = self.block_size
        first_full = seq.num_tokens // size
        seq.num_tokens += len(tokens)
        seq.tail.extend(tokens)
        num_full = len(seq.tail) // size
        if not num_full:
            return
        if self.enable_prefix_cache:
            for i in range(num_full):
                block_tokens = seq.tail[i * size:(i + 1) * size]
                seq.chain = self.cache.register(seq.blocks[first_full + i], seq.chain, block_tokens)
        del seq.tail[:num_full * size]

    def _scarce_shortfall(self, n: int) -> int:
        """While the source's provider is short: the blocks of ``n`` to take from the cache
        (what the free ones lack, when the cache holds that many); else 0. O(1)."""
        if self.scarce_free_blocks is None or not self.cache.num_evictable:
            return 0
        num_free = self.scarce_free_blocks()
        if type(num_free) is not int:
            return 0  # None: growing is cheap (anything else is not an answer)
        short = n - max(0, num_free)
        return short if 0 < short <= self.cache.num_evictable else 0

    def _allocate(self, n: int) -> list[int]:
        """``n`` blocks from the source, evicting cached blocks if short; all-or-nothing.
        A source that cannot reach its daemon to grow (``DaemonUnreachable``) is short too:
        the blocks it has mapped, cached ones evicted, still serve."""
        if n <= 0:
            return []
        short = self._scarce_shortfall(n)
        if short:
            direct = n - short  # free in the source: taken first, so a failure changes nothing
        else:
            try:
                return self.source.alloc(n)
            except (PoolExhausted, DaemonUnreachable):
                if self.cache.num_evictable == 0:
                    raise
            direct = max(0, n - self.cache.num_evictable)
        held = self.source.alloc(direct) if direct else []
        rest = n - direct
        self.source.free(self.cache.evict(rest))
        try:
            return held + self.source.alloc(rest)
        except KVDaemonError:  # all or nothing, whatever the source refused with
            if held:
                self.source.free(held)
            raise
