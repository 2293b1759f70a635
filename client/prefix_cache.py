"""Prefix cache: the ledger of every block a ``BlockManager`` holds.

Each block the manager holds has a *ref count*: the number of sequences whose
block table lists it (>= 1). A full block may also be *cached*: indexed by the
content of the prefix it ends, so that a later sequence with the same prefix
reuses it. A cached block whose ref count drops to 0 stays cached and becomes
*evictable*; a block that is not cached goes back to the source at ref 0.

Identity of a prefix. Block i of a sequence is hashed as
``block_hash(hash of block i-1, token ids of block i, salt)`` (blake2b, stable
across processes; block 0 chains from ``ROOT.hash``). The hash only picks a
bucket. A hit is *verified*: the entry must store the same token ids and have
been registered under the same parent *serial* (a number given to each cached
prefix once, never reused). By induction over the chain, a hit at block i means
the whole prefix 0..i is equal token for token, so a hash collision, even a
forced one, is a miss and never wrong data. A price of exactness: an entry
whose parent was evicted can no longer be matched (a recomputed parent gets a
new serial); it stays evictable until the LRU order reaches it.

Eviction policy (``evict``). A logical page is *clean* when none of its blocks
has a ref count >= 1; a clean page holds only evictable blocks and blocks that
are free in the source (assuming this manager is the source's only user), so
evicting its evictable blocks empties the page. Victims are taken:

1. from clean pages, oldest page first, where a page's age is the moment it
   became clean (the release of its last referenced block); within a page,
   oldest block first; a page is drained before the next is touched;
2. when no clean page is left, from all evictable blocks in LRU order (each of
   them then sits on a page that stays partly in use).

Cost: ``acquire``, ``release``, ``adopt`` are O(1) per block; ``evict`` is O(1)
per victim; ``match`` and ``register`` hash ``block_size`` tokens and scan one
bucket (one entry unless hashes collide). Recency lives in intrusive doubly
linked lists (one global, one per page, one of clean pages), so no step scans.
"""

from __future__ import annotations

import hashlib
import itertools
import sys
from array import array
from collections.abc import Iterator, Sequence
from typing import Generic, NamedTuple, TypeVar

from kvdaemon.errors import BadRequest

HASH_BYTES = 16
T = TypeVar("T")


class ChainLink(NamedTuple):
    """A verified prefix: the hash of its last block and the serial of its cache entry."""

    hash: bytes
    serial: int


ROOT = ChainLink(bytes(HASH_BYTES), 0)
"""The empty prefix, parent of every sequence's block 0."""


def token_array(token_ids: Sequence[int]) -> array[int]:
    """``token_ids`` as an int64 array; BadRequest for anything else. O(len(token_ids))."""
    try:
        return array("q", token_ids)
    except (TypeError, OverflowError) as error:
        raise BadRequest(f"token ids must be int64 integers: {error}") from None


def block_hash(parent_hash: bytes, token_ids: Sequence[int], salt: bytes) -> bytes:
    """Stable 16-byte hash of (parent hash, token ids, salt); O(len(token_ids)).

    The encoding is unambiguous: salt length, salt, parent hash (fixed length),
    then the token ids as little-endian int64. Raises BadRequest for token ids
    that are not integers in the int64 range.
    """
    tokens = token_array(token_ids)
    if sys.byteorder != "little":
        tokens.byteswap()
    digest = hashlib.blake2b(digest_size=HASH_BYTES)
    digest.update(len(salt).to_bytes(8, "little"))
    digest.update(salt)
    digest.update(parent_hash)
    digest.update(tokens.tobytes())
    return digest.digest()


class _Link(Generic[T]):
    """One node of an intrusive list; ``item`` is what it stands for."""

    __slots__ = ("prev", "next", "item")

    def __init__(self, item: T | None) -> None:
        self.prev: _Link[T] | None = None
        self.next: _Link[T] | None = None
        self.item = item

    @property
    def linked(self) -> bool:
        return self.prev is not None


