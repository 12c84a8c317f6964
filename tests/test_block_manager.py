"""Block manager + prefix cache invariants under random allocate / share / free / abort
sequences (issue 2, test 9i)."""

from __future__ import annotations

import random

import pytest

from runtime.kv.block_manager import BlockManager, NoFreeBlocksError
from runtime.kv.prefix_cache import PrefixCache, extend_block_hashes


def test_allocate_free_roundtrip() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    t = bm.allocate("a", 3)
    assert len(t) == 3 and bm.num_free_blocks == 5
    bm.append_blocks("a", 2)
    assert bm.num_used_blocks == 5
    bm.check_integrity()
    bm.free("a")
    bm.free("a")  # second free of an unknown id is a no-op, not a double free
    assert bm.num_free_blocks == 8
    bm.check_integrity()


def test_all_or_nothing_when_full() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("a", 3)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate("b", 2)
    assert not bm.has("b")
    with pytest.raises(NoFreeBlocksError):
        bm.append_blocks("a", 2)
    assert len(bm.table("a")) == 3
    bm.check_integrity()


def test_integrity_catches_corruption() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("a", 2)
    bm.ref_counts[bm.table("a")[0]] += 1  # a phantom holder
    with pytest.raises(AssertionError):
        bm.check_integrity()
    bm.ref_counts[bm.table("a")[0]] -= 1
    bm._free.append(bm._free[0])  # a block on the free list twice
    with pytest.raises(AssertionError):
        bm.check_integrity()


def _run_random_ops(seed: int, num_ops: int, with_cache: bool) -> None:
    rng = random.Random(seed)
    bs = 4
    cache = PrefixCache(bs) if with_cache else None
    bm = BlockManager(num_blocks=24, block_size=bs, prefix_cache=cache)
    # A handful of shared "profiles" so that prefixes really are shared.
    profiles = [[rng.randrange(50) for _ in range(rng.randrange(4, 40))] for _ in range(5)]
    live: dict[str, list[int]] = {}  # request id -> its token ids
    # Shadow of the pool's contents: block id -> the tokens whose "KV" it holds.
    content: dict[int, list[int]] = {}

    def write(rid: str, toks: list[int], start_block: int) -> None:
        for i in range(start_block, len(bm.table(rid))):
            content[bm.table(rid)[i]] = toks[i * bs : (i + 1) * bs]

    next_id = 0
    for _ in range(num_ops):
        op = rng.random()
        if op < 0.45 or not live:  # admit a request, sharing the cached prefix if any
            toks = list(rng.choice(profiles)) + [
                rng.randrange(50) for _ in range(rng.randrange(0, 12))
            ]
            hashes = extend_block_hashes([], toks, bs)
            prefix = cache.lookup(hashes) if cache else []
            # Keep at least one token to compute, as the scheduler does.
            max_hit = (len(toks) - 1) // bs
            prefix = prefix[:max_hit]
            new = bm.num_blocks_for(len(toks)) - len(prefix)
            rid = f"r{next_id}"
            next_id += 1
            if bm.can_allocate(new, prefix):
                for i, b in enumerate(prefix):  # a hit must hold exactly these tokens
                    assert content[b] == toks[i * bs : (i + 1) * bs]
                bm.allocate(rid, new, prefix)
                write(rid, toks, len(prefix))
                live[rid] = toks
                bm.cache_full_blocks(rid, hashes, len(hashes))  # pretend the prefill ran
            else:
                with pytest.raises(NoFreeBlocksError):
                    bm.allocate(rid, new, prefix)
                assert not bm.has(rid)
        elif op < 0.65:  # decode: grow a sequence by a few tokens
            rid = rng.choice(list(live))
            toks = live[rid]
            for _ in range(rng.randrange(1, 6)):
                toks.append(rng.randrange(50))
                if bm.num_blocks_for(len(toks)) > len(bm.table(rid)):
                    try:
                        bm.append_blocks(rid, 1)
                    except NoFreeBlocksError:
                        toks.pop()
                        break
            write(rid, toks, (len(toks) - 1) // bs - 1 if len(toks) > bs else 0)
            bm.cache_full_blocks(rid, extend_block_hashes([], toks, bs), len(toks) // bs)
        else:  # finish / abort / preempt: all free the request's blocks
            rid = rng.choice(list(live))
            bm.free(rid)
            del live[rid]
        bm.check_integrity()
        # Every live table covers its tokens; cached lookups return the blocks' true owners.
        for rid, toks in live.items():
            assert len(bm.table(rid)) == bm.num_blocks_for(len(toks))
    for rid in list(live):
        bm.free(rid)
    bm.check_integrity()
    assert bm.num_used_blocks == 0
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("seed", range(6))
def test_random_ops_keep_invariants_with_cache(seed: int) -> None:
    _run_random_ops(seed, num_ops=1500, with_cache=True)


@pytest.mark.parametrize("seed", range(2))
def test_random_ops_keep_invariants_without_cache(seed: int) -> None:
    _run_random_ops(seed, num_ops=1500, with_cache=False)
