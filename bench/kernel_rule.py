"""How close the backend's FA2/FA3 rule for merged steps (`prefill_on_fa2`) comes to the
faster kernel, on `bench.mixed_step` results that timed each step both ways: an engine-level
diagnostic, read off recorded files (no GPU needed).

    python -m bench.kernel_rule bench/results/mixed-step-2026-12-06-08d613e/*.json \\
        bench/results/mixed-step-2026-12-06-22053ec/*.json

A point counts when its step merged (the chunk and the decodes in one forward) under every
timing used. Its FA2 time is the `fa2` variant's, or `served`'s where the served plan ran FA2;
its FA3 time the `fa3` variant's, or `served`'s where it ran FA3. The rule is asked with the
step's shape as the point records it (a chunk of `u` tokens after the context, `k` decodes of
the decode context + 1), the model's heads from its preset (a random:<preset> model), and
the SM count given (132: H100 / H200). Prints the worst points (each one's pick over the
faster time) and the pick's total over the faster total, FA2 always and FA3 always beside
it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def merged_points(path: Path) -> list[dict[str, Any]]:
    """The points of one mixed_step file that carry an FA2 and an FA3 time of a merged step."""
    from runtime.model.loader import RANDOM_PREFIX
    from runtime.model.presets import get_preset

    rec = json.loads(path.read_text())
    eng, setup = rec["engine"], rec["setup"]
    if not eng["model"].startswith(RANDOM_PREFIX):
        raise SystemExit(f"{path}: heads known for random:<preset> models only, not {eng['model']}")
    cfg = get_preset(eng["model"][len(RANDOM_PREFIX) :])
    out = []
    for p in rec["points"]:
        variants = p.get("variants") or {}
        timed = {n: e for n, e in variants.items() if "device_ms_median" in e}
        served = timed.get("served")
        times: dict[str, float] = {}
        for kernel in ("fa2", "fa3"):
            if kernel in timed:
                times[kernel] = timed[kernel]["device_ms_median"]
        if served is not None and served.get("attention"):
            kernel = "fa2" if served["attention"]["mode"] == "paged_fa2" else "fa3"
            times.setdefault(kernel, served["device_ms_median"])
        used = [timed[n] for n in ("served", "fa2", "fa3") if n in timed]
        if len(times) < 2 or not all(e.get("merged") for e in used):
            continue
        out.append(
            {
                "file": path.name,
                "u": p["u"],
                "k": p["k"],
                "context": setup["context_tokens"],
                "decode_kv": setup["decode_context_tokens"] + 1,
                "num_q_heads": cfg.num_q_heads,
                "num_kv_heads": cfg.num_kv_heads,
                "page_size": eng["block_size"],
                **times,
            }
        )
    return out


def report(paths: list[Path], num_sms: int) -> dict[str, Any]:
    """Each point's pick and the totals (module docstring)."""
    from runtime.attention.flashinfer_backend import prefill_on_fa2

    rows = []
    for path in paths:
        for p in merged_points(path):
            query = [p["u"]] + [1] * p["k"]
            kv = [p["context"] + p["u"]] + [p["decode_kv"]] * p["k"]
            fa2 = prefill_on_fa2(
                query, kv, p["num_q_heads"], p["num_kv_heads"], num_sms, p["page_size"]
            )
            best = min(p["fa2"], p["fa3"])
            rows.append(
                {
                    **p,
                    "pick": "fa2" if fa2 else "fa3",
                    "over_best": p["fa2" if fa2 else "fa3"] / best,
                }
            )
    if not rows:
        raise SystemExit("no merged point with both an FA2 and an FA3 time in these files")
    best = sum(min(r["fa2"], r["fa3"]) for r in rows)
    return {
        "num_points": len(rows),
        "rule_total_over_best": sum(r[r["pick"]] for r in rows) / best,
        "fa2_total_over_best": sum(r["fa2"] for r in rows) / best,
        "fa3_total_over_best": sum(r["fa3"] for r in rows) / best,
        "rule_worst": max(r["over_best"] for r in rows),
        "fa2_worst": max(r["fa2"] / min(r["fa2"], r["fa3"]) for r in rows),
        "fa3_worst": max(r["fa3"] / min(r["fa2"], r["fa3"]) for r in rows),
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path, help="bench.mixed_step result files")
    ap.add_argument("--num-sms", type=int, default=132, help="the GPU's SMs (H100/H200: 132)")
    args = ap.parse_args(argv)
    rep = report(args.files, args.num_sms)
    for r in sorted(rep["rows"], key=lambda r: -r["over_best"])[:8]:
        print(
            f"{r['file']}: u={r['u']} k={r['k']} fa2 {r['fa2']:.2f} fa3 {r['fa3']:.2f} ms, "
            f"picks {r['pick']} ({r['over_best']:.3f}x the faster)"
        )
    print(json.dumps({k: v for k, v in rep.items() if k != "rows"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