class _LinkedList(Generic[T]):
    """Doubly linked list over ``_Link`` nodes with a sentinel: O(1) append, remove, first."""

    __slots__ = ("_root", "_len")

    def __init__(self) -> None:
        self._root: _Link[T] = _Link(None)
        self._root.prev = self._root.next = self._root
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def append(self, link: _Link[T]) -> None:
        """Link ``link`` (which must be unlinked) at the newest end."""
        last = self._root.prev
        assert last is not None and not link.linked
        link.prev, link.next = last, self._root
        last.next = self._root.prev = link
        self._len += 1

    def remove(self, link: _Link[T]) -> None:
        """Unlink ``link``, which must be in this list."""
        assert link.prev is not None and link.next is not None
        link.prev.next, link.next.prev = link.next, link.prev
        link.prev = link.next = None
        self._len -= 1

    def first(self) -> T | None:
        """The oldest item, or None when empty."""
        head = self._root.next
        return None if head is self._root or head is None else head.item

    def __iter__(self) -> Iterator[T]:
        """Items oldest first; O(len)."""
        link = self._root.next
        while link is not self._root and link is not None:
            assert link.item is not None
            yield link.item
            link = link.next


class _Entry:
    """A cached block: the content it verifies against and its places in the recency lists."""

    __slots__ = ("block_id", "link", "token_ids", "parent_serial", "lru", "in_page")

    def __init__(
        self, block_id: int, link: ChainLink, token_ids: tuple[int, ...], parent_serial: int
    ) -> None:
        self.block_id = block_id
        self.link = link
        self.token_ids = token_ids
        self.parent_serial = parent_serial
        self.lru: _Link[_Entry] = _Link(self)
        self.in_page: _Link[_Entry] = _Link(self)


class _Page:
    """A logical page with held or evictable blocks: how many are referenced, which are evictable."""

    __slots__ = ("index", "pinned", "evictable", "clean")

    def __init__(self, index: int) -> None:
        self.index = index
        self.pinned = 0
        self.evictable: _LinkedList[_Entry] = _LinkedList()
        self.clean: _Link[_Page] = _Link(self)


