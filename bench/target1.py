"""Issue 13's first target, read strictly, from a serving run's results JSON.

    python -m bench.target1 RESULTS.json [RESULTS.json ...] [--json]

CPU only. For each model's workload (and scoring beside chat) and each side named `auto*`
(`auto`, `auto-2k`, ...): at every probe that side and the baselines (sides named `off*`)
both ran, the side against the best baseline figure by figure (`best-per-figure`, or the one
baseline when one ran): P99 gap between tokens (beside scoring: the background chat's), TTFT
P50 (scoring: its latency) and total tokens/s; whether all three are within 5 % at once
(`within_target`); and whether the side passed its SLO there (`passed`: the probe's QPS is at
most the side's max QPS of the bisection). The target asks all three at every load level;
the count that matters is within_target among the probes passed. The ratio arithmetic is
`bench.gpu_serving`'s (`by_probe_checks`), the one the harness records for the side named
`auto` beside scoring."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench.gpu_serving import BEST_PER_FIGURE, by_probe_checks


def _parts(model: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{part name: {side: record}}: each workload, and scoring beside chat."""
    out = {name: w for name, w in (model.get("workloads") or {}).items() if isinstance(w, dict)}
    if isinstance(model.get("score_chat"), dict):
        out["score-chat"] = model["score_chat"]
    return out


def side_checks(part: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{auto side: {qps: ratios, within_target, passed}} against the part's baselines."""
    sides = {k: v for k, v in part.items() if isinstance(v, dict) and v.get("probes")}
    baselines = {k: v for k, v in sides.items() if k.startswith("off")}
    out: dict[str, dict[str, Any]] = {}
    if not baselines:
        return out
    for name, side in sides.items():
        if not name.startswith("auto"):
            continue
        checks = by_probe_checks(baselines, side)
        best = checks[BEST_PER_FIGURE if BEST_PER_FIGURE in checks else next(iter(baselines))]
        top = side.get("max_qps")
        out[name] = {
            q: {**r, "passed": top is not None and float(q) <= float(top)}
            for q, r in best["by_probe"].items()
        }
    return out


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """{model: {part: {side: {"probes": ..., "met": n, "passed": n}}}} for one results JSON."""
    out: dict[str, Any] = {}
    for model_name, model in (results.get("models") or {}).items():
        for part_name, part in _parts(model).items():
            for side, probes in side_checks(part).items():
                passed = [r for r in probes.values() if r["passed"]]
                out.setdefault(model_name, {}).setdefault(part_name, {})[side] = {
                    "probes": probes,
                    "passed": len(passed),
                    "met": sum(r["within_target"] for r in passed),
                }
    return out


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path, nargs="+", help="bench.gpu_serving results JSON")
    ap.add_argument("--json", action="store_true", help="print JSON, not a table")
    args = ap.parse_args(argv)
    every = {str(p): summarize(json.loads(p.read_text())) for p in args.results}
    if args.json:
        print(json.dumps(every, indent=1))
        return 0
    print("file\tmodel\tpart\tside\tqps\tp99_gap\tttft_p50\ttokens\twithin_5pct\tpassed")
    for path, models in every.items():
        for model, parts in models.items():
            for part, sides in parts.items():
                for side, rec in sides.items():
                    for q, r in rec["probes"].items():
                        print(
                            "\t".join(
                                [
                                    Path(path).name,
                                    model,
                                    part,
                                    side,
                                    q,
                                    _fmt(r["p99_tbt_ratio"]),
                                    _fmt(r["p50_ttft_ratio"]),
                                    _fmt(r["total_tokens_ratio"]),
                                    "yes" if r["within_target"] else "no",
                                    "yes" if r["passed"] else "no",
                                ]
                            )
                        )
                    print(f"# {part} {side}: met at {rec['met']} of {rec['passed']} probes passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
