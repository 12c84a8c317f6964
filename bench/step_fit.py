"""Which terms the time of a mixed step needs: fits on an engine's step trace (issue 13).

The TBT cut predicts a step that mixes prefill with decodes as the recent decode step plus an
affine correction of the JCT model's marginal prefill cost (`runtime.partition.corrections.CorrectedCost`).
On the H200 its mean was right and single steps were far off (measured / predicted P99 1.45-4.1),
so the cut cannot hold a P99 target. This reads step traces (`GET /admin/api/steps`;
`bench.gpu_serving` saves one per side as `*.steps.json`), keeps the mixed whole-GPU steps, and
compares models of their device time fitted by least squares on half the steps and scored on
the other half (even / odd positions):

  engine         what the cut predicted (`predicted_ms`: the engine's own model, as it ran)
  prefill        a + b * prefill tokens
  +attention     ... + c * prefill attention pairs (sum of n * (context + n / 2))
  +decodes       ... + d * decodes + e * decode context tokens
  +context       ... + f * prefill context tokens (a short query still reads its whole
                 cached prefix)
  online         +context's terms refitted after every step on the steps before it only
                 (the past decaying by ONLINE_DECAY a step): what a model the engine refits
                 while serving could predict, scored on every step after the first
                 ONLINE_WARMUP

`engine` reads `predicted_ms` (the TBT cut) or, on `auto`'s chunked steps,
`chunked_predicted_ms`. With `--jct-log SERVER_LOG` (the run's server log: its calibrated JCT
line) a `corrected` row replays the engine's own mixed-step prediction, `runtime.scheduler.
CorrectedCost` as this checkout has it, over the steps in order: each scored before it is
observed, its decode part the base the engine recorded for it (`decode_base_ms`: the cost
model's decode for the batch on a calibrated GPU) or, in older traces, a decaying line over
the decode-only steps before it (the engine's `StepPacer.decode_base_s` fallback: on the H200
it is not what ran), the JCT model held at its start-up fit; and beside it
`corrected-no-context`, the same with the cost of the prefill parts' cached tokens held at 0
(the correction as it was before it had that term), and `corrected-after-warmup`, `corrected` on
the steps `online` is scored on (after its warm-up: the first steps, the hardest, are not). Per model: MAPE and the P50 / P90 / P99 of measured / predicted. A term
that shrinks the P99 is one the cut lacks.

The floor (`same_shape`): steps of one shape (decodes, prefill sequences, and prefill tokens,
prefill context within SHAPE_BIN_FRACTION, decode context within DECODE_BIN_FRACTION) should
take one time; each
step predicted by the median of the *other* steps of its shape (shapes with at least
SHAPE_MIN_STEPS steps) gives the error no model of the step's shape can go much below, beside
the engine's on the same steps. What is left there is not shape: on the H200 it is the host
launching an eager step (docs/partition.md). `host_pace` reads that from traces that carry the
host's times (`plan_ms`, `launch_ms`: since the thirty-second session): the share of mixed
steps whose launch took most of their device time (a hint, not proof: a launch also holds any
time the host was blocked in it). `short_steps` summarises the short suffix steps after a
long cached prefix, where that error sits next to scoring.

    python -m bench.step_fit run/*.steps.json [--json out.json] [--source results.json]

`--source`: the run's results JSON; its git revision, device and date go into `--json`'s file
beside the command (a CPU replay of GPU traces: a diagnostic, not a live figure).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.cost_replay import JCT  # the server log's JCT model line
from policies.jct import attention_pairs
from runtime.online_fit import DecayingLine
from runtime.partition.corrections import CorrectedCost, MixedPrefill

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
    "+context": (
        "num_prefill_tokens",
        "prefill_attention_pairs",
        "num_decodes",
        "decode_context_tokens",
        "prefill_context_tokens",
    ),
}
ONLINE_MODEL = "+context"
ONLINE_DECAY = 0.995  # ~200 recent steps carry most of the fit
ONLINE_WARMUP = 50
SHAPE_BIN_FRACTION = 0.1  # prefill token counts within ~10 % are one shape
DECODE_BIN_FRACTION = 0.25  # decode context within ~25 % (a decode token costs ~1/20 of one)
SHAPE_MIN_STEPS = 5


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


# A step whose host spent at least this fraction of its device time inside its launch may have
# run at the host's pace (traces since `plan_ms` / `launch_ms`). Only "may": `launch_ms` is the
# wall time of `executor.launch`, which also holds any time the host was blocked there (a full
# launch queue, a wait on an earlier step's staging), so a launch as long as its step does not
# by itself say who waited for whom. On the 8B's mixed chat (thirty-third session) 2k-token
# steps "launched" for 0.9 of their ~64 ms: no eager 2k step takes the host that long to
# enqueue. `idle_before_ms` (the serial executor's) is the device's own wait between steps.
HOST_PACED_FRACTION = 0.8

# Short suffix steps: a prefill part of fewer than SHORT_STEP_TOKENS after at least
# SHORT_STEP_CONTEXT cached tokens (a scoring request's post after its user's cached profile),
# beside decodes. A quarter of the mixed steps next to scoring, with the largest error of the
# cost model (the thirty-second session: 17 % against 5.9 % for 2k steps).
SHORT_STEP_TOKENS = 256
SHORT_STEP_CONTEXT = 8192


def host_pace(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """How much of the mixed steps' device time the host spent launching them: the steps with
    host times, the fraction that ran at the host's pace (launch_ms >= HOST_PACED_FRACTION *
    device_ms), and the medians of plan_ms, launch_ms and launch / device. Empty counts for
    traces from before the engine recorded host times."""
    timed = [s for s in mixed_steps(steps) if s.get("launch_ms") is not None]
    if not timed:
        return {"num_steps": 0}
    launch = np.array([s["launch_ms"] for s in timed], dtype=float)
    device = np.array([s["device_ms"] for s in timed], dtype=float)
    return {
        "num_steps": len(timed),
        "host_paced_fraction": float(np.mean(launch >= HOST_PACED_FRACTION * device)),
        "plan_ms_p50": float(np.median([s["plan_ms"] for s in timed])),
        "launch_ms_p50": float(np.median(launch)),
        "launch_over_device_p50": float(np.median(launch / device)),
    }


def short_steps(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The short suffix steps among the mixed ones (`SHORT_STEP_TOKENS`, `SHORT_STEP_CONTEXT`)
    with host times: their count and share of the mixed steps, and the medians of their device
    time, launch and plan time and the device's idle before them (None where not recorded: the
    split executor leaves it unset). Compared across the probes of one run in time order, they
    tell the host's state from a side's effect. Empty counts for traces without host times."""
    mixed = [s for s in mixed_steps(steps) if s.get("launch_ms") is not None]
    short = [
        s
        for s in mixed
        if s["num_prefill_tokens"] < SHORT_STEP_TOKENS
        and s.get("prefill_context_tokens", 0) >= SHORT_STEP_CONTEXT
    ]
    if not short:
        return {"num_steps": 0}
    idle = [s["idle_before_ms"] for s in short if s.get("idle_before_ms") is not None]
    # The launch less its waits for the device (traces since `launch_wait_ms`): the host's own.
    own = [
        s["launch_ms"] - s["launch_wait_ms"] for s in short if s.get("launch_wait_ms") is not None
    ]
    return {
        "num_steps": len(short),
        "share_of_mixed": len(short) / len(mixed),
        "device_ms_p50": float(np.median([s["device_ms"] for s in short])),
        "launch_ms_p50": float(np.median([s["launch_ms"] for s in short])),
        "launch_host_ms_p50": float(np.median(own)) if own else None,
        "plan_ms_p50": float(np.median([s["plan_ms"] for s in short])),
        "idle_before_ms_p50": float(np.median(idle)) if idle else None,
    }


