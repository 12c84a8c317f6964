"""Which terms the time of a mixed step needs: fits on an engine's step trace (issue 13).

The TBT cut predicts a step that mixes prefill with decodes as the recent decode step plus an
affine correction of the JCT model's marginal prefill cost (`runtime.scheduler.CorrectedCost`).
On the H200 its mean was right and single steps were far off (measured / predicted P99 1.45-4.1),
so the cut cannot hold a P99 target. This reads step traces (`GET /admin/api/steps`;
`bench.gpu_serving` saves one per side as `*.steps.json`), keeps the mixed whole-GPU steps, and
compares models of their device time fitted by least squares on half the steps and scored on
the other half (even / odd positions):

  engine         what the cut predicted (`predicted_ms`: the engine's own model, as it ran)
  prefill        a + b * prefill tokens
  +attention     ... + c * prefill attention pairs (sum of n * (context + n / 2))
  +decodes       ... + d * decodes + e * decode context tokens

Per model: MAPE and the P50 / P90 / P99 of measured / predicted. A term that shrinks the P99
is one the cut lacks.

    python -m bench.step_fit run/*.steps.json [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

# Model name -> the step fields that are its features (a constant term is always added).
MODELS: dict[str, tuple[str, ...]] = {
    "prefill": ("num_prefill_tokens",),
    "+attention": ("num_prefill_tokens", "prefill_attention_pairs"),
    "+decodes": (
        "num_prefill_tokens",
        "prefill_attention_pairs",
        "num_decodes",
        "decode_context_tokens",
    ),
}


def mixed_steps(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Steps with decodes and prefill tokens, on the whole GPU, with a device time."""
    return [
        s
        for s in steps
        if s.get("num_decodes")
        and s.get("num_prefill_tokens")
        and not s.get("on_split")
        and s.get("device_ms") is not None
    ]


def ratio_summary(measured: np.ndarray, predicted: np.ndarray) -> dict[str, float | int]:
    """MAPE and quantiles of measured / predicted (predictions <= 0 are left out)."""
    ok = predicted > 0
    m, p = measured[ok], predicted[ok]
    if len(m) == 0:
        return {"num_steps": 0}
    r = m / p
    return {
        "num_steps": int(len(m)),
        "mape": float(np.mean(np.abs(m - p) / m)),
        "ratio_p50": float(np.quantile(r, 0.5)),
        "ratio_p90": float(np.quantile(r, 0.9)),
        "ratio_p99": float(np.quantile(r, 0.99)),
    }


HOST_GAP_MS = 20.0  # a device idle this long before a step is a host stall, not scheduling


def host_gaps(steps: list[dict[str, Any]], over_ms: float = HOST_GAP_MS) -> dict[str, Any]:
    """The host's long gaps (device idle before a step over `over_ms`): how many, the longest,
    and how many came with a collector pause (the step's `gc_ms`, where traced) of at least
    half the gap."""
    gaps = [s for s in steps if (s.get("idle_before_ms") or 0.0) > over_ms]
    with_gc = [s for s in gaps if (s.get("gc_ms") or 0.0) >= 0.5 * s["idle_before_ms"]]
    return {
        "over_ms": over_ms,
        "num_gaps": len(gaps),
        "max_gap_ms": max((s["idle_before_ms"] for s in gaps), default=None),
        "num_with_gc_pause": len(with_gc),
        "gc_traced": any("gc_ms" in s for s in steps),
    }


def fit(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The comparison for one set of steps (see the module docstring), and the host gaps."""
    mixed = mixed_steps(steps)
    out: dict[str, Any] = {
        "num_steps": len(steps),
        "num_mixed_steps": len(mixed),
        "host_gaps": host_gaps(steps),
    }
    if len(mixed) < 8:
        out["error"] = "fewer than 8 mixed whole-GPU steps"
        return out
    y = np.array([s["device_ms"] for s in mixed], dtype=float)
    test = np.arange(len(mixed)) % 2 == 1
    models: dict[str, Any] = {}
    engine = np.array([s.get("predicted_ms") or 0.0 for s in mixed], dtype=float)
    models["engine"] = ratio_summary(y[test], engine[test])
    for name, fields in MODELS.items():
        x = np.array([[1.0] + [float(s.get(f) or 0.0) for f in fields] for s in mixed])
        coef, *_ = np.linalg.lstsq(x[~test], y[~test], rcond=None)
        models[name] = {
            **ratio_summary(y[test], x[test] @ coef),
            "coefficients": dict(zip(("const_ms", *fields), map(float, coef), strict=True)),
        }
    out["models"] = models
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.step_fit", description=__doc__)
    ap.add_argument("files", nargs="+", type=Path, help="step traces (*.steps.json)")
    ap.add_argument("--json", type=Path, help="write the results here too")
    args = ap.parse_args(argv)
    results: dict[str, Any] = {}
    for path in args.files:
        data = json.loads(path.read_text())
        res = fit(data["steps"] if isinstance(data, dict) else data)
        results[path.name] = res
        print(f"{path.name}: {res['num_mixed_steps']} mixed steps of {res['num_steps']}")
        g = res["host_gaps"]
        gc_note = f", {g['num_with_gc_pause']} with a collector pause" if g["gc_traced"] else ""
        longest = "-" if g["max_gap_ms"] is None else f"{g['max_gap_ms']:.1f} ms"
        print(f"  host gaps over {g['over_ms']:g} ms: {g['num_gaps']} (longest {longest}){gc_note}")
        if "error" in res:
            print(f"  {res['error']}")
            continue
        for name, m in res["models"].items():
            if not m.get("num_steps"):
                print(f"  {name:<11} no predictions")
                continue
            print(
                f"  {name:<11} MAPE {m['mape']:.3f}  measured/predicted P50 {m['ratio_p50']:.2f} "
                f"P90 {m['ratio_p90']:.2f} P99 {m['ratio_p99']:.2f}"
            )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
