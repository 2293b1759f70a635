"""Page-aware block allocator: which blocks are free, on which mapped logical pages.

Blocks are laid out contiguously over a segment: block b covers bytes
``[b * block_bytes, (b + 1) * block_bytes)``. Logical page p covers
``[p * page_bytes, (p + 1) * page_bytes)``. A block *belongs* to the page that
holds its first byte; when ``block_bytes`` does not divide ``page_bytes`` the
last block of a page may run into the next page (it *straddles*), and is
usable only while both pages are mapped.

Invariants (``check`` asserts them):

- a block is on a free list iff it is not live and every page it touches is mapped;
- ``use[p]`` is the number of live blocks touching page p; a page with
  ``use == 0`` is *spare* and may be unmapped;
- a block is handed out at most once until freed (``live`` marks it).

Allocation takes blocks from the fullest mapped page that has free blocks
(spare pages last), so free space gathers in whole pages that can be given
back. Cost: ``alloc(n)`` is O(n) list slicing plus, when the current page runs
dry, a scan of the pages with free blocks; ``free(ids)`` is O(len(ids)) in C
(type check, sort, set operations) plus O(pages touched) Python work. The live
blocks are a set of ids, so handing out and validating a batch never loops in Python.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left

from kvdaemon.errors import BadRequest, PoolExhausted


class BlockAllocator:
    """Free lists per logical page over ``num_pages`` pages (see the module docstring)."""

    def __init__(self, num_pages: int, page_bytes: int, block_bytes: int) -> None:
        if block_bytes <= 0 or page_bytes <= 0 or num_pages <= 0:
            raise BadRequest("block size, page size and number of pages must be positive")
        if block_bytes > page_bytes:
            raise BadRequest(
                f"a block of {block_bytes} bytes (one segment) does not fit in a page of "
                f"{page_bytes} bytes: use a smaller block_size or a larger --page-size"
            )
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self.block_bytes = block_bytes
        self.num_blocks = num_pages * page_bytes // block_bytes
        self.aligned = page_bytes % block_bytes == 0
        self.blocks_per_page = max(1, page_bytes // block_bytes)
        self._mapped = bytearray(num_pages)
        self._live: set[int] = set()  # ids handed out and not yet freed
        self._use = [0] * num_pages
        self._free: list[list[int]] = [[] for _ in range(num_pages)]
        self._with_free: set[int] = set()  # mapped pages whose free list is not empty
        self.spare: set[int] = set()  # mapped pages with use == 0 (read-only outside)
        self._cursor = 0  # the page allocation continues from
        self.num_free = 0

    # -- geometry --------------------------------------------------------------

    def first_block(self, page: int) -> int:
        """The first block whose first byte lies in ``page`` (== num_blocks past the end)."""
        return min(self.num_blocks, -(-page * self.page_bytes // self.block_bytes))

    def page_of(self, block_id: int) -> int:
        """The logical page holding the first byte of ``block_id``."""
        return block_id * self.block_bytes // self.page_bytes

    def _straddler(self, page: int) -> int:
        """The block of ``page`` that runs into ``page + 1``, or -1."""
        last = self.first_block(page + 1) - 1
        if last < self.first_block(page) or (last + 1) * self.block_bytes <= (page + 1) * self.page_bytes:
            return -1
        return last

    # -- pages -----------------------------------------------------------------

    def is_mapped(self, page: int) -> bool:
        return bool(self._mapped[page])

    def unmapped_pages(self, num_pages: int, skip: set[int] | frozenset[int] = frozenset()) -> list[int]:
        """Up to ``num_pages`` unmapped page indices not in ``skip``, lowest first. O(pages scanned)."""
        out = []
        for page in range(self.num_pages):
            if not self._mapped[page] and page not in skip:
                out.append(page)
                if len(out) == num_pages:
                    break
        return out

    def spare_pages(self) -> list[int]:
        """Mapped pages no live block touches, highest index first."""
        return sorted(self.spare, reverse=True)

    @property
    def num_mapped(self) -> int:
        return sum(self._mapped)

    def add_page(self, page: int) -> None:
        """Record that ``page`` is now mapped; its usable blocks become free."""
        if self._mapped[page]:
            raise BadRequest(f"logical page {page} is already mapped")
        self._mapped[page] = 1
        self.spare.add(page)
        first, end = self.first_block(page), self.first_block(page + 1)
        straddler = -1 if self.aligned else self._straddler(page)
        if straddler >= 0 and (page + 1 >= self.num_pages or not self._mapped[page + 1]):
            end -= 1  # not usable until the next page is mapped
        self._push(page, list(range(end - 1, first - 1, -1)))
        if not self.aligned and page > 0 and self._mapped[page - 1]:
            prev = self._straddler(page - 1)
            if prev >= 0 and prev not in self._live:
                self._push(page - 1, [prev])

    def remove_page(self, page: int) -> None:
        """Record that ``page`` is being unmapped. It must be spare (no live block touches it)."""
        if not self._mapped[page] or self._use[page]:
            raise BadRequest(f"logical page {page} is not a spare mapped page")
        self.num_free -= len(self._free[page])
        self._free[page] = []
        self._with_free.discard(page)
        self.spare.discard(page)
        self._mapped[page] = 0
        if not self.aligned and page > 0 and self._mapped[page - 1]:
            prev = self._straddler(page - 1)
            if prev >= 0:
                self._drop(page - 1, prev)

    def _push(self, page: int, blocks: list[int]) -> None:
        if blocks:
            self._free[page].extend(blocks)
            self._with_free.add(page)
            self.num_free += len(blocks)

    def _drop(self, page: int, block: int) -> None:
        free = self._free[page]
        if block in free:
            free.remove(block)
            self.num_free -= 1
            if not free:
                self._with_free.discard(page)

    # -- blocks ----------------------------------------------------------------

    def _pick(self) -> int:
        """The fullest page with free blocks; spare pages only when nothing else has any."""
        if self.aligned:  # a spare page has every block free: the fewest free is the fullest
            pages = list(self._with_free)
            sizes = list(map(len, map(self._free.__getitem__, pages)))
            return pages[sizes.index(min(sizes))]
        use, free = self._use, self._free
        return min(self._with_free, key=lambda p: (use[p] == 0, len(free[p])))

    @property
    def num_live(self) -> int:
        return len(self._live)

    def alloc(self, num_blocks: int) -> list[int]:
        """Hand out ``num_blocks`` free blocks; ``PoolExhausted`` (nothing taken) if too few."""
        page = self._cursor
        free = self._free[page]
        if type(num_blocks) is int and 0 < num_blocks < len(free) and self.aligned:
            # Fast path: the current page has more than enough; it stays partly free.
            if num_blocks == 1:
                block = free.pop()
                self._live.add(block)
                chunk = [block]
            else:
                chunk = free[-num_blocks:]
                del free[-num_blocks:]
                chunk.reverse()  # ascending ids: neighbours in a block table sit side by side
                self._live.update(chunk)
            use = self._use
            if not use[page]:
                self.spare.discard(page)
            use[page] += num_blocks
            self.num_free -= num_blocks
            return chunk
        return self._alloc_across_pages(num_blocks)

    def _take(self, page: int, free: list[int], num_blocks: int) -> list[int]:
        """Pop ``num_blocks`` ids off ``page``'s free list, mark them live, count their use."""
        chunk = free[-num_blocks:]
        del free[-num_blocks:]
        chunk.reverse()
        self._live.update(chunk)
        if not self._use[page]:
            self.spare.discard(page)
        self._use[page] += num_blocks
        return chunk

    def _alloc_across_pages(self, num_blocks: int) -> list[int]:
        if type(num_blocks) is not int or num_blocks < 0:
            raise BadRequest(f"cannot allocate {num_blocks!r} blocks")
        if num_blocks > self.num_free:
            raise PoolExhausted(f"{num_blocks} blocks wanted, {self.num_free} free and mapped")
        out: list[int] = []
        remaining = num_blocks
        while remaining:
            page = self._cursor
            free = self._free[page]
            if not free:
                page = self._cursor = self._pick()
                free = self._free[page]
            take = remaining if remaining < len(free) else len(free)
            chunk = self._take(page, free, take)
            if not free:
                self._with_free.discard(page)
            if not self.aligned:
                self._mark_straddler(page, chunk)
            out += chunk
            remaining -= take
        self.num_free -= num_blocks
        return out

    def _mark_straddler(self, page: int, chunk: list[int]) -> None:
        straddler = self._straddler(page)
        if straddler >= 0 and straddler in chunk:
            if self._use[page + 1] == 0:
                self.spare.discard(page + 1)
            self._use[page + 1] += 1

    def free(self, block_ids: list[int]) -> None:
        """Return blocks; raises ``BadRequest`` (nothing freed) on an unknown, free or repeated id."""
        if len(block_ids) == 1 and self.aligned:
            block = block_ids[0]
            if type(block) is not int or block not in self._live:
                self._refuse(block_ids)
            self._live.remove(block)
            page = block // self.blocks_per_page
            self._free[page].append(block)
            self._with_free.add(page)
            left = self._use[page] - 1
            self._use[page] = left
            if not left:
                self.spare.add(page)
            self.num_free += 1
            return
        ids = self._validated(block_ids)
        if not self.aligned:
            self._free_straddling(ids)
        else:
            bpp, free, use, spare = self.blocks_per_page, self._free, self._use, self.spare
            start, end = 0, len(ids)
            while start < end:  # ids are sorted: one pass per page they lie on
                page = ids[start] // bpp
                stop = end if ids[-1] < (page + 1) * bpp else bisect_left(ids, (page + 1) * bpp, start)
                free[page] += ids[start:stop] if start or stop < end else ids
                self._with_free.add(page)
                left = use[page] - (stop - start)
                use[page] = left
                if not left:
                    spare.add(page)
                start = stop
        self.num_free += len(ids)

    def _validated(self, block_ids: list[int]) -> list[int]:
        """``block_ids`` sorted, taken off the live set; ``BadRequest`` (nothing changed) if one is
        not an allocated id or repeats."""
        try:
            ids = sorted(array("q", block_ids))  # ints only (a TypeError otherwise), in C
        except (TypeError, OverflowError):
            self._refuse(block_ids)
        live = self._live
        if not live.issuperset(ids):
            self._refuse(block_ids)
        num_live = len(live)
        live.difference_update(ids)
        if num_live - len(live) != len(ids):  # a repeated id
            live.update(ids)
            self._refuse(block_ids)
        return ids

    def _refuse(self, block_ids: list[int]) -> None:
        """Raise ``BadRequest`` naming the first id that is not allocated or repeats."""
        seen: set[int] = set()
        for block in block_ids:
            if type(block) is not int:
                raise BadRequest(f"{block!r} is not a block id (an int)")
            if block in seen:
                raise BadRequest(f"block {block} appears twice in one free")
            if block not in self._live:
                raise BadRequest(f"block {block} is not allocated (freed already, or never allocated)")
            seen.add(block)
        raise BadRequest(f"blocks {block_ids!r} are not all allocated")

    def _free_straddling(self, ids: list[int]) -> None:
        """Free taken-off-live ``ids`` where a block may run into the next page."""
        for block in ids:
            page = self.page_of(block)
            self._give_back(page, block)
            if (block + 1) * self.block_bytes > (page + 1) * self.page_bytes:
                self._release_use(page + 1)

    def _give_back(self, page: int, block: int) -> None:
        self._free[page].append(block)
        self._with_free.add(page)
        self._release_use(page)

    def _release_use(self, page: int) -> None:
        self._use[page] -= 1
        if self._use[page] == 0:
            self.spare.add(page)

    def is_live(self, block_id: int) -> bool:
        return block_id in self._live

    # -- checking --------------------------------------------------------------

    def check(self) -> None:
        """Assert the invariants. O(num_blocks); for tests."""
        touching = [0] * self.num_pages
        free_blocks = {b for page in range(self.num_pages) for b in self._free[page]}
        assert len(free_blocks) == sum(len(f) for f in self._free), "a block is free twice"
        for block in range(self.num_blocks):
            first = self.page_of(block)
            last = ((block + 1) * self.block_bytes - 1) // self.page_bytes
            usable = all(self._mapped[p] for p in range(first, last + 1))
            if block in self._live:
                assert usable, f"live block {block} touches an unmapped page"
                assert block not in free_blocks
                for p in range(first, last + 1):
                    touching[p] += 1
            else:
                assert (block in free_blocks) == usable, f"free block {block} misfiled"
        assert touching == self._use, "use counts drifted"
        assert self.spare == {p for p in range(self.num_pages) if self._mapped[p] and not self._use[p]}
        assert self.num_free == len(free_blocks)
        assert all(type(b) is int and 0 <= b < self.num_blocks for b in self._live), "a live id is not a block"


def check_id_list(block_ids: object, what: str) -> None:
    """``BadRequest`` (``what`` starts it: the call and its argument) unless ``block_ids`` is a
    list or tuple, as a pool's ``free`` and ``copy_blocks`` take; an array gets a hint. O(1)."""
    if not isinstance(block_ids, (list, tuple)):
        hint = " (pass .tolist())" if hasattr(block_ids, "tolist") else ""
        raise BadRequest(f"{what} a list of block ids, got {type(block_ids).__name__}{hint}")

