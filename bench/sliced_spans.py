"""What each layer-sliced prompt of a serving run cost, from its probes' step traces.

    python -m bench.sliced_spans DIR/probe-steps/<slug>-score-chat-auto-qps0.25.steps.json \\
        [--whole DIR/probe-steps/<slug>-score-chat-off-4k-qps0.25.steps.json] [--json]

CPU only; engine-level (device times from the step trace, not what a client saw). Input: the
step traces `bench/gpu_serving.py` keeps per probe (`probe-steps/`, the engine's
`/admin/api/steps`). A prompt run in layer slices (or row pieces of a layer) is one row with
`layer_sliced_span_ms`, the time from its first slice to its last; the decode steps that ran
between its slices are the rows that ended inside that span. Per prompt: its tokens, span and
prediction, the other steps inside (count and device time: decodes, and chat prefills merged
with them), the prefill's own share (span less those steps), what those steps waited, and for the decode steps behind a slice what the decision promised them
(`slice_promised_ms`) against what they waited (`decode_gap_ms` + `device_ms`), and the host time of the launch
that started it by part (`launch_parts_ms`, traces since this field) and what the memory
allocator did in it and its slowest forward call (`launch_detail`). With
`--whole`, the same tokens' whole-GPU step in another side's trace (`off` runs a whole
scoring prompt as one step), and the span's ratio to it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

# A step ended inside a span when its age lies within it, give or take this (the trace rounds
# nothing, but the two ends come from different clocks' reads: host time at the result).
_EDGE_S = 1e-3
# How far from a sliced prompt's start the launch that started it may lie (s): a few ms of
# clock mix (`sliced_prompts`); starts come seconds apart.
_START_S = 0.1


def load_steps(path: Path) -> list[dict[str, Any]]:
    return json.loads(path.read_text())["steps"]


def whole_step_ms(steps: list[dict[str, Any]]) -> dict[int, float]:
    """{prefill tokens: device ms} of the steps that ran one prefill sequence whole and
    nothing sliced (a side without layer slices: each scoring prompt in one step)."""
    out: dict[int, float] = {}
    for s in steps:
        if s.get("num_prefill_seqs") == 1 and not s.get("layer_sliced_span_ms"):
            if s.get("device_ms") is not None:
                out.setdefault(int(s["num_prefill_tokens"]), float(s["device_ms"]))
    return out


def sliced_prompts(
    steps: list[dict[str, Any]], whole: dict[int, float] | None = None
) -> list[dict[str, Any]]:
    """One record per layer-sliced prompt (see the module's docstring), oldest first."""
    out = []
    for s in steps:
        span_ms = s.get("layer_sliced_span_ms")
        if not span_ms:
            continue
        end_age_s = s["age_s"]
        start_age_s = end_age_s + span_ms / 1e3
        # Every other step that ended inside the span: decodes, and a chat's prefill merged
        # with them; all of it time the sliced prompt did not run.
        inside = [
            x
            for x in steps
            if x is not s
            and x.get("device_ms") is not None
            and end_age_s - _EDGE_S <= x["age_s"] <= start_age_s + _EDGE_S
        ]
        between_ms = sum(x["device_ms"] for x in inside)
        timed = [x for x in inside if x.get("decode_gap_ms") is not None]
        waited_all = [x["decode_gap_ms"] + x["device_ms"] for x in timed]
        # The steps behind a slice that carry the decision's promise (since a8311ae).
        behind = [x for x in timed if x.get("slice_promised_ms") is not None]
        waited = [x["decode_gap_ms"] + x["device_ms"] for x in behind]
        promised = [x["slice_promised_ms"] for x in behind]
        tokens = int(s["num_prefill_tokens"])
        rec: dict[str, Any] = {
            "age_s": round(end_age_s, 3),
            "tokens": tokens,
            "span_ms": round(span_ms, 1),
            "predicted_ms": s.get("layer_sliced_predicted_ms"),
            "steps_between": len(inside),
            "between_ms": round(between_ms, 1),
            "decode_rows_p50": statistics.median(x["num_decodes"] for x in inside)
            if inside
            else None,
            "prefill_ms": round(span_ms - between_ms, 1),
            "waited_ms_p50": round(statistics.median(waited_all), 1) if waited_all else None,
            "waited_ms_max": round(max(waited_all), 1) if waited_all else None,
            "num_promised": len(behind),
            "promised_ms": [round(min(promised), 1), round(max(promised), 1)] if promised else None,
            "waited_over_promised_max": round(
                max(w / p for w, p in zip(waited, promised, strict=True)), 3
            )
            if behind
            else None,
        }
        # The launch that started it (since the step trace's `launch_parts_ms`): the decode
        # step launched beside its first slice, or its own row when none was. Nearest the
        # start, within _START_S: the start's age is a host time less a device span, and
        # the prompt's own row is applied a few ms after its last slice ends (read 2 ms
        # younger than the decode launched beside its first slice on an H100).
        starts = [
            x
            for x in steps
            if x.get("launch_parts_ms") and abs(x["age_s"] - start_age_s) <= _START_S
        ]
        if starts:
            first = min(starts, key=lambda x: abs(x["age_s"] - start_age_s))
            rec["start_launch_ms"] = round(first["launch_ms"], 1)
            rec["start_parts_ms"] = {k: round(v, 1) for k, v in first["launch_parts_ms"].items()}
            if first.get("launch_detail") is not None:  # (traces since that field)
                rec["start_detail"] = first["launch_detail"]
        if whole is not None and tokens in whole:
            rec["whole_ms"] = round(whole[tokens], 1)
            rec["span_over_whole"] = round(span_ms / whole[tokens], 3)
            rec["prefill_over_whole"] = round((span_ms - between_ms) / whole[tokens], 3)
        out.append(rec)
    out.sort(key=lambda r: -r["age_s"])
    return out


def summary(prompts: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals over the prompts: the other steps' share of the spans, and the ratios'
    median where a whole step was matched."""
    if not prompts:
        return {"num_prompts": 0}
    span = sum(r["span_ms"] for r in prompts)
    ratios = [r["span_over_whole"] for r in prompts if "span_over_whole" in r]
    return {
        "num_prompts": len(prompts),
        "steps_between_p50": statistics.median(r["steps_between"] for r in prompts),
        "between_share_of_span": round(sum(r["between_ms"] for r in prompts) / span, 3),
        "span_over_whole_p50": round(statistics.median(ratios), 3) if ratios else None,
        "num_matched": len(ratios),
    }


def start_detail_cell(detail: dict[str, Any] | None) -> str:
    """A start's `launch_detail` in one table cell: its first slice's slowest piece (layer:
    first row+rows, or layer+layers; its host ms / the slice's pieces) and the allocator's
    driver calls in the first slice (m mallocs, f frees, r retries, s syncs)."""
    if not detail:
        return "-"
    out = []
    piece = detail.get("slowest_piece")
    if piece:
        where = (
            f"L{piece['layer']}:{piece['row_start']}+{piece['rows']}"
            if "rows" in piece
            else f"L{piece['layer']}+{piece['layers']}"
        )
        out.append(f"{where} {piece['host_ms']:.1f}ms/{piece['num_pieces']}")
    first = (detail.get("allocs") or {}).get("first_slice")
    if first:
        out.append(" ".join(f"{k[0]}{v}" for k, v in first.items()))
    return " ".join(out) or "-"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("steps", type=Path, help="a probe's step trace (auto's side)")
    ap.add_argument("--whole", type=Path, help="a probe's step trace of a side without slices")
    ap.add_argument("--json", action="store_true", help="print JSON, not a table")
    args = ap.parse_args(argv)
    whole = whole_step_ms(load_steps(args.whole)) if args.whole else None
    prompts = sliced_prompts(load_steps(args.steps), whole)
    if args.json:
        print(json.dumps({"prompts": prompts, "summary": summary(prompts)}, indent=1))
        return 0
    cols = [
        "tokens",
        "span_ms",
        "predicted_ms",
        "whole_ms",
        "span_over_whole",
        "prefill_over_whole",
        "steps_between",
        "between_ms",
        "decode_rows_p50",
        "waited_ms_p50",
        "waited_ms_max",
        "promised_ms",
        "waited_over_promised_max",
        "start_launch_ms",
    ]
    print("\t".join([*cols, "start_detail"]))
    for r in prompts:
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append(
                "-"
                if v is None
                else f"{v:.3f}"
                if c.endswith(("_whole", "_max")) and "ms" not in c
                else f"{v:.1f}"
                if isinstance(v, float)
                else str(v)
            )
        print("\t".join([*cells, start_detail_cell(r.get("start_detail"))]))
    print(json.dumps(summary(prompts)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
