"""A/B comparison of two server configurations on one workload.

`python -m bench.compare --url-a URL --url-b URL --workload NAME --rounds K --qps Q ...`

In each round both servers get the same requests at the same arrival times (round i draws its
requests with seed + i), in the order A B, B A, A B, ... (balanced pairs, so slow drift of the
machine does not favour one side). Point A and B at two servers: on one server, the second side
of a round would find the first side's prompts in the prefix cache. Printed: each metric's mean over rounds for A and B, the
ratio B/A, and the range of per-round ratios (how noisy it is). The tool for "auto vs off",
"srjf vs fcfs": start two servers with the two settings and point A and B at them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from bench.metrics import SLO
from bench.serve import (
    ClientOptions,
    add_common_args,
    git_revision,
    machine_info,
    make_plan,
    options_from_args,
    parse_qps,
    resolve_model,
    run_once,
    run_record,
    server_info,
    warm_up,
    workload_record,
)
from bench.workloads import WorkloadGenerator, load_tokenizer

# (label, path into metrics); ratios are B / A.
COMPARED: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("TTFT mean (ms)", ("ttft_ms", "mean")),
    ("TTFT P99 (ms)", ("ttft_ms", "p99")),
    ("TPOT mean (ms)", ("tpot_ms", "mean")),
    ("TPOT P99 (ms)", ("tpot_ms", "p99")),
    ("ITL P99 (ms)", ("itl_ms", "p99")),
    ("E2EL mean (ms)", ("e2el_ms", "mean")),
    ("E2EL P99 (ms)", ("e2el_ms", "p99")),
    ("request throughput (req/s)", ("request_throughput",)),
    ("output throughput (tok/s)", ("output_throughput",)),
    ("goodput (req/s)", ("goodput",)),
    ("failed", ("failed",)),
)


def _get(metrics: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = metrics
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return None if value is None else float(value)


def summarize_ab(rounds_a: list[dict[str, Any]], rounds_b: list[dict[str, Any]]) -> list[dict]:
    """Per compared metric: mean over rounds of A and B, B/A of the means, per-round ratio range."""
    rows = []
    for label, path in COMPARED:
        a = [_get(m, path) for m in rounds_a]
        b = [_get(m, path) for m in rounds_b]
        if all(v is None for v in a + b):
            continue
        a_ok = [v for v in a if v is not None]
        b_ok = [v for v in b if v is not None]
        mean_a = float(np.mean(a_ok)) if a_ok else None
        mean_b = float(np.mean(b_ok)) if b_ok else None
        per_round = [y / x for x, y in zip(a, b, strict=True)
                     if x is not None and y is not None and x > 0]
        rows.append({
            "metric": label,
            "a": mean_a,
            "b": mean_b,
            "ratio_b_over_a": (mean_b / mean_a) if mean_a and mean_b is not None else None,
            "round_ratio_min": min(per_round) if per_round else None,
            "round_ratio_max": max(per_round) if per_round else None,
        })
    return rows


def format_table(rows: list[dict[str, Any]], name_a: str, name_b: str) -> str:
    def f(v: float | None, d: int = 2) -> str:
        return "-" if v is None else f"{v:.{d}f}"

    lines = [f"| metric | {name_a} (A) | {name_b} (B) | B/A | per-round B/A |",
             "|---|---|---|---|---|"]
    for r in rows:
        spread = (f"{f(r['round_ratio_min'], 3)}..{f(r['round_ratio_max'], 3)}"
                  if r["round_ratio_min"] is not None else "-")
        lines.append(f"| {r['metric']} | {f(r['a'])} | {f(r['b'])} "
                     f"| {f(r['ratio_b_over_a'], 3)} | {spread} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.compare",
                                description=__doc__.split("\n")[0])
    p.add_argument("--url-a", required=True)
    p.add_argument("--url-b", required=True)
    p.add_argument("--name-a", default="A")
    p.add_argument("--name-b", default="B")
    add_common_args(p)
    p.add_argument("--qps", required=True, help="one rate (or 'inf')")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", help="result JSON path")
    p.add_argument("--plot", help="PNG: both configurations' latencies (one point per round)")
    return p


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    qps_values = parse_qps(args.qps)
    if len(qps_values) != 1:
        raise SystemExit("bench.compare takes one --qps value")
    qps = qps_values[0]
    slo = SLO.parse(args.slo)
    tok = load_tokenizer(args.tokenizer)
    gen = WorkloadGenerator(args.workload, tok, args.seed, args.scale)
    sides: dict[str, dict[str, Any]] = {}
    for side, url in (("a", args.url_a), ("b", args.url_b)):
        opts: ClientOptions = options_from_args(args, tok)
        info = await server_info(url.rstrip("/"), opts, args.admin_token)
        await resolve_model(url, opts, info)
        await warm_up(url.rstrip("/"), args, tok, opts)
        sides[side] = {"url": url.rstrip("/"), "opts": opts, "server": info, "runs": []}
    for i in range(args.rounds):
        order = ("a", "b") if i % 2 == 0 else ("b", "a")
        # Fresh requests each round (seed + i; A and B get the same ones): repeating identical
        # prompts would turn every round after the first into full prefix-cache hits.
        round_gen = gen if i == 0 else WorkloadGenerator(
            args.workload, tok, args.seed + i, args.scale, pool=gen.pool)
        plan = make_plan(round_gen, args, qps)
        for side in order:
            s = sides[side]
            name = args.name_a if side == "a" else args.name_b
            metrics, _ = await run_once(s["url"], plan.requests, plan.arrivals_s, s["opts"], slo,
                                        label=f"round {i + 1} {name}")
            s["runs"].append(run_record(qps, metrics, plan))
    rows = summarize_ab([r["metrics"] for r in sides["a"]["runs"]],
                        [r["metrics"] for r in sides["b"]["runs"]])
    return {
        "tool": "greenlane bench.compare",
        "command": shlex.join([Path(sys.executable).name, "-m", "bench.compare", *sys.argv[1:]]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git": git_revision(),
        "machine": machine_info(),
        "workload": workload_record(gen, args),
        "qps": "inf" if math.isinf(qps) else qps,
        "rounds": args.rounds,
        "slo": slo.as_dict() if slo else None,
        "a": {"name": args.name_a, "server": sides["a"]["server"], "runs": sides["a"]["runs"]},
        "b": {"name": args.name_b, "server": sides["b"]["server"], "runs": sides["b"]["runs"]},
        "comparison": rows,
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    record = asyncio.run(main_async(args))
    print(format_table(record["comparison"], args.name_a, args.name_b))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2, default=str) + "\n")
        print(f"\nwrote {out}", file=sys.stderr)
    if args.plot:
        from bench.plots import plot_latency_vs_qps

        # Rounds sit at the same QPS: plotted as points at that QPS, one colour per side.
        plot_latency_vs_qps({args.name_a: record["a"]["runs"], args.name_b: record["b"]["runs"]},
                            args.plot, title=f"{args.workload}: {args.name_a} vs {args.name_b}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
