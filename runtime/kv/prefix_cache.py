"""Prefix cache: full KV blocks keyed by a hash chain of their token ids.

A full block (exactly `block_size` tokens) at block index i of a sequence is identified by
    h_i = hash((h_{i-1}, tuple(tokens of block i)))      with h_{-1} = None
so a block's hash names the whole prefix up to and including it. The cache maps h_i -> block id.
Each entry also stores (parent hash, tokens), checked on lookup, so a 64-bit hash collision
is a cache miss instead of wrong KV.

Lifecycle of a cached block (ref counts are kept by `BlockManager`):
  - referenced (ref >= 1): in use by one or more requests; not evictable;
  - unreferenced (ref == 0): stays cached, sits in an LRU list; the block manager takes the
    least recently used one when its free list is empty (eviction drops the hash mapping).

`generation` changes on every insertion and eviction, so per-request cached-prefix lengths
computed by the scheduler ("continuous calibration") stay valid until it moves.
This module is plain Python: no torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def chain_hash(parent_hash: int | None, tokens: tuple[int, ...]) -> int:
    """Hash of one full block given its parent's hash (None for the first block)."""
    return hash((parent_hash, tokens))


def extend_block_hashes(
    hashes: list[int],
    token_ids: Sequence[int],
    block_size: int,
    blocks_out: list[tuple[int, ...]] | None = None,
) -> list[int]:
    """Append the hashes of the full blocks of `token_ids` not yet in `hashes` (in place).

    `hashes` is a per-request memo: it must have been built from a prefix of the same
    `token_ids`. `blocks_out`: also append each new block's tokens (the tuple just hashed),
    so a lookup right after need not cut them again (`PrefixCache.extend_match`'s `fresh`).
    Returns `hashes` for convenience."""
    num_full = len(token_ids) // block_size
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), num_full):
        block = tuple(token_ids[i * block_size : (i + 1) * block_size])
        parent = chain_hash(parent, block)
        hashes.append(parent)
        if blocks_out is not None:
            blocks_out.append(block)
    return hashes


# An entry is a plain tuple (parent hash, block tokens, block id), not a class: a tuple of
# untracked objects (ints, a tuple of ints) leaves the collector's lists at the first
# collection it survives, an instance of a class never does. With one entry per cached block
# (~170k for a 3B model's pool on the H200), entries as instances were walked by every full
# collection: 37.6 ms a collection at 170k cached blocks on a CPU here, 0.005 ms as tuples
# (`python -m bench.gc_pause`).
_PARENT, _TOKENS, _BLOCK = 0, 1, 2