def engine_prediction(step: dict[str, Any]) -> float:
    """What the engine predicted for the step (ms; 0 when nothing): the TBT cut's
    `predicted_ms`, else `auto`'s `chunked_predicted_ms`."""
    return float(step.get("predicted_ms") or step.get("chunked_predicted_ms") or 0.0)


def _features(steps: list[dict[str, Any]], fields: tuple[str, ...]) -> np.ndarray:
    return np.array([[1.0] + [float(s.get(f) or 0.0) for f in fields] for s in steps])


def online_predictions(
    x: np.ndarray, y: np.ndarray, decay: float = ONLINE_DECAY, warmup: int = ONLINE_WARMUP
) -> np.ndarray:
    """Each step's prediction from a least-squares fit of the steps before it only (relative
    error: weights 1 / y², the past decaying by `decay` a step); 0 for the first `warmup`.
    Features are scaled to their largest value so the normal equations stay conditioned."""
    scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
    xs = x / scale
    k = xs.shape[1]
    xtx = np.eye(k) * 1e-6
    xty = np.zeros(k)
    out = np.zeros(len(y))
    for i in range(len(y)):
        if i >= warmup:
            out[i] = float(xs[i] @ np.linalg.solve(xtx, xty))
        w = 1.0 / (y[i] * y[i])
        xtx = decay * xtx + w * np.outer(xs[i], xs[i])
        xty = decay * xty + w * xs[i] * y[i]
    return out