class PrefixCache:
    """Ref counts of held blocks, the verified prefix index, and page-aware LRU eviction.

    Invariants: a block is *held* (ref count >= 1) or *evictable* (cached, ref 0),
    never both; every evictable block is in the global LRU list and in its page's
    list; a page is in the clean list iff it has no held block and >= 1 evictable one.
    """

    def __init__(self, blocks_per_page: int, salt: bytes = b"") -> None:
        if blocks_per_page <= 0:
            raise BadRequest(f"blocks_per_page must be positive, got {blocks_per_page}")
        self.blocks_per_page = blocks_per_page
        self.salt = bytes(salt)
        self._refs: dict[int, int] = {}
        self._entries: dict[int, _Entry] = {}
        self._buckets: dict[bytes, list[_Entry]] = {}
        self._serials = itertools.count(1)
        self._lru: _LinkedList[_Entry] = _LinkedList()
        self._pages: dict[int, _Page] = {}
        self._clean: _LinkedList[_Page] = _LinkedList()

    # -- queries ---------------------------------------------------------------

    @property
    def num_held(self) -> int:
        """Blocks with ref count >= 1."""
        return len(self._refs)

    @property
    def num_cached(self) -> int:
        """Cached blocks, held or evictable."""
        return len(self._entries)

    @property
    def num_evictable(self) -> int:
        """Cached blocks with ref count 0."""
        return len(self._lru)

    def ref_count(self, block_id: int) -> int:
        """Sequences holding ``block_id`` (0 when evictable or unknown)."""
        return self._refs.get(block_id, 0)

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._entries

    def held_block_ids(self) -> list[int]:
        """Every held block; O(held)."""
        return list(self._refs)

    def evictable_block_ids(self) -> list[int]:
        """Evictable blocks, least recently used first; O(evictable)."""
        return [entry.block_id for entry in self._lru]

    # -- prefix index ----------------------------------------------------------

    def match(self, parent: ChainLink, token_ids: Sequence[int]) -> tuple[int, ChainLink] | None:
        """The cached block holding ``token_ids`` right after prefix ``parent``, verified; or None."""
        tokens = tuple(token_ids)
        for entry in self._buckets.get(block_hash(parent.hash, tokens, self.salt), ()):
            if entry.parent_serial == parent.serial and entry.token_ids == tokens:
                return entry.block_id, entry.link
        return None

    def register(self, block_id: int, parent: ChainLink, token_ids: Sequence[int]) -> ChainLink:
        """Cache held ``block_id`` as ``token_ids`` after prefix ``parent``; the new prefix's link.

        When an equal prefix is already cached (in another block), ``block_id``
        stays uncached (it returns to the source at ref 0) and the existing
        entry's link is returned, so the chain continues through it.
        """
        if block_id not in self._refs or block_id in self._entries:
            raise BadRequest(f"block {block_id} must be held and not yet cached to be registered")
        tokens = tuple(token_ids)
        key = block_hash(parent.hash, tokens, self.salt)
        bucket = self._buckets.setdefault(key, [])
        for entry in bucket:
            if entry.parent_serial == parent.serial and entry.token_ids == tokens:
                return entry.link
        entry = _Entry(block_id, ChainLink(key, next(self._serials)), tokens, parent.serial)
        bucket.append(entry)
        self._entries[block_id] = entry
        return entry.link

    # -- ref counts ------------------------------------------------------------

    def adopt(self, block_ids: Sequence[int]) -> None:
        """Hold blocks fresh from the source (ref count 1 each); O(len(block_ids))."""
        for block_id in block_ids:
            if block_id in self._refs or block_id in self._entries:
                raise BadRequest(f"block {block_id} came from the source but is already held or cached")
            self._refs[block_id] = 1
            self._pin(block_id)

    def acquire(self, block_id: int) -> None:
        """One more sequence holds ``block_id`` (held, or evictable: then it stops being evictable)."""
        refs = self._refs.get(block_id, 0)
        if refs == 0:
            entry = self._entries.get(block_id)
            if entry is None:
                raise BadRequest(f"block {block_id} is neither held nor cached")
            self._pin(block_id)
            self._unlist(entry)
        self._refs[block_id] = refs + 1

    def release(self, block_id: int) -> bool:
        """One sequence fewer holds ``block_id``; True when the caller must free it to the source."""
        refs = self._refs.get(block_id, 0)
        if refs == 0:
            raise BadRequest(f"block {block_id} is not held")
        if refs > 1:
            self._refs[block_id] = refs - 1
            return False
        del self._refs[block_id]
        entry = self._entries.get(block_id)
        if entry is not None:
            page = self._pages[block_id // self.blocks_per_page]
            self._lru.append(entry.lru)
            page.evictable.append(entry.in_page)
        self._unpin(block_id)
        return entry is None

    # -- eviction --------------------------------------------------------------

    def evict(self, n: int) -> list[int]:
        """Uncache up to ``n`` evictable blocks (policy in the module docstring); their ids.

        The caller frees the returned blocks to the source. O(1) per victim.
        """
        victims: list[int] = []
        while len(victims) < n and len(self._lru):
            page = self._clean.first()
            entry = page.evictable.first() if page is not None else self._lru.first()
            assert entry is not None
            self._unlist(entry)
            self._forget(entry)
            victims.append(entry.block_id)
        return victims

    def _forget(self, entry: _Entry) -> None:
        """Drop an unlisted entry from the index."""
        del self._entries[entry.block_id]
        bucket = self._buckets[entry.link.hash]
        bucket.remove(entry)
        if not bucket:
            del self._buckets[entry.link.hash]

    def _unlist(self, entry: _Entry) -> None:
        """Take an evictable entry out of the recency lists; drop its page if now empty."""
        page = self._pages[entry.block_id // self.blocks_per_page]
        self._lru.remove(entry.lru)
        page.evictable.remove(entry.in_page)
        if not len(page.evictable) and page.pinned == 0:
            self._clean.remove(page.clean)
            del self._pages[page.index]

    def _pin(self, block_id: int) -> None:
        """A block of its page became held: the page is no longer clean."""
        index = block_id // self.blocks_per_page
        page = self._pages.get(index)
        if page is None:
            page = self._pages[index] = _Page(index)
        elif page.clean.linked:
            self._clean.remove(page.clean)
        page.pinned += 1

    def _unpin(self, block_id: int) -> None:
        """A held block of its page was released: the page may become clean, or be forgotten."""
        page = self._pages[block_id // self.blocks_per_page]
        page.pinned -= 1
        if page.pinned:
            return
        if len(page.evictable):
            self._clean.append(page.clean)
        else:
            del self._pages[page.index]
