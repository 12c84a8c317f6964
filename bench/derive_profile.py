"""The interim prefill profile derived from H200 results committed before one was measured:
`python -m bench.derive_profile --out bench/profiles/h200-llama-3.1-8b-derived.json`.

What is measured and what is derived (every point says which, and where its numbers come from):

* measured, cold (cached = 0), u = 1,024 / 4,096 / 16,384 / 32,768 tokens: the engine's
  `prefill_<u>_ms` (`bench.gpu_suite` section `engine`: `Engine.measure_prefill(u, 0)` on
  `random:llama-3.1-8b`, bf16, FlashInfer, the minimum of 2-3 repeats) from the seven H200 runs
  in `SOURCES`. The seven values per point are the run-to-run spread (different days, machines
  and code revisions), not the repeat noise within one run.
* derived, everything else: u < 1,024 and every cached length > 0. No committed result times a
  prefill after a cached prefix, or one under 1,024 tokens, so these points are
      seconds(u, c) = cold(u) + u * c * 4 * layers * hidden / attention_flops_per_s
  where cold(u) is the measured curve (linear interpolation) for u >= 1,024 and, below,
  max(u / 1,024 * cold(1,024), floor_s): a forward never costs less than streaming the weights,
  measured as the engine's batch-1 CUDA-graph decode step (`decode_b1_ms` of the two runs
  before the fused decode kernels: a lower bound for a non-graphed small prefill). The
  attention rate is FlashInfer's causal ragged prefill at 8k tokens measured on the H200
  (`bench/results/gpu-smoke-2026-11-29.json`, `kernels.ragged_prefill_8k_tflops`), assumed to
  hold for a paged prefill over a cached prefix. 4 * 32 layers * 4,096 hidden FLOPs per
  query-key pair is the count policies/jct.py uses for Llama-3.1-8B.
  Derived points carry one value; the simulator draws their noise from the measured points.

The profile is labelled `origin: derived`. It has been replaced as the simulator's default by
the one plan `o` of bench/gpu_next.sh measured on 2026-12-01
(`bench/results/prefill-profile-gpu-scheduling-2026-12-01.json`, bench.sim_profile.DEFAULT_PROFILE);
it stays (bench.sim_profile.INTERIM_PROFILE) so that the results computed on it can be
reproduced and the two compared (`--profile bench/profiles/h200-llama-3.1-8b-derived.json`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.sim_profile import REPO_DIR, PrefillProfile, ProfilePoint

RESULTS = "bench/results"
# The H200 runs whose engine section timed cold prefills of random:llama-3.1-8b.
SOURCES = (
    "gpu-runtime-2026-11-29.json",
    "gpu-runtime-5b-2026-11-30.json",
    "gpu-runtime-fused-2026-11-30.json",
    "gpu-fused-a-2026-11-30.json",
    "gpu-fused-b-2026-11-30.json",
    "gpu-fused-c-2026-11-30.json",
    "gpu-fused-d-2026-11-30.json",
)
# Batch-1 decode steps before the fused decode kernels (which only serve decode graphs).
FLOOR_SOURCES = ("gpu-runtime-2026-11-29.json", "gpu-runtime-5b-2026-11-30.json")
ATTENTION_SOURCE = "gpu-smoke-2026-11-29.json"
MEASURED_U = (1024, 4096, 16384, 32768)
DERIVED_SMALL_U = (64, 150, 512)
DERIVED_CACHED = (4096, 16384, 49152)
DERIVED_U_CACHED = (64, 150, 512, 1024, 4096, 16384)
FLOPS_PER_PAIR = 4 * 32 * 4096  # Llama-3.1-8B: QK^T and PV over all heads, per query-key pair


def _read(results_dir: Path, name: str) -> dict[str, Any]:
    return json.loads((results_dir / name).read_text())


def _interp_cold(u: float, cold: dict[int, float]) -> float:
    us = sorted(cold)
    if u <= us[0]:
        return cold[us[0]] * u / us[0]
    for lo, hi in zip(us, us[1:], strict=False):
        if u <= hi:
            return cold[lo] + (cold[hi] - cold[lo]) * (u - lo) / (hi - lo)
    lo, hi = us[-2], us[-1]
    return cold[hi] + (cold[hi] - cold[lo]) * (u - hi) / (hi - lo)


def derive(results_dir: Path = REPO_DIR / RESULTS) -> PrefillProfile:
    """Build the interim profile from the committed result files (see the module docstring)."""
    runs = {name: _read(results_dir, name) for name in SOURCES}
    points: list[ProfilePoint] = []
    cold: dict[int, float] = {}
    for u in MEASURED_U:
        secs = tuple(runs[n]["sections"]["engine"][f"prefill_{u}_ms"] / 1e3 for n in SOURCES)
        points.append(
            ProfilePoint(
                u,
                0,
                secs,
                1,
                "measured",
                f"{RESULTS}/{{{','.join(SOURCES)}}}: sections.engine.prefill_{u}_ms "
                "(min of 2-3 repeats per run; one value per run)",
            )
        )
        cold[u] = statistics.median(secs)
    floor_s = statistics.mean(
        _read(results_dir, n)["sections"]["engine"]["decode_b1_ms"] / 1e3 for n in FLOOR_SOURCES
    )
    attn_flops = (
        _read(results_dir, ATTENTION_SOURCE)["sections"]["kernels"]["ragged_prefill_8k_tflops"]
        * 1e12
    )

    def cold_s(u: int) -> float:
        if u >= MEASURED_U[0]:
            return _interp_cold(u, cold)
        return max(u / MEASURED_U[0] * cold[MEASURED_U[0]], floor_s)

    formula = (
        "cold(u) + u*c*524288/attention_flops_per_s; cold(u<1024) = max(u/1024*cold(1024), floor_s)"
    )
    for u in DERIVED_SMALL_U:
        points.append(ProfilePoint(u, 0, (cold_s(u),), 1, "derived", formula))
    for c in DERIVED_CACHED:
        for u in DERIVED_U_CACHED:
            s = cold_s(u) + u * c * FLOPS_PER_PAIR / attn_flops
            points.append(ProfilePoint(u, c, (round(s, 6),), 1, "derived", formula))
    return PrefillProfile(
        points,
        device="NVIDIA H200",
        model="random:llama-3.1-8b",
        origin="derived",
        note=(
            "INTERIM, DERIVED: cold prefills at 1k-32k tokens are measured (seven H200 engine "
            "runs, one value each); all points with a cached prefix and all under 1k tokens are "
            "derived from a formula (see provenance). Replace with a measured profile "
            "(python -m bench.prefill_profile)."
        ),
        provenance={
            "command": "python -m bench.derive_profile " + " ".join(sys.argv[1:]),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "measured_sources": [f"{RESULTS}/{n}" for n in SOURCES],
            "floor_s": floor_s,
            "floor_source": [f"{RESULTS}/{n}: sections.engine.decode_b1_ms" for n in FLOOR_SOURCES],
            "attention_flops_per_s": attn_flops,
            "attention_source": f"{RESULTS}/{ATTENTION_SOURCE}: "
            "sections.kernels.ragged_prefill_8k_tflops",
            "flops_per_query_key_pair": FLOPS_PER_PAIR,
            "derived_formula": formula,
            "spread_is": "run-to-run (seven runs, code revisions ce5b02c..9774577), not repeats",
        },
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.derive_profile", description=__doc__)
    p.add_argument("--results-dir", default=str(REPO_DIR / RESULTS))
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    prof = derive(Path(args.results_dir))
    prof.save(args.out)
    print(json.dumps(prof.describe(), indent=1))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
