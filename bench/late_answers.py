"""Were answers held back behind a long launch? A search's step trace against its clients.

`bench.gpu_scheduling` keeps, per search, the server's steps (`STEM.steps.json.gz`, each with
`end_unix_s`: when its result was applied, on the client's clock) and the clients' per-request
records (`STEM.json.gz` with `--per-request`: when each answer arrived). A one-request step's
answer should arrive within milliseconds of being applied; one held back arrives when the
engine thread is free again. This reads, for the steps right before a gated prompt (a step of
at least `--gated-tokens` new tokens, `INTERRUPT_GATE_MIN_TOKENS`: its launch holds the engine
thread) and for every other one-request step, how many answers arrived within `--window-ms` of
the step being applied, and how late the rest came. The two clocks differ by the time the
steps were fetched: the offset is the median, over the one-request steps, of the signed gap to
the nearest answer.

    python -m bench.late_answers bench/results/gpu-scheduling-2026-12-06-92607b3/searches/c16k/*.steps.json.gz
"""

from __future__ import annotations

import argparse
import bisect
import json
from pathlib import Path
from typing import Any

from bench.host_profile import read_json

GATED_TOKENS = 16_384  # runtime.runner.INTERRUPT_GATE_MIN_TOKENS (kept free of torch here)


def _percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[int(q * (len(xs) - 1))]


def late_answers(
    steps: list[dict[str, Any]],
    answered_unix_s: list[float],
    gated_tokens: int = GATED_TOKENS,
    window_s: float = 0.025,
) -> dict[str, Any]:
    """Counts for the one-request prefill steps before a gated step and for the others: answers
    within `window_s` of the step's result (after the clock offset), and the rest's delay."""
    done = sorted(answered_unix_s)
    if not done:
        return {"error": "no answers"}
    lo, hi = done[0], done[-1]

    def nearest(t: float) -> float:
        j = bisect.bisect_left(done, t)
        return min((done[k] - t for k in (j - 1, j) if 0 <= k < len(done)), key=abs)

    def one_request(st: dict[str, Any]) -> bool:
        return (
            st.get("num_prefill_seqs") == 1
            and not st.get("num_decodes")
            and st.get("end_unix_s") is not None
            and lo < st["end_unix_s"] < hi
        )

    ones = [st for st in steps if one_request(st)]
    if not ones:
        return {"error": "no one-request steps within the answers' span"}
    offset_s = _percentile([nearest(st["end_unix_s"]) for st in ones], 0.5) or 0.0
    out: dict[str, Any] = {"clock_offset_ms": round(offset_s * 1e3, 1)}
    groups: dict[str, dict[str, Any]] = {
        k: {"num_steps": 0, "num_within": 0, "late_ms": []} for k in ("before_gated", "other")
    }
    for st, nxt in zip(steps, steps[1:], strict=False):
        if not one_request(st):
            continue
        g = groups["before_gated" if nxt.get("num_prefill_tokens", 0) >= gated_tokens else "other"]
        t = st["end_unix_s"] + offset_s
        j = bisect.bisect_left(done, t - window_s * 0.6)
        g["num_steps"] += 1
        if j < len(done) and done[j] - t < window_s:
            g["num_within"] += 1
        elif j < len(done):
            g["late_ms"].append((done[j] - t) * 1e3)
    for k, g in groups.items():
        late = g.pop("late_ms")
        out[k] = {
            **g,
            "late_ms_p10": _percentile(late, 0.1),
            "late_ms_p50": _percentile(late, 0.5),
            "late_ms_p90": _percentile(late, 0.9),
        }
    return out


def read_search(steps_path: Path) -> tuple[list[dict[str, Any]], list[float]]:
    """A search's steps and its answers' arrival times (unix s) from `STEM.steps.json.gz` and
    the `STEM.json.gz` (or `STEM.json`) beside it."""
    steps = read_json(steps_path)["steps"]
    stem = steps_path.name.removesuffix(".steps.json.gz")
    record_path = steps_path.with_name(stem + ".json.gz")
    record = read_json(record_path if record_path.exists() else record_path.with_suffix(""))
    answered = [
        r["start_unix_s"] + r["ttft_s"]
        for run in record["runs"]
        for r in run.get("requests") or []
        if r.get("ok") and r.get("ttft_s") is not None
    ]
    return steps, answered


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("steps", nargs="+", type=Path, help="STEM.steps.json.gz files")
    ap.add_argument("--gated-tokens", type=int, default=GATED_TOKENS)
    ap.add_argument("--window-ms", type=float, default=25.0)
    args = ap.parse_args(argv)
    for path in args.steps:
        res = late_answers(*read_search(path), args.gated_tokens, args.window_ms / 1e3)
        print(f"{path}: {json.dumps(res)}")


if __name__ == "__main__":
    main()
