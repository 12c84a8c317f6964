"""The partition cost model's profile and calibration file (issue 6, item 3).

    samples = profile_partition(measure_prefill_ms, measure_decode_ms, splits, shapes,
                                total_sms=132, num_layers=36)
    cal = fit_calibration(samples, device="NVIDIA H200", total_sms=132, model="random:qwen2.5-3b")
    path = cal.save_to_cache(cache_dir)   # <cache>/calibration-nvidia-h200--random-qwen2.5-3b.json
    cal = load_partition_calibration(path, device=..., total_sms=..., model=...)
    cost_model = cal.cost_model()

The measure functions are the engine's (runtime/partition/gpu.py `EngineProbe`); this module
only orders the points, times the profile, fits and reads/writes files, so it stays free of
tensors and is tested on the CPU with synthetic measures. Their contract:

* `measure_prefill_ms(num_tokens, context_tokens, sms) -> ms`: one prefill of `num_tokens`
  new tokens after `context_tokens` cached ones, alone on `sms` SMs (`sms == total_sms`: the
  whole GPU, an ordinary stream).
* `measure_decode_ms(batch_size, context_tokens, sms) -> ms`: one decode step of
  `batch_size` sequences of `context_tokens` context each, alone on `sms` SMs.
* `measure_concurrent_ms((num_tokens, context_tokens), (batch_size, context_tokens),
  prefill_sms) -> (prefill_ms, decode_step_ms)`: the prefill on the pair's prefill partition
  while decode steps run on its decode partition (decode_step_ms NaN if none completed).
  Optional: without it the contention terms stay 0.

The calibration is the `partition` section of the one calibration file per (device, model)
(runtime/calibrate.py: `calibration-<device>--<model>.json`, beside the JCT model's `jct`
section); writing it keeps the other section. The old `partition-<device>--<model>.json`
(`greenlane-partition/1`, the section alone) is still read, and logged once when it is.

Which calibration a start-up uses (`choose_partition_calibration`, the JCT convention of
runtime/calibrate.py): an explicit `--partition-calibration` file wins (it must load: the one
file with a `partition` section, or an old file); else the cached file for this device, SM
count and model in the calibration folder (the one file's section, else the old file); else,
in `auto`, a short profile now (written to the one file); else the fallback: the parameters
fitted on the issue-6 H200 run, only for that device, SM count and model, labelled as such;
else none (the controller time-slices until calibrated).
"""

from __future__ import annotations

import datetime as _dt
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from policies.jct import file_slug
from runtime.calibrate import (
    PARTITION_SECTION,
    calibration_file_path,
    default_cache_dir,
    read_section,
    write_section,
)
from runtime.partition.cost_model import (
    DECODE,
    PREFILL,
    CostModel,
    DecodeShape,
    PrefillShape,
    ProfileSample,
)

log = logging.getLogger("greenlane.partition")

# The `partition` section's format (and that of the old standalone files).
CALIBRATION_FORMAT = "greenlane-partition/1"

PrefillPoint = tuple[int, int]  # (num_tokens, context_tokens)
DecodePoint = tuple[int, int]  # (batch_size, context_tokens per sequence)
MeasurePrefill = Callable[[int, int, int], float]
MeasureDecode = Callable[[int, int, int], float]
MeasureConcurrent = Callable[[PrefillPoint, DecodePoint, int], tuple[float, float]]


@dataclass(frozen=True, slots=True)
class ProfileShapes:
    """What a profile measures: prefill and decode shapes alone (each on the whole GPU and on
    every profiled split), and (prefill, decode) pairs run concurrently on every split."""

    prefill: tuple[PrefillPoint, ...]
    decode: tuple[DecodePoint, ...]
    concurrent: tuple[tuple[PrefillPoint, DecodePoint], ...] = ()


