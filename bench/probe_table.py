"""Per-probe latency and throughput of a serving run's sides, from the harness files.

    python -m bench.probe_table DIR --slug qwen2.5-3b [--workloads mixed,score-chat] \\
        [--sides off-2k,off-tbt,auto] [--source partition-s-....json] [--out table.json]

CPU only. Input: the per-side `bench.serve` records (`DIR/<slug>-<workload>-<side>.json`) that
`bench/gpu_serving.py` leaves in its serving tarball; its results JSON keeps only the mean
and P99 of TTFT. Per workload, QPS and side: TTFT P50 / P99 (a scoring request's latency),
ITL P50 / P99 (streamed tokens only), output and total tokens/s, SLO attainment, failures;
for scoring next to chat, the background chat's ITL P50 / P99 at that probe from the results
JSON (`--source`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def probe_rows(d: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """One `bench.serve` record -> {qps: figures}."""
    rows = {}
    for run in d["runs"]:
        m = run["metrics"]
        itl = m.get("itl_ms") or {}
        rows[str(run["qps"])] = {
            "ttft_ms_p50": m["ttft_ms"]["median"],
            "ttft_ms_p99": m["ttft_ms"]["p99"],
            "itl_ms_p50": itl.get("median"),
            "itl_ms_p99": itl.get("p99"),
            "output_tokens_per_s": m["output_throughput"],
            "total_tokens_per_s": m["total_token_throughput"],
            "request_throughput": m["request_throughput"],
            "slo_attainment": m.get("slo_attainment"),
            "completed": m["completed"],
            "failed": m["failed"],
        }
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir", type=Path)
    p.add_argument("--slug", required=True, help="the model's slug, e.g. qwen2.5-3b")
    p.add_argument("--workloads", default="mixed,score-chat")
    p.add_argument("--sides", default="off-2k,off-tbt,auto")
    p.add_argument("--source", type=Path, help="the run's results JSON (chat beside scoring)")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    source = json.loads(a.source.read_text()) if a.source else None
    table: dict[str, Any] = {}
    for wl in a.workloads.split(","):
        for side in a.sides.split(","):
            f = a.dir / f"{a.slug}-{wl}-{side}.json"
            if not f.exists():
                continue
            rows = probe_rows(json.loads(f.read_text()))
            if source is not None and wl == "score-chat":
                part = source["models"][f"random:{a.slug}"]["score_chat"]
                if side not in part:  # another call's side: its own results JSON has it
                    sys.exit(f"{side} is not in {a.source}; pass the results JSON of its run")
                bg = part[side].get("chat_background_by_probe", {})
                for qps, row in rows.items():
                    tbt = (bg.get(qps) or {}).get("tbt_ms") or {}
                    row["chat_itl_ms_p50"], row["chat_itl_ms_p99"] = tbt.get("p50"), tbt.get("p99")
            table.setdefault(wl, {})[side] = rows
            for qps, row in rows.items():
                print(
                    f"{wl} {side} {qps}: "
                    + ", ".join(
                        f"{k} {v:.4g}" for k, v in row.items() if isinstance(v, (int, float))
                    )
                )
    out = {
        "command": " ".join(["python", "-m", "bench.probe_table", *(argv or sys.argv[1:])]),
        "note": "from the harness records of the run's serving tarball (not committed)",
        "workloads": table,
    }
    if source is not None:
        out.update({k: source.get(k) for k in ("git_revision", "device", "date")})
    if a.out:
        a.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
