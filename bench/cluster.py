"""Greenlane on Ray Serve, measured with `bench.serve` through the cluster's ingress (one run):

    python -m bench.cluster --replicas 2 --model random:tiny --scale 0.1 --num-kv-blocks 1000 \
        --num-requests 240 --qps 3 --seed 0 --out bench/results/cluster/cpu-post-2replicas.json

1. Routing: the post-recommendation workload, once through our prefix-affinity router and once
   through Ray's default power-of-two router (each on freshly started replicas, so both start
   with cold caches); `bench.serve` drives the ingress as it would one server. Per side: the
   prefix-cache hit rate summed over the replicas (tokens served from cache / prompt tokens
   looked up, from the replicas' own counters) and `bench.serve`'s latencies.
2. Streaming overhead: streamed chat, one request at a time, alternately straight to a
   Greenlane server (`python -m app serve`, same settings, started by this script) and through
   the ingress; the median inter-token latency of each side and their difference.

The replicas' KV pool (`--num-kv-blocks`) is what makes routing matter: sized to hold about
one replica's share of the users' profiles, so a replica that sees every user (power of two)
evicts profiles it will need again, and one that sees only its own users (affinity) does not.
Stops by itself; the local Ray cluster is loopback-only and shut down at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import socket
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench import serve as bench_serve

REPO_DIR = Path(__file__).resolve().parent.parent


def _replica_counters(url: str) -> dict[str, dict[str, int]]:
    reps = httpx.get(url + "/cluster/replicas", timeout=30).json()["replicas"]
    return {
        rid: {
            "hit": int(s.get("prefix_hit_tokens") or 0),
            "query": int(s.get("prefix_query_tokens") or 0),
        }
        for rid, s in reps.items()
    }


def _wait_fresh_reports(url: str, after_s: float, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reps = httpx.get(url + "/cluster/replicas", timeout=30).json()["replicas"]
        if reps and all(s["reported_at_s"] > after_s for s in reps.values()):
            return
        time.sleep(0.2)
    raise TimeoutError("replica reports did not refresh")


def _serve_args(url: str, args: argparse.Namespace, out: Path, extra: list[str]) -> list[str]:
    return [
        "--url",
        url,
        "--seed",
        str(args.seed),
        "--no-progress",
        "--out",
        str(out),
        *extra,
    ]


async def _bench_serve(argv: list[str]) -> dict[str, Any]:
    record = await bench_serve.main_async(bench_serve.build_parser().parse_args(argv))
    record["command"] = shlex.join(["python", "-m", "bench.serve", *argv])
    return record


def routing_side(router: str, args: argparse.Namespace, replica_settings: dict[str, Any]) -> dict:
    """Deploy `router`'s application, run the workload through it, delete it."""
    from ray import serve

    from app.cluster.cli import deploy
    from app.cluster.config import ClusterConfig

    config = ClusterConfig(
        replica_settings=replica_settings,
        app_name=f"bench-{router}",
        num_replicas=args.replicas,
        replica_num_cpus=1.0,
        replica_num_gpus=args.replica_num_gpus,
        router=router,
        routing_stats_period_s=0.25,
        **({} if args.max_queue_gap is None else {"max_queue_gap": args.max_queue_gap}),
        max_queued_requests=10_000,  # open loop: queueing shows as latency, not 429s
    )
    url = deploy(config, "127.0.0.1", args.port)
    try:
        before = _replica_counters(url)
        serve_out = Path(args.workdir) / f"serve-{router}.json"
        record = asyncio.run(
            _bench_serve(
                _serve_args(
                    url,
                    args,
                    serve_out,
                    [
                        "--workload",
                        "post-recommendation",
                        "--scale",
                        str(args.scale),
                        "--num-requests",
                        str(args.num_requests),
                        "--qps",
                        str(args.qps),
                        "--no-reset-prefix-cache",  # fresh replicas: the caches start cold
                    ],
                )
            )
        )
        _wait_fresh_reports(url, time.time())
        after = _replica_counters(url)
    finally:
        serve.delete(config.app_name)
    per_replica = {
        rid: {
            "hit_tokens": after[rid]["hit"] - before.get(rid, {}).get("hit", 0),
            "query_tokens": after[rid]["query"] - before.get(rid, {}).get("query", 0),
        }
        for rid in after
    }
    hit = sum(r["hit_tokens"] for r in per_replica.values())
    query = sum(r["query_tokens"] for r in per_replica.values())
    m = record["metrics"]
    return {
        "router": router,
        "prefix_cache_hit_rate": hit / query if query else None,
        "per_replica": per_replica,
        "p99_latency_ms": m["e2el_ms"]["p99"],
        "median_latency_ms": m["e2el_ms"]["median"],
        "completed": m["completed"],
        "failed": m["failed"],
        "bench_serve": record,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_direct_server(replica_settings: dict[str, Any], port: int) -> subprocess.Popen:
    flags: list[str] = []
    for key, value in replica_settings.items():
        if value is not None:
            flags += ["--" + key.replace("_", "-"), str(value)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # as a Ray replica with num_cpus=1 runs
    proc = subprocess.Popen(
        [sys.executable, "-m", "app", "serve", "--host", "127.0.0.1", "--port", str(port), *flags],
        cwd=REPO_DIR,
        env=env,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError("the direct server exited")
        time.sleep(0.5)
    proc.terminate()
    raise TimeoutError("the direct server did not start")


def streaming_side_by_side(args: argparse.Namespace, replica_settings: dict[str, Any]) -> dict:
    """Median ITL straight to a server vs through the ingress, alternating, same requests."""
    from ray import serve

    from app.cluster.cli import deploy
    from app.cluster.config import ClusterConfig

    config = ClusterConfig(
        replica_settings=replica_settings,
        app_name="bench-itl",
        num_replicas=1,
        replica_num_cpus=1.0,
        replica_num_gpus=args.replica_num_gpus,
        routing_stats_period_s=1.0,
    )
    ray_url = deploy(config, "127.0.0.1", args.port)
    direct_port = free_port()
    direct = _start_direct_server(replica_settings, direct_port)
    direct_url = f"http://127.0.0.1:{direct_port}"
    rounds: list[dict[str, Any]] = []
    try:
        for round_index in range(args.itl_rounds):
            order = ["direct", "ray"] if round_index % 2 == 0 else ["ray", "direct"]
            for side in order:
                url = direct_url if side == "direct" else ray_url
                out = Path(args.workdir) / f"itl-{side}-{round_index}.json"
                record = asyncio.run(
                    _bench_serve(
                        _serve_args(
                            url,
                            args,
                            out,
                            [
                                "--workload",
                                "sharegpt",
                                "--scale",
                                "0.25",
                                "--num-requests",
                                str(args.itl_requests),
                                "--qps",
                                "inf",
                                "--max-concurrency",
                                "1",
                                "--no-reset-prefix-cache",
                            ],
                        )
                    )
                )
                m = record["metrics"]
                rounds.append(
                    {
                        "round": round_index,
                        "side": side,
                        "itl_median_ms": m["itl_ms"]["median"],
                        "itl_p99_ms": m["itl_ms"]["p99"],
                        "ttft_median_ms": m["ttft_ms"]["median"],
                        "completed": m["completed"],
                        "failed": m["failed"],
                        "command": record["command"],
                    }
                )
    finally:
        direct.terminate()
        direct.wait(30)
        serve.delete(config.app_name)

    def median_of(side: str) -> float:
        vals = sorted(r["itl_median_ms"] for r in rounds if r["side"] == side)
        mid = len(vals) // 2
        return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2

    direct_ms, ray_ms = median_of("direct"), median_of("ray")
    return {
        "rounds": rounds,
        "itl_median_ms_direct": direct_ms,
        "itl_median_ms_through_ray": ray_ms,
        "added_ms": ray_ms - direct_ms,
        "note": "median over rounds of each side's median ITL; one request at a time, so both "
        "sides decode at batch 1 and the difference is the relay's",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--model", default="random:tiny")
    p.add_argument("--num-kv-blocks", type=int, default=1000, help="per replica")
    p.add_argument("--replica-num-gpus", type=float, default=0.0, help="0.5: two share a GPU")
    p.add_argument(
        "--replica-setting",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another `serve` option for every replica and the direct server (repeatable), "
        "e.g. max_gpu_memory_gb=60",
    )
    p.add_argument("--scale", type=float, default=0.1)
    p.add_argument("--num-requests", type=int, default=240)
    p.add_argument("--qps", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--itl-requests", type=int, default=12)
    p.add_argument("--itl-rounds", type=int, default=4)
    p.add_argument("--port", type=int, default=8765, help="the ingress's port (loopback)")
    p.add_argument("--workdir", default="/tmp/greenlane-bench-cluster")
    p.add_argument("--only-streaming", action="store_true", help="skip the routing comparison")
    p.add_argument("--skip-streaming", action="store_true", help="skip the ITL comparison")
    p.add_argument("--max-queue-gap", type=int, default=None, help="affinity bound (default: 8)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    Path(args.workdir).mkdir(parents=True, exist_ok=True)

    import ray

    from app.cluster.cli import connect_ray

    replica_settings: dict[str, Any] = {
        "model": args.model,
        "num_kv_blocks": args.num_kv_blocks,
        "log_level": "warning",
    }
    for item in args.replica_setting:
        key, _, value = item.partition("=")
        replica_settings[key.strip()] = value.strip()
    record: dict[str, Any] = {
        "tool": "greenlane bench.cluster",
        "command": shlex.join(["python", "-m", "bench.cluster", *(argv or sys.argv[1:])]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git": bench_serve.git_revision(),
        "machine": bench_serve.machine_info(),
        "replica_settings": replica_settings,
        "replicas": args.replicas,
    }
    connect_ray(None, num_cpus=args.replicas + 1)
    record["replica_num_gpus"] = args.replica_num_gpus
    try:
        routers = () if args.only_streaming else ("affinity", "power-of-two")
        sides = [routing_side(r, args, replica_settings) for r in routers]
        if not args.skip_streaming:
            record["streaming"] = streaming_side_by_side(args, replica_settings)
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    if sides:
        aff, p2c = sides
        record["routing"] = {
            "sides": sides,
            "hit_rate_ratio": (aff["prefix_cache_hit_rate"] or 0)
            / max(p2c["prefix_cache_hit_rate"] or 0, 1e-9),
            "p99_ratio": aff["p99_latency_ms"] / p2c["p99_latency_ms"],
        }
    record["machine_after"] = {"load_avg_1_5_15_min": [round(x, 2) for x in os.getloadavg()]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1, default=str) + "\n")
    for s in sides:
        print(
            f"{s['router']:>13}: hit rate {s['prefix_cache_hit_rate']:.3f}, P99 "
            f"{s['p99_latency_ms']:.0f} ms, median {s['median_latency_ms']:.0f} ms, "
            f"{s['completed']} ok / {s['failed']} failed"
        )
    if "streaming" in record:
        st = record["streaming"]
        print(
            f"ITL median: direct {st['itl_median_ms_direct']:.2f} ms, through Ray "
            f"{st['itl_median_ms_through_ray']:.2f} ms, added {st['added_ms']:+.2f} ms"
        )
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