# Start-up profile (`--partition auto` with no calibration file): 4 splits x 2 shapes per stage,
# one concurrent pair. (1 + 4) x 2 prefill + (1 + 4) x 2 decode + 4 concurrent = 24 points, each
# 1 untimed + 2 timed runs. Estimated from the issue-6 H200 timings of random:qwen2.5-3b
# (prefill 4k: 45 ms whole GPU .. 160 ms on 33 SMs; eager decode ~16 ms): about 5 s for a 3B
# model, 10-20 s for an 8B one -- an estimate, not a measurement. `STARTUP_MAX_S` bounds it.
# Two shapes per stage do not identify all three base coefficients (the least-squares solution
# is the minimum-norm one); online refinement corrects the bias per split while serving, and
# `python -m app calibrate --what partition` runs the fuller profile below.
# 0.85: on the H200 the smallest decode partitions (20-28 SMs) were far slower than a fit
# without them extrapolated (measured in serving), so the profile measures one.
STARTUP_SPLIT_FRACTIONS = (0.25, 0.5, 0.75, 0.85)
STARTUP_SHAPES = ProfileShapes(
    prefill=((4096, 0), (1024, 4096)),
    decode=((16, 1024), (64, 2048)),
    concurrent=(((4096, 0), (64, 2048)),),
)
STARTUP_REPEATS = 2
STARTUP_MAX_S = 60.0
# Explicit profile (`python -m app calibrate --what partition`): 5 splits, 3 shapes per stage,
# 2 concurrent pairs, 3 timed runs each (under a minute for a 3B model on an H200, estimated).
FULL_SPLIT_FRACTIONS = (0.25, 0.4, 0.55, 0.7, 0.85)
FULL_SHAPES = ProfileShapes(
    prefill=((1024, 0), (4096, 0), (2048, 4096)),
    decode=((8, 1024), (64, 1024), (32, 4096)),
    concurrent=(((4096, 0), (64, 2048)), ((1024, 0), (16, 2048))),
)
FULL_REPEATS = 3
FULL_MAX_S = 600.0

# ETA weights, in "token equivalents" (only the ETA uses them): a forward's floor, the tokens,
# attention pairs at 1/4096 of a token each; prefill time scales with 1/SM share, decode is
# treated as flat (eager decode steps are launch-bound, H200.md). Refined by the elapsed time.
_ETA_FLOOR = 64.0
_ETA_PER_PAIR = 1.0 / 4096.0


def _print_progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------- the profile
def pick_splits(available: Sequence[int], fractions: Sequence[float], total_sms: int) -> list[int]:
    """The pre-created splits (prefill SM counts) nearest to `fractions` of the GPU, deduped."""
    if not available:
        return []
    picked = {min(available, key=lambda s: abs(s - f * total_sms)) for f in fractions}
    return sorted(picked)


