"""Prefix cache: full KV blocks keyed by a digest chain of their token ids.

A full block (exactly `block_size` tokens) at block index i of a sequence is identified by
    d_i = BLAKE2b-128(d_{i-1} || the block's token ids as little-endian int32)   d_{-1} = b""
so a block's digest names the whole prefix up to and including it. The cache maps d_i -> block
id and trusts the digest: no tokens are kept or compared. Why a cryptographic digest, not
Python's `hash` of (parent, tokens): a 64-bit tuple hash can be forced to collide by a prompt
built for it, and a forged collision would serve one user another user's KV (wrong answers, or
their prompt leaking through the logits). The old cache stored every block's tokens and
compared them on each hit to stop that; with 128-bit digests a collision (forged or by chance)
needs ~2^64 work, so the index holds digest -> block id alone: no token tuples in memory, no
per-block token comparison on the engine thread.

Where they are computed: a digest is the same in every process, so the API server computes a
prompt's digests (`EngineCoreClient.digest`, on the preparation threads that tokenize) and sends
them with the request (`Request.block_hashes`); the engine thread only looks them up and
extends the chain over generated tokens. On a CPU here, digesting a 14k-token prompt takes
~0.7 ms (the Python tuple hash it replaces took ~0.3 ms, on the engine thread).

Lifecycle of a cached block (ref counts are kept by `BlockManager`):
  - referenced (ref >= 1): in use by one or more requests; not evictable;
  - unreferenced (ref == 0): stays cached, sits in an LRU list; the block manager takes the
    least recently used one when its free list is empty (eviction drops the digest mapping).

`generation` changes on every insertion and eviction, so per-request cached-prefix lengths
computed by the scheduler ("continuous calibration") stay valid until it moves.
This module is plain Python: no torch (the API server imports it).
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from hashlib import blake2b

DIGEST_BYTES = 16  # 128 bits: a collision needs ~2^64 work

# A token id as 4 little-endian bytes: `array("i")` is the machine's C int, so the bytes are
# swapped on a big-endian machine to keep digests the same everywhere.
_BIG_ENDIAN = sys.byteorder == "big"
assert array("i").itemsize == 4, "digests assume a 4-byte C int"


def _int32_bytes(token_ids: Sequence[int]) -> bytes:
    words = array("i", token_ids)
    if _BIG_ENDIAN:
        words.byteswap()
    return words.tobytes()


def salt_digest(cache_salt: str | None) -> bytes:
    """The parent digest of a request's first block: b"" unsalted, else a digest of its
    `cache_salt`, so that requests with different salts share no cached block (one tenant
    cannot tell from its latency whether another sent a prompt) and equal salts share as
    usual."""
    if cache_salt is None:
        return b""
    salt = cache_salt.encode("utf-8")
    return blake2b(salt, digest_size=DIGEST_BYTES, person=b"gl-salt").digest()


def _append_digests(hashes: list[bytes], data: bytes, block_size: int, seed: bytes) -> None:
    """Digest `data` (whole blocks of int32 token bytes, the ones after `hashes`'s blocks)
    block by block onto `hashes`; `seed`: the first block's parent (`salt_digest`)."""
    step = 4 * block_size
    view = memoryview(data)  # slices without copies
    parent = hashes[-1] if hashes else seed
    for off in range(0, len(data) - step + 1, step):
        h = blake2b(parent, digest_size=DIGEST_BYTES)
        h.update(view[off : off + step])
        parent = h.digest()
        hashes.append(parent)


def chain_hash(parent_hash: bytes, tokens: Sequence[int]) -> bytes:
    """Digest of one full block given its parent's digest (the seed for the first block)."""
    out: list[bytes] = []
    _append_digests(out, _int32_bytes(tokens), len(tokens), parent_hash)
    return out[0]


def extend_block_hashes(
    hashes: list[bytes], token_ids: Sequence[int], block_size: int, seed: bytes = b""
) -> list[bytes]:
    """Append the digests of the full blocks of `token_ids` not yet in `hashes` (in place).

    `hashes` is a per-request memo: it must have been built from a prefix of the same
    `token_ids` with the same `seed` (digests chain, so it resumes after the last one).
    Returns `hashes`."""
    first, num_full = len(hashes), len(token_ids) // block_size
    if first < num_full:
        new_ids = token_ids[first * block_size : num_full * block_size]
        append_block_hashes(hashes, new_ids, block_size, seed)
    return hashes


def append_block_hashes(
    hashes: list[bytes], new_ids: Sequence[int], block_size: int, seed: bytes = b""
) -> None:
    """Append the digests of `new_ids` (whole blocks: a multiple of `block_size` tokens, the
    ones right after the blocks of `hashes`) to `hashes`, in place; `seed` is the first
    block's parent (`salt_digest`). Raises OverflowError for a token id outside int32 (none
    is: ids are below the vocabulary size)."""
    if len(new_ids) % block_size:
        raise ValueError(f"{len(new_ids)} tokens are not whole blocks of {block_size}")
    _append_digests(hashes, _int32_bytes(new_ids), block_size, seed)


def prompts_block_hashes(
    prompts: Sequence[Sequence[int]], block_size: int, seeds: Sequence[bytes]
) -> list[list[bytes]]:
    """The full-block digests of each prompt (`seeds[i]`: its first block's parent), for a
    batch of requests sent together (the items of one score call share its query): the blocks
    a prompt shares with the one before it, under the same seed, reuse that one's digests
    instead of digesting them again."""
    out: list[list[bytes]] = []
    step = 4 * block_size
    prev, prev_seed, prev_hashes = b"", b"", []
    for ids, seed in zip(prompts, seeds, strict=True):
        data = _int32_bytes(ids)
        # Longest run of equal leading blocks, by bisection over byte-string comparisons
        # (memcmp; ~3 us for 14k tokens): equal first k blocks imply equal first k - 1.
        lo, hi = 0, (min(len(data), len(prev)) // step if seed == prev_seed else 0)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if data[: mid * step] == prev[: mid * step]:
                lo = mid
            else:
                hi = mid - 1
        hashes: list[bytes] = prev_hashes[:lo]
        _append_digests(hashes, data[lo * step : len(ids) // block_size * step], block_size, seed)
        out.append(hashes)
        prev, prev_seed, prev_hashes = data, seed, hashes
    return out


class PrefixCache:
    """Digest-chain index of full blocks plus the LRU list of unreferenced cached blocks."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # Chain digest -> block id, and back. Bytes and ints only: the collector never walks
        # them (CPython untracks a dict that holds no containers).
        self._entries: dict[bytes, int] = {}
        self._hash_of_block: dict[int, bytes] = {}  # cached blocks only
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

    def lookup(self, hashes: Sequence[bytes], known: Sequence[int] = ()) -> list[int]:
        """Block ids of the longest cached prefix whose chain digests are `hashes`.

        `known`: block ids already matched for the first digests (a memo that is still valid:
        no eviction since), so the walk resumes after them.
        Read-only: no ref counts, LRU order or counters change."""
        start = min(len(known), len(hashes))
        return [*known[:start], *self.extend_match(hashes, start, len(hashes))]

    def extend_match(self, hashes: Sequence[bytes], start: int, end: int) -> list[int]:
        """The block ids cached for `hashes[start:end]`, up to the first miss (`lookup`
        without copying the known part: the scheduler refreshes every waiting request's
        prefix whenever the cache changes, and a long prefix is ~900 blocks). A digest names
        its whole prefix, so a hit continues the `start` blocks before it. Read-only."""
        out: list[int] = []
        get = self._entries.get
        for i in range(start, min(end, len(hashes))):
            b = get(hashes[i])
            if b is None:
                break
            out.append(b)
        return out

    def num_still_cached(self, block_ids: Sequence[int], hashes: Sequence[bytes]) -> int:
        """How many leading `block_ids` are still the cached blocks of `hashes` (a memo's
        check after evictions). Why not a Python loop a block: after evictions the
        scheduler checks every waiting request's memo, ~900 blocks each for a 14k-token
        profile, so with 40 waiting under a pool smaller than the working set (evictions every
        step) that loop took ~1.5 ms a step on a CPU here; compared as whole lists the loop
        runs in C, and a block-by-block walk happens only where a memo was cut."""
        n = len(block_ids)
        now = list(map(self._hash_of_block.get, block_ids))
        if now == hashes[:n]:
            return n
        for i, (h_now, h) in enumerate(zip(now, hashes, strict=False)):
            if h_now != h:
                return i
        return min(n, len(hashes))

    def match_prefix(self, token_ids: Sequence[int], seed: bytes = b"") -> tuple[list[int], int]:
        """(block ids, number of tokens) of the longest cached prefix of `token_ids` (under
        the salt whose digest is `seed`). Read-only convenience that digests from scratch;
        the scheduler memoizes digests."""
        blocks = self.lookup(extend_block_hashes([], token_ids, self.block_size, seed))
        return blocks, len(blocks) * self.block_size

    def record_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one admission lookup for the hit-ratio metric."""
        self.query_tokens += num_query_tokens
        self.hit_tokens += num_hit_tokens

    # ---- mutations (called by BlockManager, which owns ref counts) ------------------------
    def insert(self, block_hash: bytes, block_id: int) -> bool:
        """Map `block_hash` -> `block_id`. Returns False (and changes nothing) when the digest
        is already cached (another request computed the same prefix) or the block already
        carries one; the caller keeps its block uncached then."""
        if block_hash in self._entries or block_id in self._hash_of_block:
            return False
        self._entries[block_hash] = block_id
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
        for h, b in self._entries.items():
            assert self._hash_of_block.get(b) == h, f"block {b} index mismatch"
        for block_id in self._hash_of_block:
            in_lru = block_id in self._lru
            assert in_lru == (ref_counts[block_id] == 0), (
                f"cached block {block_id}: ref {ref_counts[block_id]}, in LRU {in_lru}"
            )
        for block_id in self._lru:
            assert block_id in self._hash_of_block, f"LRU block {block_id} is not cached"
