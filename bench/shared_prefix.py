"""Scoring bursts with per-user shared prefixes: waiting for a prefix that is being prefilled
(`wait_for_shared_prefix_tokens`) against computing it again in the same batch.

    python -m bench.shared_prefix --users 4 --items 4 --profile-tokens 1024 --repeats 3 \
        --out bench/results/shared-prefix-cpu-DATE.json
    python -m bench.shared_prefix --model random:llama-3.1-8b --device cuda \
        --max-gpu-memory-gb 60 --users 8 --items 4 --profile-tokens 12000 --item-tokens 150

Method: two engines (`--model`, default SmolLM2-135M-Instruct, on `--device`, default cpu),
prefix cache on, identical but for `wait_for_shared_prefix_tokens` (0 = off, and
`--wait-tokens`). A burst = `--users` x `--items` SCORE requests submitted at once, each a
user's profile (`--profile-tokens`, random ids, seeded) + an item (`--item-tokens`), users
interleaved (u0, u1, ..., u0, u1, ...) as a recommendation service would see them. The prefix
cache is reset before every burst, so every profile starts cold: that is the case the
setting is for (a new user's first requests arrive together). Measured per burst: wall time
from the first `add` to the last answer, prompt tokens actually computed (the engine's
`num_prefill_tokens`), and the mean request latency. Repeats alternate the engines; medians.
Through the engine directly: no HTTP, no tokenizer.
"""

from __future__ import annotations

import argparse
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


def burst_prompts(users: int, items: int, profile: int, item: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Ids in the SmolLM2 vocabulary range, away from the specials at the bottom.
    profiles = [[rng.randrange(100, 49000) for _ in range(profile)] for _ in range(users)]
    return [
        profiles[u] + [rng.randrange(100, 49000) for _ in range(item)]
        for _ in range(items)
        for u in range(users)
    ]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    prompts = burst_prompts(
        args.users, args.items, args.profile_tokens, args.item_tokens, args.seed
    )
    warm = burst_prompts(1, 1, 64, 8, args.seed + 1)
    configs = {
        wait: EngineConfig(
            model=args.model,
            device=args.device,
            wait_for_shared_prefix_tokens=wait,
            cpu_kv_cache_gb=args.cpu_kv_cache_gb,
            # Two engines share one GPU: each capped (weights, KV pool and activations).
            max_gpu_memory_gb=args.max_gpu_memory_gb,
        )
        for wait in (0, args.wait_tokens)
    }
    burst = Burst()
    engines = start_engines(configs, burst, warm)

    def run_one(wait: int, engine: Any, r: int) -> dict[str, float]:
        engine.reset_prefix_cache()
        time.sleep(0.05)  # the reset is applied on the engine thread
        before = engine.stats()["num_prefill_tokens"]
        res = run_burst(engine, burst, prompts, f"w{wait}r{r}")
        res["computed_tokens"] = float(engine.stats()["num_prefill_tokens"] - before)
        return res

    runs = alternate(
        engines,
        args.repeats,
        run_one,
        lambda wait, r, res: (
            f"[wait {wait:>4}] repeat {r + 1}/{args.repeats}: {res['wall_s']:7.2f} s  "
            f"{res['computed_tokens']:8.0f} tokens computed  "
            f"mean latency {res['mean_latency_s']:.2f} s"
        ),
    )
    results = []
    for wait, rs in runs.items():
        med = medians(rs)
        results.append(
            {"wait_for_shared_prefix_tokens": wait, **med, "wall_s_runs": [x["wall_s"] for x in rs]}
        )
    off, on = results
    return {
        "total_prompt_tokens": sum(len(p) for p in prompts),
        "results": results,
        "speedup_wait_vs_off": off["wall_s"] / on["wall_s"],
        "computed_tokens_ratio_wait_vs_off": on["computed_tokens"] / off["computed_tokens"],
        "mean_latency_ratio_wait_vs_off": on["mean_latency_s"] / off["mean_latency_s"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.shared_prefix", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", default="default")
    p.add_argument("--device", default="cpu")
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--items", type=int, default=4, help="requests per user in the burst")
    p.add_argument("--profile-tokens", type=int, default=1024)
    p.add_argument("--item-tokens", type=int, default=64)
    p.add_argument("--wait-tokens", type=int, default=256, help="the setting's value when on")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-kv-cache-gb", type=float, default=0.5)
    p.add_argument(
        "--max-gpu-memory-gb", type=float, default=None, help="cap per engine on a GPU (two run)"
    )
    p.add_argument("--out", default=None, help="JSON file")
    args = p.parse_args(argv)
    t0 = time.time()
    data = measure(args)
    print(f"\n{'wait tokens':>11} {'wall s':>8} {'computed':>9} {'mean lat s':>11}")
    for r in data["results"]:
        print(
            f"{r['wait_for_shared_prefix_tokens']:>11} {r['wall_s']:>8.2f} "
            f"{r['computed_tokens']:>9.0f} {r['mean_latency_s']:>11.2f}"
        )
    print(
        f"wait vs off: {data['speedup_wait_vs_off']:.2f}x faster, "
        f"{data['computed_tokens_ratio_wait_vs_off']:.2f}x the tokens computed, "
        f"{data['mean_latency_ratio_wait_vs_off']:.2f}x the mean latency"
    )
    data.update(provenance("bench.shared_prefix", argv))
    data.update(
        {
            "model": args.model,
            "device": args.device,
            "settings": {k: v for k, v in vars(args).items() if k != "out"},
            "duration_s": time.time() - t0,
        }
    )
    write_json(args.out, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
