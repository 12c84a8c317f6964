"""What a client that gives up on a long scoring prompt costs the next one, through HTTP.

A running server; per repeat:
  1. a long `/v1/score` (random token ids, cold: fresh ids each time) run to its end: `whole_s`;
  2. the same length again, abandoned by its client after `--leave-after` × whole_s (the HTTP
     connection closes; the server aborts the request), and at once a short score request:
     `next_s` is that short request's latency, `freed_s` the time until the server's
     `/metrics` shows no running request and no KV block in use (sampled every 20 ms; the
     server's stats refresh every ~0.2 s, so it resolves no finer).
Before the engine could stop a step part-way, the short request waited for the rest of the
abandoned prompt: next_s ≈ (1 - leave_after) × whole_s.

    python -m bench.abandoned --url http://127.0.0.1:8000 --num-tokens 4096 --repeats 2 \
        --json bench/results/abandoned-<model>-<date>-<rev>.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import statistics
import sys
import time
from typing import Any

import httpx

from bench.serve import git_revision, machine_info, prometheus_samples

LABELS = [11, 22, 33]


def score_body(model: str, ids: list[int]) -> dict[str, Any]:
    # The prompt as the query, one one-token item: the whole prompt is one scoring request.
    return {"model": model, "query": ids[:-1], "items": [ids[-1:]], "label_token_ids": LABELS}


async def running_and_used(client: httpx.AsyncClient) -> tuple[float, float]:
    r = await client.get("/metrics")
    r.raise_for_status()
    got = {name: value for name, _, value in prometheus_samples(r.text)}
    return got.get("greenlane_running_requests", 0.0), got.get("greenlane_kv_blocks_used", 0.0)


async def one_repeat(
    client: httpx.AsyncClient, model: str, num_tokens: int, leave_after: float, rng: random.Random
) -> dict[str, Any]:
    def ids(n: int) -> list[int]:
        return [rng.randrange(100, 30_000) for _ in range(n)]

    t0 = time.monotonic()
    r = await client.post("/v1/score", json=score_body(model, ids(num_tokens)), timeout=None)
    r.raise_for_status()
    whole_s = time.monotonic() - t0

    leave_s = leave_after * whole_s
    abandoned = asyncio.create_task(
        client.post("/v1/score", json=score_body(model, ids(num_tokens)), timeout=None)
    )
    await asyncio.sleep(leave_s)
    abandoned.cancel()  # closes the connection: what a client timeout does
    t_left = time.monotonic()
    try:
        await abandoned
    except (asyncio.CancelledError, httpx.HTTPError):
        pass
    nxt = asyncio.create_task(client.post("/v1/score", json=score_body(model, ids(64))))
    freed_s = None
    while freed_s is None and time.monotonic() - t_left < 10 * whole_s + 30:
        running, used = await running_and_used(client)
        if running == 0 and used == 0:
            freed_s = time.monotonic() - t_left
        else:
            await asyncio.sleep(0.02)
    r = await nxt
    r.raise_for_status()
    next_s = time.monotonic() - t_left
    return {
        "whole_s": round(whole_s, 3),
        "left_after_s": round(leave_s, 3),
        "next_s": round(next_s, 3),
        "freed_s": None if freed_s is None else round(freed_s, 3),
        "rest_of_prompt_s": round(whole_s - leave_s, 3),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    async with httpx.AsyncClient(base_url=args.url, timeout=60) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        # Warm-up: the long forms' first use is not what is measured.
        await client.post("/v1/score", json=score_body(model, [5] * 8), timeout=None)
        repeats = [
            await one_repeat(client, model, args.num_tokens, args.leave_after, rng)
            for _ in range(args.repeats)
        ]
    ratios = [r["next_s"] / r["rest_of_prompt_s"] for r in repeats]
    return {
        "what": "next request's latency after a client abandons a long scoring prompt (HTTP)",
        "command": " ".join(sys.argv),
        **git_revision(),  # of this client's tree
        "server_revision": args.server_revision,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "num_tokens": args.num_tokens,
        "leave_after": args.leave_after,
        "repeats": repeats,
        "next_over_rest_of_prompt": {
            "median": round(statistics.median(ratios), 3),
            "min": round(min(ratios), 3),
            "max": round(max(ratios), 3),
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--num-tokens", type=int, default=4096)
    p.add_argument("--leave-after", type=float, default=0.25, help="fraction of whole_s")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-revision", help="the server's revision, as its operator knows it")
    p.add_argument("--json", help="write the record here")
    args = p.parse_args(argv)
    record = asyncio.run(main_async(args))
    for r in record["repeats"]:
        print(
            f"whole {r['whole_s']:.2f} s, left after {r['left_after_s']:.2f} s: next request "
            f"{r['next_s']:.2f} s (rest of the prompt {r['rest_of_prompt_s']:.2f} s), "
            f"freed after {r['freed_s']} s"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
