"""CPU bookkeeping of the paged KV pool: free list, reference counts, block tables.

Every block is in exactly one of three states:
  - free:        ref 0, not cached, on the free list;
  - cached-idle: ref 0, cached in the prefix cache, in its LRU list (evictable);
  - referenced:  ref >= 1, held by the block tables of `ref` requests.
A block is taken from the free list first, then by evicting the LRU cached-idle block.
`check_integrity()` verifies that partition and that ref counts equal the number of holders.
Plain Python: no torch (the device tensors live in `runtime/kv/kv_pool.py`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from runtime.kv.prefix_cache import PrefixCache


class NoFreeBlocksError(RuntimeError):
    """Not enough free or evictable blocks for an allocation (nothing was changed)."""


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, prefix_cache: PrefixCache | None = None
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self.ref_counts: list[int] = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}
        # Per request: how many of its leading blocks were offered to the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}

    # ---- capacity ------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free + evictable cached blocks."""
        evictable = self.prefix_cache.num_evictable if self.prefix_cache else 0
        return len(self._free) + evictable

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one request."""
        return self.num_blocks - self.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_pinned(self, prefix_block_ids: Sequence[int]) -> int:
        """How many of these cached blocks are unreferenced now (evictable): sharing them
        takes them out of the evictable pool. (O(blocks) in C: a 14k-token prefix is ~900
        blocks, and this runs at every admission.)"""
        return list(map(self.ref_counts.__getitem__, prefix_block_ids)).count(0)

    def can_allocate(self, num_new_blocks: int, prefix_block_ids: Sequence[int] = ()) -> bool:
        # Pinning an evictable prefix block takes it out of the evictable pool too.
        return num_new_blocks + self.num_pinned(prefix_block_ids) <= self.num_free_blocks

    # ---- tables --------------------------------------------------------------------------
    def has(self, request_id: str) -> bool:
        return request_id in self._tables

    def num_offered_blocks(self, request_id: str) -> int:
        """How many of the table's leading blocks were offered to the prefix cache."""
        return self._num_cached_blocks.get(request_id, 0)

    def num_sole_blocks(self, request_id: str) -> int:
        """How many of the request's blocks no other request references: what freeing it
        gives back (to the free list, or to the prefix cache as evictable). O(its blocks)."""
        return list(map(self.ref_counts.__getitem__, self._tables[request_id])).count(1)

    def table(self, request_id: str) -> list[int]:
        """The request's block ids in position order (the live list: do not mutate)."""
        return self._tables[request_id]

    def allocate(
        self, request_id: str, num_new_blocks: int, prefix_block_ids: Sequence[int] = ()
    ) -> list[int]:
        """Create the request's table: the shared `prefix_block_ids` (prefix-cache hits, in
        order) followed by `num_new_blocks` fresh blocks. All or nothing: raises
        NoFreeBlocksError without changing anything when it cannot be satisfied."""
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already holds KV blocks")
        if not self.can_allocate(num_new_blocks, prefix_block_ids):
            raise NoFreeBlocksError(
                f"need {num_new_blocks} new blocks (+{len(prefix_block_ids)} shared), "
                f"{self.num_free_blocks} available"
            )
        # The shared blocks' ref counts, inline rather than a method call a block: an
        # admission after a long cached prefix touches ~900 of them on the engine thread.
        rc, cache = self.ref_counts, self.prefix_cache
        for b in prefix_block_ids:
            if rc[b]:
                rc[b] += 1
                continue
            if cache is None or not cache.is_evictable(b):
                raise AssertionError(f"block {b} is free, not a cached block: cannot share it")
            cache.on_referenced(b)
            rc[b] = 1
        table = list(prefix_block_ids)
        for _ in range(num_new_blocks):
            table.append(self._take_block())
        self._tables[request_id] = table
        self._num_cached_blocks[request_id] = len(prefix_block_ids)
        return table

    def append_blocks(self, request_id: str, num_new_blocks: int = 1) -> list[int]:
        """Add fresh blocks at the end of the request's table (all or nothing)."""
        table = self._tables[request_id]
        if num_new_blocks > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"need {num_new_blocks} blocks, {self.num_free_blocks} available"
            )
        new = [self._take_block() for _ in range(num_new_blocks)]
        table.extend(new)
        return new

    def free(self, request_id: str) -> None:
        """Release all of the request's blocks (finish, abort or preemption). Unknown ids
        are ignored so abort paths can call it unconditionally."""
        table = self._tables.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)
        if table is None:
            return
        # Release the tail first: it enters the LRU before the head, so it is evicted first
        # (heads of sequences are the most widely shared prefixes). Inline, as in `allocate`.
        rc, cache, free = self.ref_counts, self.prefix_cache, self._free
        for b in reversed(table):
            n = rc[b] - 1
            if n > 0:
                rc[b] = n
                continue
            if n < 0:
                raise AssertionError(f"double free of block {b}")
            rc[b] = 0
            if cache is None or not cache.on_unreferenced(b):
                free.append(b)

    def cache_full_blocks(
        self, request_id: str, block_hashes: Sequence[bytes], num_blocks: int
    ) -> None:
        """Offer the request's first `num_blocks` blocks to the prefix cache: full blocks
        whose KV is computed (the memo `block_hashes` may run further: only these are read).

        `block_hashes[i]` is the chain digest of block i of the request's tokens. Blocks
        offered before are skipped; a digest that is already cached elsewhere leaves this
        request's block uncached."""
        cache = self.prefix_cache
        if cache is None:
            return
        table = self._tables[request_id]
        start = self._num_cached_blocks[request_id]
        end = min(num_blocks, len(block_hashes), len(table))
        for i in range(start, end):
            cache.insert(block_hashes[i], table[i])
        self._num_cached_blocks[request_id] = max(start, end)

    def drop_cached_blocks(self) -> int:
        """Evict every unreferenced cached block to the free list (blocks in use keep their
        cache entries). Returns how many were dropped. Benchmarks call this between runs so
        one run's prefixes do not make the next run look faster."""
        if self.prefix_cache is None:
            return 0
        num_dropped = 0
        while (b := self.prefix_cache.evict()) is not None:
            self._free.append(b)
            num_dropped += 1
        return num_dropped

    # ---- internals -----------------------------------------------------------------------
    def _take_block(self) -> int:
        if self._free:
            b = self._free.popleft()
        else:
            evicted = self.prefix_cache.evict() if self.prefix_cache else None
            if evicted is None:  # can_allocate was checked: this is a bookkeeping bug
                raise NoFreeBlocksError("no free or evictable block")
            b = evicted
        assert self.ref_counts[b] == 0
        self.ref_counts[b] = 1
        return b

    # ---- integrity -----------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError unless: ref counts equal the number of holding tables; every
        block is exactly one of free / cached-idle / referenced; no block is lost."""
        holders = [0] * self.num_blocks
        for rid, table in self._tables.items():
            assert len(set(table)) == len(table), f"request {rid} holds a block twice"
            for b in table:
                holders[b] += 1
        assert holders == self.ref_counts, "ref counts differ from the number of holders"
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        cache = self.prefix_cache
        for b in free:
            assert self.ref_counts[b] == 0, f"free block {b} is referenced"
            assert cache is None or not cache.is_cached(b), f"free block {b} is cached"
        idle = 0
        if cache is not None:
            cache.check_integrity(self.ref_counts)
            idle = cache.num_evictable
        referenced = sum(1 for r in self.ref_counts if r > 0)
        assert len(free) + idle + referenced == self.num_blocks, (
            f"leak: {len(free)} free + {idle} cached-idle + {referenced} referenced "
            f"!= {self.num_blocks}"
        )
