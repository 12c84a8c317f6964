"""Prefix cache: digest chain, prefix matching, LRU eviction of unreferenced blocks, the
generation counter, hit counters."""

from __future__ import annotations

from runtime.kv.block_manager import BlockManager
from runtime.kv.prefix_cache import (
    PrefixCache,
    chain_hash,
    extend_block_hashes,
    prompts_block_hashes,
    salt_digest,
)

BS = 4


def _cached_seq(bm: BlockManager, rid: str, tokens: list[int]) -> list[int]:
    """Allocate blocks for `tokens`, 'compute' them and offer the full ones to the cache."""
    hashes = extend_block_hashes([], tokens, BS)
    prefix = bm.prefix_cache.lookup(hashes)
    table = bm.allocate(rid, bm.num_blocks_for(len(tokens)) - len(prefix), prefix)
    bm.cache_full_blocks(rid, hashes, len(hashes))
    return table


def test_hash_chain_depends_on_the_whole_prefix() -> None:
    a = extend_block_hashes([], [1, 2, 3, 4, 5, 6, 7, 8, 9], BS)
    b = extend_block_hashes([], [0, 2, 3, 4, 5, 6, 7, 8], BS)
    assert len(a) == 2  # the partial block is not hashed
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different parent
    assert a[1] == chain_hash(a[0], (5, 6, 7, 8))
    # Incremental extension equals hashing from scratch.
    inc = extend_block_hashes([], [1, 2, 3, 4, 5], BS)
    assert extend_block_hashes(inc, [1, 2, 3, 4, 5, 6, 7, 8, 9], BS) == a


def test_match_prefix_returns_longest_cached_prefix() -> None:
    cache = PrefixCache(BS)
    bm = BlockManager(16, BS, cache)
    table = _cached_seq(bm, "a", list(range(10)))  # blocks 0,1 full; block 2 partial
    blocks, n = cache.match_prefix(list(range(8)) + [99, 98, 97, 96])
    assert blocks == table[:2] and n == 8
    assert cache.match_prefix([0, 1, 2, 9]) == ([], 0)
    assert cache.match_prefix([1, 2, 3, 4]) == ([], 0)  # same tokens at another offset: miss


def test_unreferenced_blocks_stay_cached_then_lru_eviction() -> None:
    cache = PrefixCache(BS)
    bm = BlockManager(4, BS, cache)
    ta = _cached_seq(bm, "a", [1] * 8)  # 2 full blocks, chain a
    tb = _cached_seq(bm, "b", [2] * 8)  # 2 full blocks, chain b
    bm.free("a")
    bm.free("b")  # a's blocks are less recently used than b's
    assert bm.num_used_blocks == 0 and cache.num_evictable == 4 and len(cache) == 4
    gen0 = cache.generation
    # A hit pins chain b's first block; nothing evicted.
    bm.allocate("c", 0, tb[:1])
    assert cache.num_evictable == 3 and cache.generation == gen0
    # Two new blocks: both of a's (the LRU ones) go; tail block first (freed first).
    new = bm.allocate("d", 2)
    assert sorted(new) == sorted(ta)
    assert cache.generation == gen0 + 2
    assert cache.match_prefix([1] * 8) == ([], 0)
    assert cache.match_prefix([2] * 8)[1] == 8  # chain b still intact
    bm.check_integrity()


def test_duplicate_prefix_keeps_one_cached_copy() -> None:
    cache = PrefixCache(BS)
    bm = BlockManager(8, BS, cache)
    # Two requests computed the same prefix concurrently (neither saw the other's blocks).
    h = extend_block_hashes([], [3] * 4, BS)
    bm.allocate("x", 1)
    bm.allocate("y", 1)
    bm.cache_full_blocks("x", h, 1)
    bm.cache_full_blocks("y", h, 1)
    assert len(cache) == 1
    bm.free("x")
    bm.free("y")
    assert cache.num_evictable == 1 and bm.num_free_blocks == 8
    bm.check_integrity()


def test_hit_counters() -> None:
    cache = PrefixCache(BS)
    cache.record_query(100, 64)
    cache.record_query(50, 0)
    assert (cache.hit_tokens, cache.query_tokens) == (64, 150)


def test_cached_blocks_leave_the_collectors_lists() -> None:
    """A full collection walks every object the collector tracks; one per cached block (the
    pool of a 3B model holds ~170k blocks on the H200) made each one tens of milliseconds
    with the step loop stopped. The index holds bytes and ints only, so neither its dicts
    nor their items are tracked."""
    import gc

    cache = PrefixCache(BS)
    bm = BlockManager(256, BS, cache)
    for r in range(8):
        _cached_seq(bm, f"r{r}", [r * 1000 + t for t in range(64)])
    gc.collect()
    assert len(cache) == 8 * 16
    assert not gc.is_tracked(cache._entries) and not gc.is_tracked(cache._hash_of_block)
    assert not any(gc.is_tracked(h) for h in cache._entries)
    # And they still work as entries: a lookup walks them.
    assert cache.match_prefix(list(range(64)))[1] == 64


