"""The scheduler's host time a step with long cached prefixes (engine-level diagnostic, CPU).

Why: next to scoring on the H200 a short suffix step spends 1.3-2.7 ms planning (step traces'
`plan_ms`, docs/benchmarks.md "The cap's second repeats"), and every admission of a scoring
request whose user profile is cached touches each block of that prefix (~900 for 14k tokens)
in Python: its hashes, the prefix-cache walk, reference counts at allocation and at release,
and the refresh of every waiting request's cached prefix whenever the cache changes. This
times `Scheduler.schedule` and `Scheduler.update` alone, with a fake runner, on post
recommendation's shape: `--users` profiles of `--profile-tokens` (cached first), posts of
`--post-tokens`, one arrival a step so the queue holds `--waiting` requests, block size 16.
Each request arrives with its prompt's block digests, as the API server sends them (trees
from before that: the scheduler digests them itself, inside the timed `schedule`).

    python -m bench.scheduler_host --waiting 1,10,40 --budget 200 --repeats 3 --out sched.json

`--decode-streams 48` also times decode steps of 48 chat streams (`--decode-prompt-tokens`
each), the scheduler's work for every decode of every step; `--waiting ''` skips the rest.

`--budget 200` admits about one request a step (the queue stays full); 2048 drains it.
Host time of this machine's Python, not a GPU figure: compare runs on one machine only.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from policies import make_policy
from runtime.config import EngineConfig
from runtime.kv.block_manager import BlockManager
from runtime.kv.prefix_cache import PrefixCache
from runtime.request import Request, RequestKind, SamplingParams
from runtime.scheduler import RunnerOutput, Scheduler, StepCapacity, StepPlan

BLOCK_SIZE = 16


def _fake_run(plan: StepPlan) -> RunnerOutput:
    """What a runner returns for the plan: label scores for scoring rows, token 1 otherwise."""
    out = RunnerOutput()
    for s in plan.seqs:
        if not s.needs_output:
            continue
        if s.request.kind == RequestKind.SCORE:
            out.label_probs[s.request.request_id] = [0.5, 0.5]
        elif s.samples:
            out.sampled_token_ids[s.request.request_id] = 1
    return out


def time_steps(
    policy: str,
    num_waiting: int,
    budget: int,
    num_steps: int,
    profile_tokens: int,
    post_tokens: int,
    num_users: int,
    seed: int,
    pool_factor: float = 4.0,
) -> dict[str, Any]:
    """Mean host time (ms) of `schedule` and of `update` over `num_steps` steps with the queue
    held at `num_waiting` scoring requests whose profiles are cached (with `pool_factor` < 1
    the KV pool holds that share of the users' profiles: evictions every step, as issue 17's
    0.5x pool)."""
    cfg = EngineConfig(
        block_size=BLOCK_SIZE,
        prefill_token_budget=max(budget, 16_384),
        max_num_seqs=256,
        enable_prefix_cache=True,
        prefill_policy=policy,
    )
    blocks = int(num_users * (profile_tokens + post_tokens) // BLOCK_SIZE * pool_factor)
    sched = Scheduler(
        cfg, BlockManager(blocks, BLOCK_SIZE, PrefixCache(BLOCK_SIZE)), make_policy(policy), [2]
    )
    # A tree from before the API server sent digests (an A/B on PYTHONPATH) has no field.
    api_digests = "block_hashes" in Request.__dataclass_fields__
    if api_digests:
        from runtime.kv.prefix_cache import extend_block_hashes
    rng = random.Random(seed)
    profiles = [
        [rng.randrange(100, 30_000) for _ in range(profile_tokens)] for _ in range(num_users)
    ]
    count = 0

    def arrive() -> None:
        nonlocal count
        prompt = profiles[rng.randrange(num_users)] + [
            rng.randrange(100, 30_000) for _ in range(post_tokens)
        ]
        req = Request(f"r{count}", RequestKind.SCORE, prompt, SamplingParams(max_tokens=1))
        if api_digests:  # as the API server sends them (its time, not the engine thread's)
            req.block_hashes = extend_block_hashes([], prompt, BLOCK_SIZE)
        sched.add(req)
        count += 1

    for _ in range(2 * num_users):  # every profile computed and cached
        arrive()
    while sched.has_work():
        plan = sched.schedule(StepCapacity(prefill_token_budget=cfg.prefill_token_budget))
        sched.update(plan, _fake_run(plan))
    for _ in range(num_waiting):
        arrive()
    schedule_s = update_s = 0.0
    for _ in range(num_steps):
        arrive()
        t0 = time.perf_counter()
        plan = sched.schedule(StepCapacity(prefill_token_budget=budget))
        t1 = time.perf_counter()
        out = _fake_run(plan)
        t2 = time.perf_counter()
        sched.update(plan, out)
        update_s += time.perf_counter() - t2
        schedule_s += t1 - t0
    return {
        "policy": policy,
        "waiting": num_waiting,
        "waiting_at_end": len(sched.waiting),
        "schedule_ms": 1e3 * schedule_s / num_steps,
        "update_ms": 1e3 * update_s / num_steps,
    }


def time_decode_steps(
    num_streams: int, prompt_tokens: int, num_steps: int, seed: int
) -> dict[str, Any]:
    """Mean host time (ms) of `schedule` and `update` over decode steps of `num_streams` chat
    streams with `prompt_tokens`-token prompts (after their prefill; the contexts grow by a
    token a step): the work the scheduler does for every decode of every step."""
    cfg = EngineConfig(
        block_size=BLOCK_SIZE,
        prefill_token_budget=max(8192, prompt_tokens),
        max_num_seqs=max(256, num_streams),
        enable_prefix_cache=True,
        prefill_policy="fcfs",
    )
    blocks = num_streams * (prompt_tokens + num_steps + 64) // BLOCK_SIZE + 64
    sched = Scheduler(
        cfg, BlockManager(blocks, BLOCK_SIZE, PrefixCache(BLOCK_SIZE)), make_policy("fcfs"), [2]
    )
    rng = random.Random(seed)
    for i in range(num_streams):
        prompt = [rng.randrange(100, 30_000) for _ in range(prompt_tokens)]
        params = SamplingParams(max_tokens=num_steps + 64, ignore_eos=True)
        sched.add(Request(f"g{i}", RequestKind.GENERATE, prompt, params))
    schedule_s = update_s = 0.0
    n = 0
    while n < num_steps:
        t0 = time.perf_counter()
        plan = sched.schedule(StepCapacity(prefill_token_budget=cfg.prefill_token_budget))
        t1 = time.perf_counter()
        out = RunnerOutput()
        for q in plan.seqs:
            if q.needs_output and q.samples:
                out.sampled_token_ids[q.request.request_id] = rng.randrange(100, 30_000)
        t2 = time.perf_counter()
        sched.update(plan, out)
        if not plan.prefill:  # decode steps only
            schedule_s += t1 - t0
            update_s += time.perf_counter() - t2
            n += 1
    return {"schedule_ms": 1e3 * schedule_s / n, "update_ms": 1e3 * update_s / n}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--policies", default="fcfs,srjf")
    ap.add_argument("--waiting", default="1,10,40", help="queue lengths (comma-separated)")
    ap.add_argument("--budget", type=int, default=200, help="prefill tokens a step")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile-tokens", type=int, default=14_000)
    ap.add_argument("--post-tokens", type=int, default=150)
    ap.add_argument("--users", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--pool-factor", type=float, default=4.0, help="KV pool / the users' working set"
    )
    ap.add_argument(
        "--decode-streams", type=int, default=0, help="also time decode steps of this many"
    )
    ap.add_argument("--decode-prompt-tokens", type=int, default=2048)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rows = []
    if args.decode_streams:
        runs = [
            time_decode_steps(
                args.decode_streams, args.decode_prompt_tokens, args.steps, args.seed + r
            )
            for r in range(args.repeats)
        ]
        sched_ms = [r["schedule_ms"] for r in runs]
        upd_ms = [r["update_ms"] for r in runs]
        rows.append(
            {
                "decode_streams": args.decode_streams,
                "prompt_tokens": args.decode_prompt_tokens,
                "schedule_ms_median": statistics.median(sched_ms),
                "schedule_ms_runs": sched_ms,
                "update_ms_median": statistics.median(upd_ms),
                "update_ms_runs": upd_ms,
            }
        )
        print(
            f"decode {args.decode_streams} streams: schedule {statistics.median(sched_ms):.3f} ms, "
            f"update {statistics.median(upd_ms):.3f} ms [{min(upd_ms):.3f}, {max(upd_ms):.3f}]"
        )
    for policy in args.policies.split(","):
        for w in (int(x) for x in args.waiting.split(",") if x):
            runs = [
                time_steps(
                    policy,
                    w,
                    args.budget,
                    args.steps,
                    args.profile_tokens,
                    args.post_tokens,
                    args.users,
                    args.seed + r,
                    args.pool_factor,
                )
                for r in range(args.repeats)
            ]
            sched_ms = [r["schedule_ms"] for r in runs]
            upd_ms = [r["update_ms"] for r in runs]
            row = {
                "policy": policy,
                "waiting": w,
                "schedule_ms_median": statistics.median(sched_ms),
                "schedule_ms_runs": sched_ms,
                "update_ms_median": statistics.median(upd_ms),
                "update_ms_runs": upd_ms,
            }
            rows.append(row)
            print(
                f"{policy:5s} waiting {w:3d}: schedule {row['schedule_ms_median']:.3f} ms "
                f"[{min(sched_ms):.3f}, {max(sched_ms):.3f}], update "
                f"{row['update_ms_median']:.3f} ms"
            )
    if args.out is not None:
        rec = {
            "command": " ".join(["python", "-m", "bench.scheduler_host", *(argv or sys.argv[1:])]),
            "note": "engine-level host time on a CPU, fake runner; a diagnostic",
            "machine": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "rows": rows,
        }
        # The revision of the scheduler that ran (an older tree on PYTHONPATH for an A/B),
        # not of this file's checkout.
        import subprocess

        import runtime

        tree = Path(runtime.__file__).resolve().parents[1]
        try:
            rev = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=tree
            ).stdout.strip()
        except OSError:
            rev = ""
        rec["git_revision"] = rev or None
        rec["runtime_tree"] = str(tree)
        args.out.write_text(json.dumps(rec, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