class PrefixCache:
    """Hash-chain index of full blocks plus the LRU list of unreferenced cached blocks."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # chain hash -> (parent hash, block tokens, block id)
        self._entries: dict[int, tuple[int | None, tuple[int, ...], int]] = {}
        self._hash_of_block: dict[int, int] = {}  # block id -> chain hash (cached blocks only)
        # Unreferenced cached blocks, least recently used first. Values unused.
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.generation = 0  # bumped on insert / evict (invalidates cached-prefix memos)
        self.num_evictions = 0  # memos survive insertions (a prefix only grows) but not these
        # Counters for the hit-ratio metric (tokens looked up at admission vs tokens hit).
        self.hit_tokens = 0
        self.query_tokens = 0

    # ---- lookups -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._hash_of_block

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._lru

    def lookup(
        self, hashes: Sequence[int], token_ids: Sequence[int], known: Sequence[int] = ()
    ) -> list[int]:
        """Block ids of the longest cached prefix whose chain hashes are `hashes`.

        `token_ids` must be the tokens the hashes were computed from (used to verify).
        `known`: block ids already verified for the first hashes (a memo that is still valid:
        no eviction since), so the walk resumes after them.
        Read-only: no ref counts, LRU order or counters change."""
        start = min(len(known), len(hashes))
        return [*known[:start], *self.extend_match(hashes, token_ids, start, len(hashes))]

    def extend_match(
        self,
        hashes: Sequence[int],
        token_ids: Sequence[int],
        start: int,
        end: int,
        fresh: Sequence[tuple[int, ...]] = (),
        fresh_from: int = 0,
    ) -> list[int]:
        """The block ids cached for `hashes[start:end]` that continue a verified prefix of
        `start` blocks, up to the first miss (`lookup` without copying the known part: the
        scheduler refreshes every waiting request's prefix whenever the cache changes, and a
        long prefix is ~900 blocks). `fresh`: the tokens of blocks `fresh_from`.. as
        `extend_block_hashes` just cut them (the check reuses them). Read-only."""
        bs = self.block_size
        out: list[int] = []
        parent: int | None = hashes[start - 1] if start else None
        entries = self._entries
        num_fresh = len(fresh)
        for i in range(start, min(end, len(hashes))):
            h = hashes[i]
            e = entries.get(h)
            if e is None or e[_PARENT] != parent:
                break
            j = i - fresh_from
            block = fresh[j] if 0 <= j < num_fresh else tuple(token_ids[i * bs : (i + 1) * bs])
            if e[_TOKENS] != block:
                break
            out.append(e[_BLOCK])
            parent = h
        return out

    def still_cached(self, block_id: int, block_hash: int) -> bool:
        """True if `block_id` is still the cached block for `block_hash` (memo check)."""
        return self._hash_of_block.get(block_id) == block_hash

    def match_prefix(self, token_ids: Sequence[int]) -> tuple[list[int], int]:
        """(block ids, number of tokens) of the longest cached prefix of `token_ids`.
        Read-only convenience that hashes from scratch; the scheduler memoizes hashes."""
        hashes = extend_block_hashes([], token_ids, self.block_size)
        blocks = self.lookup(hashes, token_ids)
        return blocks, len(blocks) * self.block_size

    def record_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one admission lookup for the hit-ratio metric."""
        self.query_tokens += num_query_tokens
        self.hit_tokens += num_hit_tokens

    # ---- mutations (called by BlockManager, which owns ref counts) ------------------------
    def insert(
        self, block_hash: int, parent_hash: int | None, tokens: tuple[int, ...], block_id: int
    ) -> bool:
        """Map `block_hash` -> `block_id`. Returns False (and changes nothing) when the hash
        is already cached (another request computed the same prefix) or the block already
        carries a hash; the caller keeps its block uncached then."""
        if block_hash in self._entries or block_id in self._hash_of_block:
            return False
        self._entries[block_hash] = (parent_hash, tokens, block_id)
        self._hash_of_block[block_id] = block_hash
        self.generation += 1
        return True

    def on_unreferenced(self, block_id: int) -> bool:
        """The block's ref count reached 0. Returns True if it is cached (it joins the LRU
        tail: most recently used); False means the caller must put it on the free list."""
        if block_id not in self._hash_of_block:
            return False
        self._lru[block_id] = None
        self._lru.move_to_end(block_id)
        return True

    def on_referenced(self, block_id: int) -> None:
        """An unreferenced cached block is taken again (prefix hit): leave the LRU."""
        self._lru.pop(block_id, None)

    def evict(self) -> int | None:
        """Drop the least recently used unreferenced cached block; returns its id (now
        uncached, ref 0, owned by the caller) or None when nothing is evictable."""
        if not self._lru:
            return None
        block_id, _ = self._lru.popitem(last=False)
        h = self._hash_of_block.pop(block_id)
        del self._entries[h]
        self.generation += 1
        self.num_evictions += 1
        return block_id

    # ---- integrity ---------------------------------------------------------------------
    def check_integrity(self, ref_counts: Sequence[int]) -> None:
        """Raise AssertionError if the index and the LRU disagree with the ref counts."""
        assert len(self._entries) == len(self._hash_of_block), "index size mismatch"
        for h, e in self._entries.items():
            assert self._hash_of_block.get(e[_BLOCK]) == h, f"block {e[_BLOCK]} index mismatch"
        for block_id in self._hash_of_block:
            in_lru = block_id in self._lru
            assert in_lru == (ref_counts[block_id] == 0), (
                f"cached block {block_id}: ref {ref_counts[block_id]}, in LRU {in_lru}"
            )
        for block_id in self._lru:
            assert block_id in self._hash_of_block, f"LRU block {block_id} is not cached"
