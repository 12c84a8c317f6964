"""Sweeps on the simulator over several seeds, reported as mean and spread (never one seed).

    python -m bench.sim_sweep --workload post-recommendation --sweep cache \
        --values 0.25,0.5,0.75,1,2 --seeds 0,1,2,3,4 --policies fcfs,spf,srjf,srjf-oneshot \
        --prime --out bench/results/sim-honest/cache-post-recommendation-primed.json
    python -m bench.sim_sweep --workload post-recommendation --sweep lambda \
        --values 0,0.01,0.03,0.1,0.3,1 --seeds 0,1,2,3,4 --policies fcfs,srjf --qps 6,9 \
        --prime --out bench/results/sim-honest/lambda-post-recommendation-slo10-primed.json

`--sweep cache`: the KV pool as a fraction of the working set. `--sweep lambda`: SRJF's fairness
offset (FCFS and SPF do not depend on it; they run once per seed as the baseline). Per (value,
policy): max QPS at the P99 SLO (the bench.sim search) and, at each `--qps`, P99 and max latency
(the max is where starvation shows). Per seed, each policy's max QPS over FCFS's (same seed,
same requests): the ratio's mean, min and max are the spread the docs quote. The SLO is fixed
per seed (`--slo-multiple` x the median cold prefill of a mean-length prompt, default 10), the
same for every value.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import UTC, datetime
from typing import Any

from bench.sim import (
    DEFAULT_TOKEN_BUDGET,
    SLO_MULTIPLE,
    SimSetup,
    add_plan_ahead_args,
    add_setup_args,
    plan_ahead_from_args,
    plan_ahead_record,
    run_experiment,
    setup_from_args,
)
from bench.sim_workloads import WORKLOAD_NAMES

SWEEPS = ("cache", "lambda")
# Policies the fairness offset does not change (srjf-slo ages by its SLO, not by lambda).
LAMBDA_FREE = ("fcfs", "spf", "srjf-slo")


def spread(values: list[float]) -> dict[str, float | None]:
    """Mean, sample standard deviation, min and max (None entries when empty)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0}
    return {
        "mean": statistics.fmean(vals),
        "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
        "min": min(vals),
        "max": max(vals),
        "n": len(vals),
    }