def fit_shapes_to_limits(
    shapes: ProfileShapes, *, max_model_len: int, kv_pool_tokens: int, max_num_seqs: int
) -> ProfileShapes:
    """Shrink shapes (halving tokens, context or batch) until each fits the engine: a prefill
    within the context limit; a decode batch within `max_num_seqs` and, like a concurrent
    pair, within half the KV pool (the probe allocates real blocks for the contexts)."""

    def prefill(pt: PrefillPoint) -> PrefillPoint:
        t, c = pt
        while t + c > max_model_len - 1 and (t > 16 or c > 0):
            t, c = (t, c // 2) if c > t else (max(16, t // 2), c)
        return t, c

    def decode(pt: DecodePoint, budget: int) -> DecodePoint:
        b, c = min(pt[0], max_num_seqs), pt[1]
        c = min(c, max_model_len - 2)
        while b * (c + 1) > budget and (b > 1 or c > 16):
            b, c = (b // 2, c) if b > 1 and b * 16 >= c else (b, max(16, c // 2))
        return max(b, 1), max(c, 1)

    half = max(kv_pool_tokens // 2, 32)
    return ProfileShapes(
        prefill=tuple(dict.fromkeys(prefill(p) for p in shapes.prefill)),
        decode=tuple(dict.fromkeys(decode(d, half) for d in shapes.decode)),
        concurrent=tuple(
            dict.fromkeys(
                (prefill(p), decode(d, max(half - prefill(p)[1], 32))) for p, d in shapes.concurrent
            )
        ),
    )


@dataclass(slots=True)
class _Point:
    kind: str  # "prefill" | "decode" | "concurrent"
    prefill: PrefillPoint | None
    decode: DecodePoint | None
    sms: int  # prefill: its SMs; decode: its SMs; concurrent: the prefill partition's SMs
    weight: float  # ETA weight

    def split(self, total_sms: int) -> int | None:
        """The split (prefill SM count) this point runs on; None = the whole GPU."""
        if self.sms == total_sms:
            return None
        return total_sms - self.sms if self.kind == "decode" else self.sms

    def label(self, total_sms: int) -> str:
        if self.kind == "prefill":
            assert self.prefill is not None
            return f"prefill  tokens={self.prefill[0]:>5} ctx={self.prefill[1]:>5} on {self.sms:>3} SMs"
        if self.kind == "decode":
            assert self.decode is not None
            return (
                f"decode   batch={self.decode[0]:>5} ctx={self.decode[1]:>5} on {self.sms:>3} SMs"
            )
        assert self.prefill is not None and self.decode is not None
        return (
            f"together prefill {self.prefill[0]}+{self.prefill[1]} on {self.sms} SMs, "
            f"decode B={self.decode[0]} ctx={self.decode[1]} on {total_sms - self.sms}"
        )


def _prefill_units(pt: PrefillPoint) -> float:
    t, c = pt
    return _ETA_FLOOR + t + t * (t / 2 + c) * _ETA_PER_PAIR


def _decode_units(pt: DecodePoint) -> float:
    b, c = pt
    return _ETA_FLOOR + b * c * _ETA_PER_PAIR


def plan_points(
    splits: Sequence[int], shapes: ProfileShapes, total_sms: int, with_concurrent: bool = True
) -> list[_Point]:
    """The profile's points in measuring order: every shape on the whole GPU first (the fit's
    base latencies), then on each split, then the concurrent pairs. A profile cut short by its
    time budget so keeps what the fit needs most."""
    pts: list[_Point] = []
    for sms in [total_sms, *splits]:
        for p in shapes.prefill:
            pts.append(_Point("prefill", p, None, sms, _prefill_units(p) * total_sms / sms))
        dsms = total_sms if sms == total_sms else total_sms - sms
        for d in shapes.decode:
            pts.append(_Point("decode", None, d, dsms, _decode_units(d)))
    if with_concurrent:
        for s in splits:
            for p, d in shapes.concurrent:
                pts.append(_Point("concurrent", p, d, s, 2 * _prefill_units(p) * total_sms / s))
    return pts


def profile_partition(
    measure_prefill_ms: MeasurePrefill,
    measure_decode_ms: MeasureDecode,
    splits: Sequence[int],
    shapes: ProfileShapes,
    progress: Callable[[str], None] | None = _print_progress,
    *,
    total_sms: int,
    num_layers: int,
    measure_concurrent_ms: MeasureConcurrent | None = None,
    repeats: int = FULL_REPEATS,
    warmup: int = 1,
    max_seconds: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    failed_splits: dict[int, str] | None = None,
) -> list[ProfileSample]:
    """Measure every point `warmup` times untimed (first use of a green context, allocator and
    plan caches must not skew it) and `repeats` times (median kept); one progress line per
    point with the elapsed time and an ETA. Stops early, saying so, once `max_seconds` have
    passed. Returns the samples for `CostModel.fit` (layers: `num_layers`).

    A point on a split that raises (on the H200 cuBLAS failed on a 12-SM decode partition)
    marks that split failed in `failed_splits` (split -> why) and skips its other points; the
    profile goes on with the rest. A failure on the whole GPU is not the split's fault: it
    propagates."""
    say = progress or (lambda _msg: None)
    bad = [s for s in splits if not 0 < s < total_sms]
    if bad:
        raise ValueError(f"splits must be prefill SM counts in (0, {total_sms}), got {bad}")
    pts = plan_points(splits, shapes, total_sms, measure_concurrent_ms is not None)
    samples: list[ProfileSample] = []
    n = len(pts)
    t0 = clock()
    for i, pt in enumerate(pts, 1):
        if max_seconds is not None and clock() - t0 > max_seconds and i > 1:
            say(
                f"[partition profile] time budget {max_seconds:.0f} s reached: stopping after "
                f"{i - 1}/{n} points (the fit uses what was measured)"
            )
            break
        split = pt.split(total_sms)
        if failed_splits is not None and split in failed_splits:
            continue
        try:
            detail = _measure_point(
                pt,
                measure_prefill_ms,
                measure_decode_ms,
                measure_concurrent_ms,
                repeats,
                warmup,
                total_sms,
                num_layers,
                samples,
            )
        except Exception as e:
            if split is None or failed_splits is None:
                raise
            failed_splits[split] = f"{type(e).__name__}: {e}"[:300]
            detail = f"FAILED, split {split} skipped ({type(e).__name__}: {str(e)[:120]})"
        elapsed = clock() - t0
        done_w = sum(p.weight for p in pts[:i])
        eta = elapsed * sum(p.weight for p in pts[i:]) / max(done_w, 1e-9)
        say(
            f"[partition profile {i}/{n}] {pt.label(total_sms)}: {detail}  "
            f"(elapsed {elapsed:5.1f} s, ETA {eta:5.1f} s)"
        )
    return samples


def _median_ms(fn: Callable[[], float], repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    return float(np.median([fn() for _ in range(max(repeats, 1))]))


def _measure_point(
    pt: _Point,
    measure_prefill_ms: MeasurePrefill,
    measure_decode_ms: MeasureDecode,
    measure_concurrent_ms: MeasureConcurrent | None,
    repeats: int,
    warmup: int,
    total_sms: int,
    num_layers: int,
    out: list[ProfileSample],
) -> str:
    if pt.kind == "prefill":
        assert pt.prefill is not None
        t, c = pt.prefill
        ms = _median_ms(lambda: measure_prefill_ms(t, c, pt.sms), repeats, warmup)
        out.append(ProfileSample(PREFILL, PrefillShape.from_seqs([(c, t)], num_layers), pt.sms, ms))
        return f"{ms:9.2f} ms"
    if pt.kind == "decode":
        assert pt.decode is not None
        b, c = pt.decode
        ms = _median_ms(lambda: measure_decode_ms(b, c, pt.sms), repeats, warmup)
        out.append(ProfileSample(DECODE, DecodeShape(b, b * c, num_layers), pt.sms, ms))
        return f"{ms:9.2f} ms"
    assert measure_concurrent_ms is not None and pt.prefill is not None and pt.decode is not None
    p_pt, d_pt = pt.prefill, pt.decode
    for _ in range(warmup):
        measure_concurrent_ms(p_pt, d_pt, pt.sms)
    runs = [measure_concurrent_ms(p_pt, d_pt, pt.sms) for _ in range(max(repeats, 1))]
    p_ms = float(np.median([r[0] for r in runs]))
    d_runs = [r[1] for r in runs if math.isfinite(r[1])]
    dsms = total_sms - pt.sms
    out.append(
        ProfileSample(
            PREFILL, PrefillShape.from_seqs([(p_pt[1], p_pt[0])], num_layers), pt.sms, p_ms, dsms
        )
    )
    if not d_runs:  # the prefill ended before one decode step did: no decode sample
        return f"prefill {p_ms:.2f} ms, no decode step completed alongside"
    d_ms = float(np.median(d_runs))
    out.append(
        ProfileSample(
            DECODE, DecodeShape(d_pt[0], d_pt[0] * d_pt[1], num_layers), dsms, d_ms, pt.sms
        )
    )
    return f"prefill {p_ms:.2f} ms, decode step {d_ms:.2f} ms"


# ----------------------------------------------------------------------------- the calibration
def partition_calibration_filename(device: str, model: str) -> str:
    """The OLD partition-only file name for (device, model), e.g.
    `partition-nvidia-h200--random-qwen2.5-3b.json` (still read; new calibrations go to the
    one file, runtime/calibrate.py `calibration_file_path`)."""
    return f"partition-{file_slug(device)}--{file_slug(model)}.json"


def _sample_to_dict(s: ProfileSample) -> dict[str, Any]:
    if isinstance(s.shape, PrefillShape):
        shape = {
            "num_tokens": s.shape.num_tokens,
            "attention_pairs": s.shape.attention_pairs,
            "num_layers": s.shape.num_layers,
        }
    else:
        shape = {
            "batch_size": s.shape.batch_size,
            "kv_tokens": s.shape.kv_tokens,
            "num_layers": s.shape.num_layers,
        }
    return {
        "stage": s.stage,
        "shape": shape,
        "sms": s.sms,
        "other_sms": s.other_sms,
        "latency_ms": s.latency_ms,
    }


def _sample_from_dict(d: dict[str, Any]) -> ProfileSample:
    sh = d["shape"]
    shape: PrefillShape | DecodeShape
    if d["stage"] == PREFILL:
        shape = PrefillShape(
            int(sh["num_tokens"]), float(sh["attention_pairs"]), int(sh["num_layers"])
        )
    else:
        shape = DecodeShape(int(sh["batch_size"]), int(sh["kv_tokens"]), int(sh["num_layers"]))
    return ProfileSample(
        d["stage"], shape, int(d["sms"]), float(d["latency_ms"]), int(d.get("other_sms", 0))
    )


@dataclass(slots=True)
class PartitionCalibration:
    """One calibration file's content: the cost model's parameters for (device, SM count,
    model), where they came from, and how well they fitted their own profile."""

    device: str
    total_sms: int
    model: str
    parameters: dict[str, Any]  # CostModel.to_dict()
    fit_error: dict[str, Any]  # in-sample MAPE of the fit (on its own profile: optimistic)
    created: str  # ISO 8601 UTC
    source: str  # "profile" (measured here), or a description of where else it came from
    profile: dict[str, Any] = field(default_factory=dict)  # splits, shapes, seconds
    samples: list[ProfileSample] = field(default_factory=list)
    path: str | None = None  # the file it was read from / written to

    def cost_model(self) -> CostModel:
        where = f"calibration:{self.path}" if self.path else self.source
        return CostModel.from_dict(self.parameters, source=where)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": CALIBRATION_FORMAT,
            "device": self.device,
            "total_sms": self.total_sms,
            "model": self.model,
            "created": self.created,
            "source": self.source,
            "fit_error": self.fit_error,
            "parameters": self.parameters,
            "profile": self.profile,
            "samples": [_sample_to_dict(s) for s in self.samples],
        }

    def save(self, path: str) -> str:
        """Write as the `partition` section of the calibration file `path`, keeping its other
        section (runtime/calibrate.py `write_section`: atomic, a server starting meanwhile
        reads the old file or the new one, never half of one)."""
        self.path = write_section(
            path, PARTITION_SECTION, self.to_dict(), device=self.device, model=self.model
        )
        return self.path

    def save_to_cache(self, cache_dir: str | None = None) -> str:
        """Write into the cache folder's calibration file for this device and model."""
        return self.save(calibration_file_path(cache_dir, self.device, self.model))


def fit_error(model: CostModel, samples: Sequence[ProfileSample]) -> dict[str, Any]:
    """|predicted - measured| / measured of `model` on `samples`: mean and max, overall and
    per stage/regime. On the fit's own profile this is an in-sample error (optimistic); the
    held-out figures are in docs/benchmarks.md."""
    errs: dict[str, list[float]] = {}
    for s in samples:
        pred = model.predict(s.stage, s.shape, s.sms, s.other_sms)
        e = abs(pred - s.latency_ms) / max(s.latency_ms, 1e-9)
        regime = "concurrent" if s.other_sms > 0 else "alone"
        errs.setdefault(f"{s.stage}_{regime}", []).append(e)
    every = [e for v in errs.values() for e in v]
    out: dict[str, Any] = {
        "kind": "in-sample",
        "num_samples": len(every),
        "mape": float(np.mean(every)) if every else None,
        "max": float(np.max(every)) if every else None,
    }
    out.update({f"mape_{k}": float(np.mean(v)) for k, v in sorted(errs.items())})
    return out


def fit_calibration(
    samples: Sequence[ProfileSample],
    *,
    device: str,
    total_sms: int,
    model: str,
    profile: dict[str, Any] | None = None,
) -> PartitionCalibration:
    """Fit the cost model to a profile. Raises ValueError when the profile cannot determine
    it: each stage needs a whole-GPU sample (base latency) and one on a partition (curve)."""
    for stage in (PREFILL, DECODE):
        alone = [s for s in samples if s.stage == stage and s.other_sms == 0]
        if not any(s.sms == total_sms for s in alone) or not any(s.sms < total_sms for s in alone):
            raise ValueError(
                f"the profile has no {stage} sample on the whole GPU and on a "
                f"partition: cannot fit the cost model"
            )
    cm = CostModel.fit(total_sms, list(samples))
    return PartitionCalibration(
        device=device,
        total_sms=total_sms,
        model=model,
        parameters=cm.to_dict(),
        fit_error=fit_error(cm, samples),
        created=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        source="profile",
        profile=dict(profile or {}),
        samples=list(samples),
    )


def calibrate_partition(
    measure_prefill_ms: MeasurePrefill,
    measure_decode_ms: MeasureDecode,
    *,
    device: str,
    total_sms: int,
    model: str,
    num_layers: int,
    splits: Sequence[int],
    shapes: ProfileShapes,
    measure_concurrent_ms: MeasureConcurrent | None = None,
    repeats: int = FULL_REPEATS,
    max_seconds: float | None = FULL_MAX_S,
    cache_dir: str | None = None,
    out_path: str | None = None,
    progress: Callable[[str], None] | None = _print_progress,
) -> PartitionCalibration:
    """Profile, fit, and write the file (`out_path`, else the cache folder's file for this
    device and model). Returns the calibration, `path` set to the file written."""
    say = progress or (lambda _msg: None)
    say(
        f"[partition profile] {device} ({total_sms} SMs), {model}: splits {list(splits)}, "
        f"prefill {list(shapes.prefill)}, decode {list(shapes.decode)}, "
        f"concurrent {list(shapes.concurrent) if measure_concurrent_ms else 'not measured'}"
    )
    t0 = time.monotonic()
    failed: dict[int, str] = {}
    samples = profile_partition(
        measure_prefill_ms,
        measure_decode_ms,
        splits,
        shapes,
        progress,
        total_sms=total_sms,
        num_layers=num_layers,
        measure_concurrent_ms=measure_concurrent_ms,
        repeats=repeats,
        max_seconds=max_seconds,
        failed_splits=failed,
    )
    meta = {
        "splits": list(splits),
        "failed_splits": {str(k): v for k, v in failed.items()},
        "prefill_shapes": [list(p) for p in shapes.prefill],
        "decode_shapes": [list(d) for d in shapes.decode],
        "concurrent_shapes": [[list(p), list(d)] for p, d in shapes.concurrent]
        if measure_concurrent_ms
        else [],
        "repeats": repeats,
        "seconds": round(time.monotonic() - t0, 3),
    }
    cal = fit_calibration(samples, device=device, total_sms=total_sms, model=model, profile=meta)
    err = cal.fit_error
    path = cal.save(out_path) if out_path else cal.save_to_cache(cache_dir)
    say(
        f"[partition profile] fitted in {meta['seconds']:.1f} s; in-sample error "
        f"{err['mape']:.1%} mean, {err['max']:.1%} worst over {err['num_samples']} samples; "
        f"wrote {path}"
    )
    return cal


# ---------------------------------------------------------------------------------- loading
def load_partition_calibration(
    path: str,
    *,
    device: str | None = None,
    total_sms: int | None = None,
    model: str | None = None,
    strict: bool = True,
) -> PartitionCalibration:
    """Read and validate the `partition` section of a calibration file (or an old
    `greenlane-partition/1` file, logged once).

    ValueError: not a calibration file (format, malformed parameters), a calibration file
    without a `partition` section, or its SM count differs
    from `total_sms` (its curves are in SM shares of another partitioning: never usable).
    A different `device` or `model` name is a ValueError with `strict` (a cached file, whose
    name promised a match), else a warning: an explicit file is the operator's choice (the
    JCT convention: `--jct-calibration` is loaded as given)."""
    path = os.path.expanduser(path)
    data, _old = read_section(path, PARTITION_SECTION)
    if data is None:
        raise ValueError(f"{path}: this calibration file has no {PARTITION_SECTION} section")
    if data.get("format") != CALIBRATION_FORMAT:
        raise ValueError(f"{path}: its {PARTITION_SECTION} section is not {CALIBRATION_FORMAT}")
    try:
        cal = PartitionCalibration(
            device=str(data["device"]),
            total_sms=int(data["total_sms"]),
            model=str(data["model"]),
            parameters=dict(data["parameters"]),
            fit_error=dict(data.get("fit_error", {})),
            created=str(data.get("created", "")),
            source=str(data.get("source", "")),
            profile=dict(data.get("profile", {})),
            samples=[_sample_from_dict(s) for s in data.get("samples", [])],
            path=path,
        )
        cm = cal.cost_model()  # validates the parameters
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: malformed calibration ({type(e).__name__}: {e})") from e
    if cm.total_sms != cal.total_sms:
        raise ValueError(f"{path}: parameters for {cm.total_sms} SMs in a file for {cal.total_sms}")
    if total_sms is not None and cal.total_sms != total_sms:
        raise ValueError(f"{path}: calibrated for {cal.total_sms} SMs, this device has {total_sms}")
    for what, have, want in (("device", cal.device, device), ("model", cal.model, model)):
        if want is not None and have != want:
            msg = f"{path}: calibrated on {what} {have!r}, not {want!r}"
            if strict:
                raise ValueError(msg)
            log.warning("%s; using it anyway (explicit file)", msg)
    return cal


# ------------------------------------------------------------------- the fallback (H200 only)
# Fitted on the issue-6 H200 run (bench/results/partition-2026-11-29.json, "calibration"; run
# dated 2026-11-30): NVIDIA H200, 132 SMs, random:qwen2.5-3b, FlashInfer, EAGER decode
# (cuda_graphs=False). Held-out MAPE there 12.3 % (22.6 % under concurrency). The model was
# shown to overpredict split speedups (docs/benchmarks.md): a fallback, not a calibration.
H200_SEED_SOURCE = (
    "fallback: parameters fitted on the issue-6 H200 run "
    "(bench/results/partition-2026-11-29.json; eager decode; held-out MAPE 12.3 %, "
    "22.6 % concurrent), not measured on this server"
)
H200_SEED = PartitionCalibration(
    device="NVIDIA H200",
    total_sms=132,
    model="random:qwen2.5-3b",
    parameters={
        "total_sms": 132,
        "base": {
            "prefill": [0.10911142747766249, 0.18496973471392425, 0.03184453317210998],
            "decode": [0.4418595565689935, 0.0, 0.0],
        },
        "kappa": {"prefill": 0.05324431969557182, "decode": 0.0},
        "curve": {
            "prefill": {"r_sat": 0.27499999999999997, "lam": 0.75, "fixed": 0.0},
            "decode": {"r_sat": 0.175, "lam": 0.0, "fixed": 0.7000000000000001},
        },
    },
    fit_error={
        "kind": "held-out",
        "mape": 0.12301411446967093,
        "mape_concurrent": 0.22642717942501062,
    },
    created="2026-11-30",
    source=H200_SEED_SOURCE,
)
_SEEDS = (H200_SEED,)


def fallback_calibration(device: str, total_sms: int, model: str) -> PartitionCalibration | None:
    """The built-in parameters for exactly this device name, SM count and model, else None."""
    for seed in _SEEDS:
        if (seed.device, seed.total_sms, seed.model) == (device, total_sms, model):
            return seed
    return None


# ------------------------------------------------------------------- the start-up choice
@dataclass(frozen=True, slots=True)
class CalibrationChoice:
    """What a start-up does for the cost model. action: "explicit" / "cached" (load
    `calibration` from `path`), "profile" (measure now; `calibration` is the fallback to use if
    that fails, or None), "fallback" (the built-in H200 parameters), "uncalibrated"."""

    action: str
    calibration: PartitionCalibration | None
    path: str | None
    reason: str  # one line for the log

    def cost_model(self, total_sms: int) -> CostModel:
        """The model to start with (uncalibrated: the controller time-slices)."""
        if self.calibration is None:
            return CostModel(total_sms)
        return self.calibration.cost_model()


def choose_partition_calibration(
    *,
    explicit_path: str | None,
    cache_dir: str | None,
    device: str,
    total_sms: int,
    model: str,
    mode: str,
    startup_profile: bool = True,
) -> CalibrationChoice:
    """Which cost-model parameters a start-up uses, and why (see the module docstring).

    Raises (FileNotFoundError, ValueError) only for an explicit file that is missing or
    unusable: the operator named it, so starting without it would hide the mistake. A cached
    file that does not load is reported and treated as absent (a profile replaces it)."""
    if explicit_path:
        path = os.path.expanduser(explicit_path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"partition calibration file not found: {path}")
        cal = load_partition_calibration(
            path, device=device, total_sms=total_sms, model=model, strict=False
        )
        return CalibrationChoice(
            "explicit", cal, path, f"partition cost model: explicit calibration file {path}"
        )
    directory = os.path.expanduser(cache_dir or default_cache_dir())
    cached = calibration_file_path(directory, device, model)
    old = os.path.join(directory, partition_calibration_filename(device, model))
    problem = ""
    for path in (cached, old):
        if not os.path.isfile(path):
            continue
        try:
            if path == cached and read_section(path, PARTITION_SECTION)[0] is None:
                continue  # the one file holds only the JCT model's section
            cal = load_partition_calibration(
                path, device=device, total_sms=total_sms, model=model, strict=True
            )
            kind = "" if path == cached else f" (old {CALIBRATION_FORMAT} file, still read)"
            return CalibrationChoice(
                "cached",
                cal,
                path,
                f"partition cost model: {problem}cached calibration {path}{kind} (device "
                f"{device!r}, {total_sms} SMs, model {model!r}, profiled {cal.created})",
            )
        except (OSError, ValueError) as e:
            problem += f"cached calibration {path} unusable ({e}); "
    if not problem:
        problem = f"no calibration for device {device!r}, model {model!r} in {directory}; "
    seed = fallback_calibration(device, total_sms, model)
    seed_note = (
        f"FALLBACK until then: {seed.source}"
        if seed
        else "until then no parameters: the controller time-slices (as `off`)"
    )
    if mode == "auto" and startup_profile:
        return CalibrationChoice(
            "profile",
            seed,
            cached,
            f"partition cost model: {problem}profiling this GPU now (bounded to "
            f"{STARTUP_MAX_S:.0f} s; written to {cached}); {seed_note}",
        )
    why = (
        ""
        if mode != "auto"
        else "the start-up profile is off (--partition-startup-profile false); "
    )
    unused = (
        f"partition mode {mode}: the controller is not used until the mode is set to auto; "
        if mode != "auto"
        else ""
    )
    tail = "run `python -m app calibrate` to profile this GPU"
    if seed is not None:
        return CalibrationChoice(
            "fallback",
            seed,
            None,
            f"partition cost model: {problem}{why}{unused}using the {seed.source}; {tail}",
        )
    return CalibrationChoice(
        "uncalibrated",
        None,
        None,
        f"partition cost model: {problem}{why}{unused}uncalibrated: auto "
        f"time-slices until calibrated; {tail}",
    )
