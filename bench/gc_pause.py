"""How long a full garbage collection stops the engine core, against the prefix cache's size.

A full (generation 2) collection walks every object the collector tracks. The engine core
freezes its start-up objects (`runtime/diagnostics/gc_watch.py`), so what is left to walk is what
serving creates, and the one structure that grows with the KV pool is the prefix cache: an entry per
cached block (a 3B model's pool on the H200 holds ~170k blocks). This fills a `BlockManager`
(built before `gc.freeze()`, as the engine core builds its pool) with N cached blocks of random
tokens (16 per block, as served), then times `gc.collect()` (median of 5) and counts the
objects it still walks (tracked, not frozen).

CPU diagnostic of the host's own work, not a serving figure. To compare two revisions, run it
with PYTHONPATH pointing at each tree (the code measured is recorded as `code_dir` and its git
revision):

    python -m bench.gc_pause --blocks 10000,50000,170000 --out bench/results/gc-pause-cpu.json

It also times the API server's full collection over what building the app leaves, before and
after freezing it (`api_server`), and a young collection (generation 1) over the prompts of N
waiting scoring requests (15,778 tokens each, as in the CPU reproduction of the H200's young
pauses), their token lists tracked as decoded vs untracked as the engine core now leaves
them (`waiting_prompts`; runtime/diagnostics/gc_watch.py, `untrack_int_list`).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

BLOCK_SIZE = 16


def _revision(code_dir: Path) -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(code_dir), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        dirty = subprocess.run(
            ["git", "-C", str(code_dir), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def measure(num_blocks: int, seed: int = 0) -> dict[str, Any]:
    """Full-collection pause (ms) with `num_blocks` cached blocks, as the engine core sees it."""
    from runtime.kv.block_manager import BlockManager
    from runtime.kv.prefix_cache import PrefixCache, extend_block_hashes

    rng = random.Random(seed)
    # Built before the freeze, as in the engine core (its containers, sized by the pool, are
    # start-up objects: frozen, never walked); what serving adds comes after.
    cache = PrefixCache(BLOCK_SIZE)
    bm = BlockManager(num_blocks + 1, BLOCK_SIZE, cache)
    gc.collect()
    gc.freeze()  # as the engine core does after start-up
    per_request = 64  # blocks a request (1,024 tokens); each request's blocks all cached
    for r in range(num_blocks // per_request):
        tokens = [rng.randrange(5, 50_000) for _ in range(per_request * BLOCK_SIZE)]
        hashes = extend_block_hashes([], tokens, BLOCK_SIZE)
        bm.allocate(f"r{r}", per_request, [])
        bm.cache_full_blocks(f"r{r}", hashes, len(hashes))
        bm.free(f"r{r}")  # cached, unreferenced: what a finished request leaves behind
    gc.collect()
    pauses = []
    for _ in range(5):
        t0 = time.perf_counter()
        gc.collect()
        pauses.append((time.perf_counter() - t0) * 1e3)
    out = {
        "cached_blocks": len(cache),
        "tracked_objects": len(gc.get_objects()),  # not counting the frozen ones
        "full_collection_ms_median": round(statistics.median(pauses), 3),
        "full_collection_ms": [round(p, 3) for p in pauses],
    }
    del bm, cache
    gc.unfreeze()
    gc.collect()
    return out


def measure_api_server() -> dict[str, Any]:
    """The API server's side: a full collection over what building the app leaves (FastAPI,
    pydantic, the routes; the tokenizer comes later and adds little), before and after
    `gc.freeze()` (what the CLI's API servers do once started). A full collection there stops
    the event loop, so every stream waits for it."""
    from app.main import create_app
    from app.settings import Settings

    app = create_app(Settings())
    gc.collect()
    walked_before = len(gc.get_objects())

    def median_ms() -> float:
        pauses = []
        for _ in range(5):
            t0 = time.perf_counter()
            gc.collect()
            pauses.append((time.perf_counter() - t0) * 1e3)
        return round(statistics.median(pauses), 3)

    before = median_ms()
    gc.freeze()
    after = median_ms()
    walked_after = len(gc.get_objects())
    gc.unfreeze()
    del app
    return {
        "objects_walked_before_freeze": walked_before,
        "full_collection_ms_median_before_freeze": before,
        "objects_walked_after_freeze": walked_after,
        "full_collection_ms_median_after_freeze": after,
    }


def measure_waiting_prompts(num_requests: int, prompt_tokens: int = 15_778) -> dict[str, Any]:
    """A young collection's pause (ms, median of 5) while `num_requests` prompts (lists of
    token ids, as decoded from the IPC message) are in the young generations: tracked, then
    untracked. Fresh lists per trial: a collection moves survivors to an older generation."""
    from runtime.diagnostics.gc_watch import untrack_int_list

    rng = random.Random(num_requests)
    base = [rng.randrange(5, 50_000) for _ in range(prompt_tokens)]
    out: dict[str, Any] = {"num_requests": num_requests, "prompt_tokens": prompt_tokens}
    for label, untrack in (("tracked", False), ("untracked", True)):
        pauses = []
        for _ in range(5):
            gc.collect()
            prompts = [list(base) for _ in range(num_requests)]
            if untrack:
                for p in prompts:
                    untrack_int_list(p)
            t0 = time.perf_counter()
            gc.collect(1)
            pauses.append((time.perf_counter() - t0) * 1e3)
            del prompts
        out[f"young_collection_ms_median_{label}"] = round(statistics.median(pauses), 3)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", default="10000,50000,170000", help="cached block counts")
    ap.add_argument("--waiting", default="57,129", help="waiting requests' prompts, counts")
    ap.add_argument("--out", default=None, help="write the results JSON here")
    args = ap.parse_args(argv)
    import runtime.kv.prefix_cache as pc

    code_dir = Path(pc.__file__).resolve().parents[2]
    rows = []
    for n in (int(x) for x in args.blocks.split(",")):
        row = {"num_blocks": n, **measure(n)}
        print(json.dumps(row))
        rows.append(row)
    api = measure_api_server()
    print(json.dumps({"api_server": api}))
    waiting = [measure_waiting_prompts(n) for n in (int(x) for x in args.waiting.split(","))]
    for w in waiting:
        print(json.dumps({"waiting_prompts": w}))
    result = {
        "command": "python -m bench.gc_pause " + " ".join(sys.argv[1:] if argv is None else argv),
        "code_dir": str(code_dir),
        "git_revision": _revision(code_dir),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "rows": rows,
        "api_server": api,
        "waiting_prompts": waiting,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