def test_digests_are_a_keyed_chain_the_same_in_every_process() -> None:
    """The API server digests prompts and the engine core looks the digests up, so they must
    agree across processes whatever their hash seeds; a digest names its whole prefix."""
    import subprocess
    import sys

    tokens = [5, 49151, 0, 7, 1, 2, 3, 4, 2**31 - 1, 9, 9, 9]
    here = [h.hex() for h in extend_block_hashes([], tokens, BS)]
    code = (
        "from runtime.kv.prefix_cache import extend_block_hashes as e; "
        f"print(' '.join(h.hex() for h in e([], {tokens!r}, {BS})))"
    )
    for seed in ("0", "1234"):
        there = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
            cwd=str(__import__("pathlib").Path(__file__).resolve().parents[1]),
        ).stdout.split()
        assert there == here
    assert len(set(here)) == 3 and all(len(h) == 32 for h in here)  # 16 bytes each
    # The same block after another parent, or alone, digests differently.
    assert chain_hash(b"", [1, 2, 3, 4]) != extend_block_hashes([], [9, 9, 9, 9, 1, 2, 3, 4], BS)[1]


def test_batch_digests_reuse_a_shared_prefix_and_equal_one_by_one() -> None:
    import random

    rng = random.Random(0)
    query = [rng.randrange(1000) for _ in range(37)]
    prompts = [query + [rng.randrange(1000) for _ in range(rng.randrange(0, 9))] for _ in range(6)]
    prompts += [[], [1, 2, 3], query[:9], [rng.randrange(1000) for _ in range(20)], query]
    seeds = [b""] * len(prompts)
    batch = prompts_block_hashes(prompts, BS, seeds)
    assert batch == [extend_block_hashes([], p, BS) for p in prompts]
    # Under another salt nothing is shared with the unsalted prompt before it.
    salt = salt_digest("tenant")
    mixed = prompts_block_hashes([query, query, query], BS, [b"", salt, salt])
    assert mixed[1] == extend_block_hashes([], query, BS, salt) == mixed[2]
    assert not set(mixed[0]) & set(mixed[1])


def test_a_salt_changes_every_digest_and_none_is_no_salt() -> None:
    tokens = list(range(12))
    plain = extend_block_hashes([], tokens, BS)
    assert salt_digest(None) == b"" and extend_block_hashes([], tokens, BS, b"") == plain
    a, b = salt_digest("a"), salt_digest("b")
    assert a != b and len(a) == 16
    salted = extend_block_hashes([], tokens, BS, a)
    assert not set(salted) & set(plain) and salted != extend_block_hashes([], tokens, BS, b)
    cache = PrefixCache(BS)
    bm = BlockManager(8, BS, cache)
    bm.allocate("x", 3)
    bm.cache_full_blocks("x", salted, 3)
    assert cache.match_prefix(tokens)[1] == 0 and cache.match_prefix(tokens, a)[1] == 12


def test_a_lookup_stops_at_the_first_block_not_cached() -> None:
    bm = BlockManager(16, BS, PrefixCache(BS))
    table = _cached_seq(bm, "a", [1, 2, 3, 4, 5, 6, 7, 8])
    other = [1, 2, 3, 4, 9, 9, 9, 9, 10]  # first block the same, second not
    cache = bm.prefix_cache
    hashes = extend_block_hashes([], other, BS)
    assert cache.lookup(hashes) == table[:1]
    assert cache.extend_match(hashes, 1, len(hashes)) == []
    # A later block cached under a missing one is never reached from a cold start.
    assert (
        cache.lookup([b"not cached", *extend_block_hashes([], [1, 2, 3, 4, 5, 6, 7, 8], BS)[1:]])
        == []
    )


def test_num_still_cached_counts_the_leading_blocks_a_memo_may_keep() -> None:
    cache = PrefixCache(BS)
    bm = BlockManager(4, BS, cache)
    ta = _cached_seq(bm, "a", [1] * 8)
    tb = _cached_seq(bm, "b", [2] * 8)
    ha = extend_block_hashes([], [1] * 8, BS)
    assert cache.num_still_cached(ta, ha) == 2
    assert cache.num_still_cached(ta, ha[:1]) == 1  # a memo never runs past its digests
    assert cache.num_still_cached([], ha) == 0
    bm.free("a")
    bm.free("b")
    bm.allocate("c", 1)  # evicts a's tail block first (released first: least recently used)
    assert cache.num_still_cached(ta, ha) == 1
    bm.allocate("d", 1)
    assert cache.num_still_cached(ta, ha) == 0
    assert cache.num_still_cached(tb, extend_block_hashes([], [2] * 8, BS)) == 2
