"""Host time a step spends turning its index lists into tensors: `torch.tensor` against
`runtime.model.ops.host_tensor` (through `array.array`), alternated on the same lists.

The lists are those a merged short step next to scoring builds for FlashInfer's paged plan and
the forward: the page indices, indptr and last-page lengths of every sequence, and the token
ids, decode slots, positions and logits rows. Default shape: 16 queries of 150 tokens after
14,150-token cached profiles (post recommendation) beside 48 decodes at 2,500-token contexts,
16-token blocks. Pinning is left out (this runs where there may be no GPU): both ways pin the
same bytes once.

    python -m bench.host_lists --out bench/results/host-lists-cpu.json

An engine-level host diagnostic: what a step's host work costs here, not a serving figure."""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch

from bench.bursts import provenance, write_json
from runtime.model.ops import host_tensor


def step_lists(
    num_queries: int, query_tokens: int, cached_tokens: int, num_decodes: int, decode_context: int
) -> list[tuple[list[int], torch.dtype]]:
    rng = random.Random(0)
    bs = 16
    kv_lens = [cached_tokens + query_tokens] * num_queries + [decode_context + 1] * num_decodes
    indptr, indices, last = [0], [], []
    for kv in kv_lens:
        n = (kv + bs - 1) // bs
        indices.extend(rng.sample(range(1_000_000), n))
        indptr.append(indptr[-1] + n)
        last.append(kv - (n - 1) * bs)
    num_rows = num_queries * query_tokens
    ids = [rng.randrange(150_000) for _ in range(num_rows)]
    positions = [p for _ in range(num_queries) for p in range(cached_tokens, kv_lens[0])]
    slots = list(range(num_decodes))
    rows = list(range(query_tokens - 1, num_rows, query_tokens))
    rows += list(range(num_rows, num_rows + num_decodes))
    return [
        (indptr, torch.int32),
        (indices, torch.int32),
        (last, torch.int32),
        (ids + slots + positions + rows, torch.int64),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--queries", type=int, default=16)
    ap.add_argument("--query-tokens", type=int, default=150)
    ap.add_argument("--cached-tokens", type=int, default=14_150)
    ap.add_argument("--decodes", type=int, default=48)
    ap.add_argument("--decode-context", type=int, default=2_500)
    ap.add_argument("--repeats", type=int, default=5, help="alternated rounds")
    ap.add_argument("--iters", type=int, default=200, help="steps timed a round")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    lists = step_lists(
        args.queries, args.query_tokens, args.cached_tokens, args.decodes, args.decode_context
    )
    ways = {
        "torch.tensor": lambda: [torch.tensor(v, dtype=d) for v, d in lists],
        "host_tensor": lambda: [host_tensor(v, d) for v, d in lists],
    }
    ms: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, convert in ways.items():
            convert()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                convert()
            ms[name].append((time.perf_counter() - t0) / args.iters * 1e3)
    medians = {name: statistics.median(v) for name, v in ms.items()}
    data: dict[str, Any] = {
        **provenance("bench.host_lists", argv),
        "note": "engine-level host diagnostic, not a serving figure",
        "shape": vars(args) | {"num_ints": sum(len(v) for v, _ in lists)},
        "ms_a_step": {name: [round(x, 4) for x in v] for name, v in ms.items()},
        "median_ms_a_step": {name: round(m, 4) for name, m in medians.items()},
        "ratio": round(medians["host_tensor"] / medians["torch.tensor"], 3),
    }
    for name, m in medians.items():
        print(f"{name:>13}: {m:.3f} ms a step (rounds {', '.join(f'{x:.3f}' for x in ms[name])})")
    print(f"{data['shape']['num_ints']} ints; host_tensor / torch.tensor {data['ratio']}")
    write_json(args.out, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