def sweep(
    workload: str,
    kind: str,
    values: list[float],
    seeds: list[int],
    policies: list[str],
    *,
    setup: SimSetup,
    qps_list: list[float] | None = None,
    num_requests: int = 1000,
    scale: float = 1.0,
    cache_fraction: float = 0.5,
    fairness_lambda: float | None = None,
    token_budget: int = DEFAULT_TOKEN_BUDGET,
    slo_multiple: float = SLO_MULTIPLE,
    prime: bool = False,
    queue_aware_eviction: bool = False,
    plan_ahead: bool = False,
    plan_lead_s: float | None = None,
    overlap_max_step_s: float | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Run every (value, seed); returns raw per-seed results and the aggregates."""
    if kind not in SWEEPS:
        raise ValueError(f"unknown sweep {kind!r} ({', '.join(SWEEPS)})")
    if "fcfs" not in policies:
        policies = ["fcfs", *policies]  # the baseline of every ratio
    qps_list = qps_list or []
    raw: list[dict[str, Any]] = []
    baseline: dict[int, dict[str, Any]] = {}  # lambda sweep: lambda-free policies per seed
    for value in values:
        for seed in seeds:
            names = list(policies)
            kwargs: dict[str, Any] = {"cache_fraction": cache_fraction}
            if kind == "cache":
                kwargs["cache_fraction"] = value
                kwargs["fairness_lambda"] = fairness_lambda
            else:
                kwargs["fairness_lambda"] = value
                if seed in baseline:
                    names = [p for p in policies if p not in LAMBDA_FREE]
            data = run_experiment(
                workload,
                names,
                qps_list,
                seed=seed,
                num_requests=num_requests,
                scale=scale,
                setup=setup,
                token_budget=token_budget,
                slo_multiple=slo_multiple,
                prime=prime,
                queue_aware_eviction=queue_aware_eviction,
                plan_ahead=plan_ahead,
                plan_lead_s=plan_lead_s,
                overlap_max_step_s=overlap_max_step_s,
                **kwargs,
            )
            if kind == "lambda":
                if seed not in baseline:
                    baseline[seed] = {
                        "max_qps": {
                            p: data["max_qps_at_slo"][p] for p in LAMBDA_FREE if p in names
                        },
                        "results": [r for r in data["results"] if r["policy"] in LAMBDA_FREE],
                    }
                data["max_qps_at_slo"].update(baseline[seed]["max_qps"])
                data["results"] += baseline[seed]["results"]
            row = {
                "value": value,
                "seed": seed,
                "slo_p99_s": data["slo_p99_s"],
                "cache_tokens": data["cache_tokens"],
                "working_set_tokens": data["working_set_tokens"],
                "max_qps_at_slo": data["max_qps_at_slo"],
                "at_qps": {
                    f"{r['policy']}@{r['qps']:g}": {
                        "p99_latency_s": r["p99_latency_s"],
                        "max_latency_s": r["max_latency_s"],
                        "mean_latency_s": r["mean_latency_s"],
                        "cache_hit_token_fraction": r["cache_hit_token_fraction"],
                    }
                    for r in data["results"]
                },
            }
            raw.append(row)
            if progress:
                mq = ", ".join(f"{p} {q:g}" for p, q in row["max_qps_at_slo"].items())
                print(f"{kind}={value:g} seed={seed}: max QPS {mq}", file=sys.stderr, flush=True)
    return {
        "workload": workload,
        "sweep": kind,
        "values": values,
        "seeds": seeds,
        "policies": policies,
        "qps": qps_list,
        "num_requests": num_requests,
        "scale": scale,
        "cache_fraction": cache_fraction if kind == "lambda" else None,
        "fairness_lambda": fairness_lambda if kind == "cache" else None,
        "token_budget": token_budget,
        "slo_multiple": slo_multiple,
        "primed": prime,
        "eviction": "queue-aware" if queue_aware_eviction else "lru",
        "plan_ahead": plan_ahead,
        **plan_ahead_record(plan_ahead, plan_lead_s, overlap_max_step_s),
        **setup.record,
        "raw": raw,
        "aggregate": aggregate(raw, values, policies, qps_list),
    }


def aggregate(
    raw: list[dict[str, Any]], values: list[float], policies: list[str], qps_list: list[float]
) -> list[dict[str, Any]]:
    """Per (value, policy): spread over seeds of max QPS, of its ratio to FCFS (per seed), and
    of P99 / max latency at each fixed QPS."""
    out = []
    for value in values:
        rows = [r for r in raw if r["value"] == value]
        for p in policies:
            qs = [r["max_qps_at_slo"].get(p) for r in rows]
            ratios = [
                r["max_qps_at_slo"][p] / r["max_qps_at_slo"]["fcfs"]
                for r in rows
                if r["max_qps_at_slo"].get("fcfs") and r["max_qps_at_slo"].get(p) is not None
            ]
            entry: dict[str, Any] = {
                "value": value,
                "policy": p,
                "max_qps": spread(qs),
                "max_qps_over_fcfs": spread(ratios),
            }
            for q in qps_list:
                at = [r["at_qps"].get(f"{p}@{q:g}") for r in rows]
                at = [a for a in at if a]
                entry[f"at_{q:g}_qps"] = {
                    key: spread([a[key] for a in at])
                    for key in ("p99_latency_s", "max_latency_s", "cache_hit_token_fraction")
                }
            out.append(entry)
    return out


def markdown(data: dict[str, Any]) -> str:
    """The aggregate as a markdown table: mean [min, max] over seeds."""

    def f(s: dict[str, Any], d: int = 2) -> str:
        if s.get("mean") is None:
            return "-"
        return f"{s['mean']:.{d}f} [{s['min']:.{d}f}, {s['max']:.{d}f}]"

    name = "cache / working set" if data["sweep"] == "cache" else "λ"
    head = f"| {name} | policy | max QPS at SLO | ÷ FCFS (same seed) |"
    sep = "|---|---|---|---|"
    for q in data["qps"]:
        head += f" P99 @ {q:g} QPS (s) | max @ {q:g} QPS (s) |"
        sep += "---|---|"
    lines = [head, sep]
    for e in data["aggregate"]:
        line = (
            f"| {e['value']:g} | {e['policy']} | {f(e['max_qps'])} | {f(e['max_qps_over_fcfs'])} |"
        )
        for q in data["qps"]:
            at = e[f"at_{q:g}_qps"]
            line += f" {f(at['p99_latency_s'])} | {f(at['max_latency_s'])} |"
        lines.append(line)
    n = len(data["seeds"])
    lines.append(f"\nmean [min, max] over {n} seeds ({', '.join(map(str, data['seeds']))}).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.sim_sweep", description=__doc__.split("\n")[0]
    )
    p.add_argument("--workload", choices=WORKLOAD_NAMES, required=True)
    p.add_argument("--sweep", choices=SWEEPS, required=True)
    p.add_argument("--values", required=True, help="comma list (cache fractions or lambdas)")
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--policies", default="fcfs,srjf")
    p.add_argument("--qps", default="", help="fixed loads to report P99 / max latency at")
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--cache-fraction", type=float, default=0.5, help="(lambda sweep)")
    p.add_argument("--fairness-lambda", type=float, help="(cache sweep; default: the policy's)")
    p.add_argument("--prefill-token-budget", type=int, default=DEFAULT_TOKEN_BUDGET)
    p.add_argument(
        "--slo-multiple",
        type=float,
        default=SLO_MULTIPLE,
        help="P99 SLO = this x the median cold prefill of a mean-length prompt",
    )
    p.add_argument("--prime", action="store_true", help="runs start from a primed cache")
    p.add_argument(
        "--eviction",
        choices=("lru", "queue-aware"),
        default="lru",
        help="lru: the engine's rule; queue-aware (a what-if): evict chains no waiting request "
        "would hit first (bench.sim.BlockPrefixCache)",
    )
    add_plan_ahead_args(p)
    add_setup_args(p)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    plan_lead_s, overlap_max_step_s = plan_ahead_from_args(p, args)
    try:
        setup = setup_from_args(args)
    except ValueError as exc:
        p.error(str(exc))
    data = sweep(
        args.workload,
        args.sweep,
        [float(v) for v in args.values.split(",") if v],
        [int(s) for s in args.seeds.split(",") if s],
        [x for x in args.policies.split(",") if x],
        setup=setup,
        qps_list=[float(q) for q in args.qps.split(",") if q],
        num_requests=args.num_requests,
        scale=args.scale,
        cache_fraction=args.cache_fraction,
        fairness_lambda=args.fairness_lambda,
        token_budget=args.prefill_token_budget,
        slo_multiple=args.slo_multiple,
        prime=args.prime,
        queue_aware_eviction=args.eviction == "queue-aware",
        plan_ahead=args.plan_ahead,
        plan_lead_s=plan_lead_s,
        overlap_max_step_s=overlap_max_step_s,
    )
    data["command"] = "python -m bench.sim_sweep " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    from bench.serve import git_revision, machine_info

    # Which code and profile made the numbers (the profile is in data["service"]).
    data["date"] = datetime.now(UTC).isoformat(timespec="seconds")
    data["git"] = git_revision()
    data["machine"] = machine_info()
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    print(markdown(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
