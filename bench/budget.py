"""Prefill throughput against `prefill_token_budget` on short-scoring-like prompts (issue 3,
item 4: "decide the default by measurement").

    python -m bench.budget --budgets 1,2048,4096,8192 --num-requests 8 --repeats 2 \
        --out bench/results/budget-cpu-2026-11-29.json

Method: for each budget, build the engine (`--model`, default SmolLM2-135M-Instruct, on
`--device`, default cpu) with that `prefill_token_budget` and the prefix cache off (every
prompt is computed in full, so only batching differs), then submit a burst of
`--num-requests` SCORE requests at once, prompt lengths uniform in [256, 2048] tokens
(short scoring, DESIGN.md), random token ids, the same set for every budget (seeded). Measure
the wall time from the first `add` to the last finished output; throughput = prompt tokens /
time. Also reported: forwards (engine steps) per burst and the mean request latency (arrival
to finish, engine clock) -- the cost of batching is that everyone in a batch waits for the
whole batch. Budget 1 is the unbatched baseline (a request longer than the budget runs alone).
Repeats alternate budgets (A B C A B C ...) so a change in machine load hits all of them; the
median over repeats is kept. Through the engine directly: no HTTP, no tokenizer.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from typing import Any

from bench.bursts import (
    Burst,
    alternate,
    medians,
    provenance,
    run_burst,
    start_engines,
    write_json,
)
from runtime.config import EngineConfig

MIN_PROMPT_TOKENS = 256
MAX_PROMPT_TOKENS = 2048


def _prompts(num_requests: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [rng.randint(MIN_PROMPT_TOKENS, MAX_PROMPT_TOKENS) for _ in range(num_requests)]
    # Ids in the SmolLM2 vocabulary range, away from the specials at the bottom.
    return [[rng.randrange(100, 49000) for _ in range(n)] for n in lengths]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    prompts = _prompts(args.num_requests, args.seed)
    warm = _prompts(1, args.seed + 1)
    budgets = [int(b) for b in args.budgets.split(",")]
    configs = {
        b: EngineConfig(
            model=args.model,
            device=args.device,
            prefill_token_budget=b,
            enable_prefix_cache=False,
            cpu_kv_cache_gb=args.cpu_kv_cache_gb,
        )
        for b in budgets
    }
    burst = Burst()
    engines = start_engines(configs, burst, warm)
    runs = alternate(
        engines,
        args.repeats,
        lambda b, engine, r: run_burst(engine, burst, prompts, f"b{b}r{r}"),
        lambda b, r, res: (
            f"[budget {b:>6}] repeat {r + 1}/{args.repeats}: "
            f"{res['tokens_per_s']:8.1f} tok/s  {res['wall_s']:7.2f} s  "
            f"{res['num_forwards']:.0f} forwards  mean latency {res['mean_latency_s']:.2f} s"
        ),
    )
    results = []
    for b in budgets:
        med = medians(runs[b])
        results.append(
            {
                "prefill_token_budget": b,
                **med,
                "tokens_per_s_runs": [x["tokens_per_s"] for x in runs[b]],
            }
        )
    return {
        "prompt_tokens": [len(p) for p in prompts],
        "total_prompt_tokens": sum(len(p) for p in prompts),
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.budget", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--budgets",
        default="1,2048,4096,8192",
        help="comma-separated prefill_token_budget values (1 = no batching)",
    )
    p.add_argument("--num-requests", type=int, default=8, help="requests per burst")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-kv-cache-gb", type=float, default=0.5)
    p.add_argument(
        "--out", default=None, help="JSON file (e.g. bench/results/budget-cpu-DATE.json)"
    )
    args = p.parse_args(argv)
    load_before = os.getloadavg()
    t0 = time.time()
    data = measure(args)
    base = next((r for r in data["results"] if r["prefill_token_budget"] == 1), None)
    print(f"\n{'budget':>8} {'tok/s':>9} {'vs budget 1':>11} {'forwards':>9} {'mean lat s':>11}")
    for r in data["results"]:
        rel = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        print(
            f"{r['prefill_token_budget']:>8} {r['tokens_per_s']:>9.1f} {rel:>11} "
            f"{r['num_forwards']:>9.0f} {r['mean_latency_s']:>11.2f}"
        )
    data.update(provenance("bench.budget", argv))
    data["machine"]["loadavg_before"] = load_before
    data["machine"]["loadavg_after"] = os.getloadavg()
    data.update(
        {
            "model": args.model,
            "device": args.device,
            "seed": args.seed,
            "num_requests": args.num_requests,
            "repeats": args.repeats,
            "duration_s": time.time() - t0,
        }
    )
    write_json(args.out, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
