"""Where the chunked step's prediction misses: a server's mixed steps by the path they ran.

    python -m bench.chunked_paths DIR/qwen2.5-3b-*.steps.json [--chunk-tokens 2048] \\
        [--graph-max-tokens 1024] [--stream-rows-above 8192] [--source RESULTS.json] \\
        [--out summary.json]

CPU only. Input: the `*.steps.json` files `bench/gpu_serving.py` saves (the engine's step
trace, `runtime/engine.py` STEP_TRACE_FIELDS), one per side. Every whole-GPU step with prefill
tokens and a measured device time is put in the path the runner took at the revision that
recorded it (`Runner._mergeable`, `LlamaForCausalLM.forward_layers`):
  merged   prefill rows + decodes fit a prefill graph bucket (<= --graph-max-tokens)
  plain    the prefill part alone, one eager forward (<= --chunk-tokens)
  rows     one sequence over --chunk-tokens and --stream-rows-above: streaming rows
  whole_t  otherwise over --chunk-tokens: hybrid prefill attending all rows at once
Per side and path: steps, ms per 1,000 prefill tokens, measured / predicted (the TBT cut's
`predicted_ms`, where the side had one), the MAPE of that prediction, and the MAPE of the same
prediction times a per-path factor learned causally (an EMA of measured / predicted per path,
weight 0.2, scored before it updates, as `CostModel.observe` scores): what a path-aware
correction would have done on these steps. A replay over recorded steps, not a live figure.
Also, per side, the long chunk steps (over --graph-max-tokens prefill tokens, beside decodes):
their planned (`predicted_ms`) and measured medians; on a side with a TBT cut these are the
steps it sized, and the medians say whether it filled its aim (`long_steps`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

EMA = 0.2


def path_of(
    step: dict[str, Any], chunk_tokens: int, graph_max_tokens: int, stream_rows_above: int = 0
) -> str:
    """`stream_rows_above`: 0 for traces recorded before `4f81294` (one prompt over the chunk
    always streamed rows), the server's prefill budget after it."""
    n = step["num_prefill_tokens"]
    if n + step["num_decodes"] <= graph_max_tokens:
        return "merged"
    if n <= chunk_tokens:
        return "plain"
    return "rows" if step["num_prefill_seqs"] == 1 and n > stream_rows_above else "whole_t"


def summarize(
    steps: list[dict[str, Any]],
    chunk_tokens: int,
    graph_max_tokens: int,
    stream_rows_above: int = 0,
) -> dict:
    """One side's steps (trace order: oldest first) -> per-path figures and the overall MAPE
    of the engine's prediction and of the per-path-corrected one."""
    rows = [
        s
        for s in steps
        if s.get("device_ms") and s.get("num_prefill_tokens") and not s.get("on_split")
    ]
    factor: dict[str, float] = {}
    by_path: dict[str, dict[str, list[float]]] = {}
    engine_err, path_err = [], []
    for s in rows:
        k = path_of(s, chunk_tokens, graph_max_tokens, stream_rows_above)
        d = by_path.setdefault(k, {"ms_per_ktok": [], "ratio": [], "err": [], "err_path": []})
        m = s["device_ms"]
        d["ms_per_ktok"].append(1e3 * m / s["num_prefill_tokens"])
        p = s.get("predicted_ms")
        if not p:
            continue
        f = factor.get(k, 1.0)
        d["ratio"].append(m / p)
        d["err"].append(abs(p - m) / m)
        d["err_path"].append(abs(p * f - m) / m)
        engine_err.append(d["err"][-1])
        path_err.append(d["err_path"][-1])
        factor[k] = (1 - EMA) * f + EMA * m / p

    def q(xs: list[float]) -> list[float] | None:
        return [round(float(v), 3) for v in np.percentile(xs, [10, 50, 90])] if xs else None

    def mean(xs: list[float]) -> float | None:
        return round(float(np.mean(xs)), 4) if xs else None

    # Long chunk steps: beside decodes, over the prefill graphs' range (a TBT cut sizes them).
    cut = [
        s
        for s in rows
        if s.get("predicted_ms") and s["num_decodes"] and s["num_prefill_tokens"] > graph_max_tokens
    ]

    def median(xs: list[float]) -> float | None:
        return round(float(np.median(xs)), 2) if xs else None

    return {
        "long_steps": {
            "num_steps": len(cut),
            "planned_ms_p50": median([s["predicted_ms"] for s in cut]),
            "measured_ms_p50": median([s["device_ms"] for s in cut]),
        },
        "num_steps": len(rows),
        "num_predicted": len(engine_err),
        "mape_engine": mean(engine_err),
        "mape_per_path_factor": mean(path_err),
        "paths": {
            k: {
                "num_steps": len(d["ms_per_ktok"]),
                "ms_per_ktok_p10_50_90": q(d["ms_per_ktok"]),
                "measured_over_predicted_p10_50_90": q(d["ratio"]),
                "mape_engine": mean(d["err"]),
                "mape_per_path_factor": mean(d["err_path"]),
            }
            for k, d in sorted(by_path.items())
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("steps", nargs="+", help="*.steps.json files, one per side")
    ap.add_argument("--chunk-tokens", type=int, default=2048, help="--prefill-chunk-tokens")
    ap.add_argument("--graph-max-tokens", type=int, default=1024, help="prefill graph buckets")
    ap.add_argument(
        "--stream-rows-above",
        type=int,
        default=0,
        help="one prompt streams rows past this many tokens: 0 before 4f81294, the server's "
        "--prefill-token-budget (8192) after",
    )
    ap.add_argument(
        "--source",
        type=Path,
        help="the run's results JSON: its git revision, device and date are copied into --out",
    )
    ap.add_argument("--out", help="write the summary JSON here")
    args = ap.parse_args(argv)
    out: dict[str, Any] = {
        "command": "python -m bench.chunked_paths "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "note": "replay over recorded steps (CPU), not a live figure",
    }
    if args.source is not None:
        src = json.loads(args.source.read_text())
        out["source"] = (
            f"the step traces of {args.source.name} (its serving tarball, not committed)"
        )
        out.update({k: src.get(k) for k in ("git_revision", "device", "date")})
    out["sides"] = {}
    for f in args.steps:
        data = json.loads(Path(f).read_text())
        steps = data["steps"] if isinstance(data, dict) else data
        # The trace is newest-last by `age_s` (seconds before it was read): oldest first.
        steps = sorted(steps, key=lambda s: -s.get("age_s", 0.0))
        side = Path(f).name.removesuffix(".steps.json")
        out["sides"][side] = r = summarize(
            steps, args.chunk_tokens, args.graph_max_tokens, args.stream_rows_above
        )
        print(
            f"{side}: {r['num_predicted']} predicted steps, MAPE {r['mape_engine']} engine, "
            f"{r['mape_per_path_factor']} with a per-path factor"
        )
        ls = r["long_steps"]
        print(
            f"  long chunk steps (> {args.graph_max_tokens} prefill tokens, beside decodes): "
            f"n={ls['num_steps']} planned P50 {ls['planned_ms_p50']} ms, "
            f"measured P50 {ls['measured_ms_p50']} ms"
        )
        for k, p in r["paths"].items():
            print(
                f"  {k:8s} n={p['num_steps']:4d} ms/ktok {p['ms_per_ktok_p10_50_90']} "
                f"measured/predicted {p['measured_over_predicted_p10_50_90']} "
                f"MAPE {p['mape_engine']} -> {p['mape_per_path_factor']}"
            )
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
