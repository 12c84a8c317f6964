"""The longest scoring prompt a running server takes (issue 18's workload d): bisection over
prompt lengths, one scoring request per probe (fresh random token ids each time, so no probe
is served from the prefix cache), success = HTTP 200 with a score.

    python -m bench.peer.longest_prompt --url URL --server greenlane|vllm --lo 8192 --hi 262144 \
        --step 1024 --out JSON

Both servers get the same probes (same seed, same lengths while their answers agree). A failed
probe's error (HTTP status and message: too long for the context, out of memory, ...) is kept.
The server must stay up: a probe that kills it ends the search (recorded).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.serve import SERVER_APIS

LABELS = [13, 14]


def probe(client: httpx.Client, url: str, path: str, model: str, n: int, seed: int) -> dict:
    rng = random.Random(f"{seed}:{n}")
    ids = [rng.randrange(100, 40_000) for _ in range(n)]
    body = {
        "model": model,
        "query": ids[:-8],
        "items": [ids[-8:]],
        "label_token_ids": LABELS,
        "apply_softmax": True,
    }
    t0 = time.perf_counter()
    try:
        resp = client.post(f"{url}{path}", json=body)
    except httpx.HTTPError as exc:
        return {"tokens": n, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    dt = time.perf_counter() - t0
    ok = resp.status_code == 200
    out: dict[str, Any] = {"tokens": n, "ok": ok, "status": resp.status_code, "s": round(dt, 3)}
    if not ok:
        out["error"] = resp.text[:300]
    return out


def healthy(client: httpx.Client, url: str) -> bool:
    try:
        return client.get(f"{url}/health", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def search(url: str, server: str, lo: int, hi: int, step: int, seed: int, timeout_s: float) -> dict:
    path = SERVER_APIS[server].score_path
    probes: list[dict] = []
    with httpx.Client(timeout=timeout_s) as client:
        model = client.get(f"{url}/v1/models").json()["data"][0]["id"]
        first = probe(client, url, path, model, lo, seed)
        probes.append(first)
        if not first["ok"]:
            return {"max_ok_tokens": None, "probes": probes, "note": "the lower bound failed"}
        good, bad = lo, hi + step
        top = probe(client, url, path, model, hi, seed)
        probes.append(top)
        if top["ok"]:
            good = hi
        while bad - good > step:
            mid = (good + bad) // 2 // step * step
            if mid <= good:
                break
            r = probe(client, url, path, model, mid, seed)
            probes.append(r)
            if not healthy(client, url):
                return {"max_ok_tokens": good, "probes": probes, "note": "server died"}
            if r["ok"]:
                good = mid
            else:
                bad = mid
    return {"max_ok_tokens": good, "first_failure": bad if bad <= hi else None, "probes": probes}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peer.longest_prompt")
    p.add_argument("--url", required=True)
    p.add_argument("--server", choices=sorted(SERVER_APIS), required=True)
    p.add_argument("--lo", type=int, default=8192)
    p.add_argument("--hi", type=int, default=262_144)
    p.add_argument("--step", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per probe")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    res = search(
        args.url.rstrip("/"), args.server, args.lo, args.hi, args.step, args.seed, args.timeout
    )
    res.update(server=args.server, url=args.url, lo=args.lo, hi=args.hi, step=args.step)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(
        f"{args.server}: longest scoring prompt {res['max_ok_tokens']} tokens "
        f"({len(res['probes'])} probes)",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