def _bin(value: float, fraction: float = SHAPE_BIN_FRACTION) -> int:
    """Log-spaced bin of a token count: values within ~`fraction` share one."""
    return -1 if value <= 0 else int(round(np.log(value) / np.log1p(fraction)))


def shape_key(step: dict[str, Any]) -> tuple[int, ...]:
    return (
        int(step.get("num_decodes") or 0),
        int(step.get("num_prefill_seqs") or 0),
        _bin(float(step.get("num_prefill_tokens") or 0)),
        _bin(float(step.get("prefill_context_tokens") or 0)),
        _bin(float(step.get("decode_context_tokens") or 0), DECODE_BIN_FRACTION),
    )


def same_shape_floor(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Each step of a shape with at least SHAPE_MIN_STEPS steps predicted by the median of
    the other steps of its shape (leave one out), and the engine's prediction on the same
    steps (those it predicted)."""
    groups: dict[tuple[int, ...], list[dict[str, Any]]] = {}
    for s in steps:
        groups.setdefault(shape_key(s), []).append(s)
    measured: list[float] = []
    peers: list[float] = []
    engine: list[float] = []
    for members in groups.values():
        if len(members) < SHAPE_MIN_STEPS:
            continue
        times = np.array([float(s["device_ms"]) for s in members])
        for i, s in enumerate(members):
            measured.append(times[i])
            peers.append(float(np.median(np.delete(times, i))))
            engine.append(engine_prediction(s))
    m, e = np.array(measured), np.array(engine)
    return {
        "num_shapes": sum(1 for g in groups.values() if len(g) >= SHAPE_MIN_STEPS),
        "peers_median": ratio_summary(m, np.array(peers)),
        "engine_same_steps": ratio_summary(m, e),
    }


@dataclass(frozen=True)
class JctLine:
    """The JCT model's marginal cost as a server started with it (`marginal_s`, as
    `policies.jct.JCTModel`); `max_tokens_within` is not needed to replay observations."""

    b_s_per_token: float
    k_s_per_pair: float

    def marginal_s(self, uncached_tokens: int, cached_tokens: int = 0) -> float:
        u = max(0, uncached_tokens)
        return self.b_s_per_token * u + self.k_s_per_pair * attention_pairs(
            u, max(0, cached_tokens)
        )

    def max_tokens_within(self, seconds: float, cached_tokens: int = 0) -> int:
        raise NotImplementedError("not used by a replay of observations")


def jct_from_log(path: Path) -> JctLine:
    """The last JCT model a server log says it uses (its calibrated one, when it has one)."""
    found = JCT.findall(path.read_text(errors="replace"))
    if not found:
        raise SystemExit(
            f"{path}: no 'JCTModel(a_s=..., b_s_per_token=..., k_s_per_pair=...)' line"
        )
    _, b, k = (float(v) for v in found[-1])
    return JctLine(b, k)


class _NoContextTerm(CorrectedCost):
    """The correction without its context term (the joint fit never in bounds)."""

    MAX_CONTEXT_S_PER_TOKEN = 0.0


def corrected_replay(
    steps: list[dict[str, Any]], jct: JctLine, *, context_term: bool = True
) -> dict[int, float]:
    """The engine's mixed-step prediction (ms) per mixed step (by its index in `steps`),
    replayed as the module docstring says; steps before the first decode-only ones have none.
    The steps' prefill context is their parts' total (a trace has no per-part split), which is
    what `CorrectedCost` observes; its per-part marginal is summed from the totals."""
    cost = (CorrectedCost if context_term else _NoContextTerm)(jct)  # type: ignore[arg-type]
    decode = DecayingLine(CorrectedCost.DECAY)
    out: dict[int, float] = {}
    for i, s in enumerate(steps):
        if s.get("on_split") or s.get("device_ms") is None:
            continue
        measured_s = float(s["device_ms"]) / 1e3
        num_decodes = int(s.get("num_decodes") or 0)
        if num_decodes and not s.get("num_prefill_tokens"):
            decode.add(float(num_decodes), measured_s)
            continue
        recorded = s.get("decode_base_ms")  # the engine's own base (newer traces)
        if not num_decodes or (recorded is None and decode.count < 3):
            continue
        if recorded is not None:
            base_s = float(recorded) / 1e3
        else:
            mx, my = decode.means()
            base_s = my + (decode.slope(0.1, 3.0) or 0.0) * (num_decodes - mx)
        tokens = int(s["num_prefill_tokens"])
        prefill = MixedPrefill(
            jct.b_s_per_token * tokens,
            jct.k_s_per_pair * float(s.get("prefill_attention_pairs") or 0.0),
            int(s.get("prefill_context_tokens") or 0),
        )
        out[i] = 1e3 * (base_s + cost.extra_s(prefill))
        cost.observe(prefill, measured_s - base_s)
    return out


def fit(steps: list[dict[str, Any]], jct: JctLine | None = None) -> dict[str, Any]:
    """The comparison for one set of steps (see the module docstring), and the host gaps."""
    mixed = mixed_steps(steps)
    out: dict[str, Any] = {
        "num_steps": len(steps),
        "num_mixed_steps": len(mixed),
        "host_gaps": host_gaps(steps),
        "host_pace": host_pace(steps),
        "short_steps": short_steps(steps),
    }
    if len(mixed) < 8:
        out["error"] = "fewer than 8 mixed whole-GPU steps"
        return out
    y = np.array([s["device_ms"] for s in mixed], dtype=float)
    test = np.arange(len(mixed)) % 2 == 1
    models: dict[str, Any] = {}
    engine = np.array([engine_prediction(s) for s in mixed], dtype=float)
    models["engine"] = ratio_summary(y[test], engine[test])
    for name, fields in MODELS.items():
        x = _features(mixed, fields)
        coef, *_ = np.linalg.lstsq(x[~test], y[~test], rcond=None)
        models[name] = {
            **ratio_summary(y[test], x[test] @ coef),
            "coefficients": dict(zip(("const_ms", *fields), map(float, coef), strict=True)),
        }
    online = online_predictions(_features(mixed, MODELS[ONLINE_MODEL]), y)
    models["online"] = ratio_summary(y, online)
    if jct is not None:
        ids = {id(s): i for i, s in enumerate(steps)}
        for name, term in (("corrected", True), ("corrected-no-context", False)):
            replayed = corrected_replay(steps, jct, context_term=term)
            pred = np.array([replayed.get(ids[id(s)], 0.0) for s in mixed])
            models[name] = ratio_summary(y, pred)
            if term:  # like for like with `online`: the steps it scores (after its warm-up)
                models["corrected-after-warmup"] = ratio_summary(
                    y, np.where(online > 0.0, pred, 0.0)
                )
    out["models"] = models
    out["same_shape"] = same_shape_floor(mixed)
    return out


def _print_floor(floor: dict[str, Any]) -> None:
    for name, key in (("same shape", "peers_median"), ("engine", "engine_same_steps")):
        m = floor[key]
        if not m.get("num_steps"):
            print(f"  floor: {name:<10} no steps")
            continue
        print(
            f"  floor: {name:<10} MAPE {m['mape']:.3f} over {m['num_steps']} steps "
            f"({floor['num_shapes']} shapes), measured/predicted P99 {m['ratio_p99']:.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.step_fit", description=__doc__)
    ap.add_argument("files", nargs="+", type=Path, help="step traces (*.steps.json)")
    ap.add_argument("--json", type=Path, help="write the results here too")
    ap.add_argument("--source", type=Path, help="the traces' run results JSON (for --json)")
    ap.add_argument(
        "--jct-log", type=Path, help="the run's server log: replay the engine's correction"
    )
    args = ap.parse_args(argv)
    results: dict[str, Any] = {
        "command": " ".join(["python", "-m", "bench.step_fit", *(argv or sys.argv[1:])]),
        "note": "CPU fits over recorded step traces: a diagnostic, not a live figure; "
        "traces not committed",
    }
    if args.source is not None:
        src = json.loads(args.source.read_text())
        results["source"] = {k: src.get(k) for k in ("git_revision", "device", "date")}
    all_steps: list[dict[str, Any]] = []
    jct = jct_from_log(args.jct_log) if args.jct_log is not None else None
    for path in args.files:
        data = json.loads(path.read_text())
        steps = data["steps"] if isinstance(data, dict) else data
        all_steps += steps
        res = fit(steps, jct)
        results[path.name] = res
        print(f"{path.name}: {res['num_mixed_steps']} mixed steps of {res['num_steps']}")
        g = res["host_gaps"]
        gc_note = f", {g['num_with_gc_pause']} with a collector pause" if g["gc_traced"] else ""
        longest = "-" if g["max_gap_ms"] is None else f"{g['max_gap_ms']:.1f} ms"
        print(f"  host gaps over {g['over_ms']:g} ms: {g['num_gaps']} (longest {longest}){gc_note}")
        h = res["host_pace"]
        if h["num_steps"]:
            print(
                f"  host pace: {h['host_paced_fraction']:.0%} of {h['num_steps']} mixed steps "
                f"launched in >= {HOST_PACED_FRACTION:.0%} of their device time; P50 plan "
                f"{h['plan_ms_p50']:.2f} ms, launch {h['launch_ms_p50']:.2f} ms "
                f"({h['launch_over_device_p50']:.2f} of the device's)"
            )
        sh = res["short_steps"]
        if sh["num_steps"]:
            idle = sh["idle_before_ms_p50"]
            print(
                f"  short suffix steps (< {SHORT_STEP_TOKENS} tokens after >= "
                f"{SHORT_STEP_CONTEXT} cached): {sh['num_steps']} ({sh['share_of_mixed']:.0%} of "
                f"mixed), P50 device {sh['device_ms_p50']:.2f} ms, launch "
                f"{sh['launch_ms_p50']:.2f}, plan {sh['plan_ms_p50']:.2f}, idle before "
                + ("-" if idle is None else f"{idle:.2f}")
            )
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
        _print_floor(res["same_shape"])
    if len(args.files) > 1:
        # One GPU forward costs the same whichever side planned it: the floor over all the
        # files together has more steps of each shape.
        pooled = mixed_steps(all_steps)
        results["all files"] = {
            "num_mixed_steps": len(pooled),
            "same_shape": same_shape_floor(pooled),
        }
        print(f"all files: {len(pooled)} mixed steps")
        _print_floor(results["all files"]["same_shape"])
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
