"""Measure a prefill profile (bench/sim_profile.py's format) through the engine.

    python -m bench.prefill_profile --model random:llama-3.1-8b --device cuda \
        --out $OUT/prefill-profile-h200.json --jct-out /tmp/jct-h200.json     # < 1 min on an H200
    python -m bench.prefill_profile --model random:tiny --device cpu --out /tmp/p.json  # seconds

Method: one engine (not started: `Engine.measure_prefill(u, c)` runs one real prefill of u new
tokens after c tokens of context already in the KV pool, device synchronised, and returns its
wall time). Cold points are c = 0; warm points (c > 0) time a prefill over a cached prefix,
on the attention path a served scoring request of that shape takes: its KV kept, and the
cached prefix read in place, when the pool holds it (the record's `kv_path` says per point;
profiles before 2026-12-05 have none: they discarded the new KV, so every warm point was timed
on the gathered path that copies the prefix in every layer, a path served steps take only when
the pool is too full to keep a suffix).
Batch points (`--batch-points u:c:B`) time one forward over B such prefills (the engine batches
short scoring prompts and warm posts up to its token budget). One untimed warm-up pass over the
grid (first-call costs: kernel plans, allocator growth), then `--repeats` timed passes, each over
the whole grid in a shuffled order (seeded), so that slow drift shows up as noise at every point
rather than as a bias at some; a point's values are in pass order, which
`PrefillProfile.split_repeats` relies on (it halves them by position). Points whose warm-up
reading is under `--cheap-below-ms` are read `--cheap-samples` times a pass (back to back):
a short prefill after a long cached prefix costs milliseconds but read 9-26 % apart between
passes, and two H200 profiles of five passes a day apart put its median 12-45 % apart, enough to
swing the simulator's SRJF/FCFS prediction by 20-30 points (docs/scheduling.md); more readings
of those points cost seconds. `--deadline-s` stops after the last complete pass that fits (the
file says how many passes were done).

`--jct-out FILE` also writes the JCT calibration (greenlane-jct/1) an engine would fit on the
calibration half of the repeats: give it to the servers (`--jct-calibration FILE`), and the
simulator's default setup fits the very same model (bench/sim.py, `build_setup`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import statistics
import subprocess
import sys
import time
from typing import Any

from bench.sim_profile import PrefillProfile, ProfilePoint, fit_jct

# GPU grid: the scoring workloads' range (150-token posts after 11k-17k profiles, cold 11k-17k
# prompts, short prompts) in ~4.4 s per pass for an 8B model on an H200 (interim profile's
# estimate); 32k-token cold prefills are in the committed engine results already.
GPU_UNCACHED = (64, 150, 512, 2048, 8192, 16384)
GPU_CACHED = (0, 4096, 16384, 32768)
GPU_BATCH_POINTS = ((150, 16384, 4), (150, 16384, 16), (512, 0, 8), (1024, 0, 8))
GPU_REPEATS = 5
# Points under 100 ms a reading (u <= 2048 at every cached level, the batch of four posts) are
# read four times a pass: ~8 s more over five passes on the H200.
GPU_CHEAP_SAMPLES = 4
CPU_UNCACHED = (16, 64, 256)
CPU_CACHED = (0, 256)
CPU_BATCH_POINTS = ((16, 256, 4),)
CPU_REPEATS = 3


def measurement_engine(**config: Any) -> Any:
    """An engine that is not started, for engine-level measurements (this module,
    bench.batch_cost, bench.mixed_step): `config` (EngineConfig fields: model, device, ...)
    with the partition off and no JCT calibration file, its outputs dropped."""
    from runtime.config import EngineConfig
    from runtime.engine import Engine

    return Engine(EngineConfig(partition="off", jct_calibration=None, **config), lambda _out: None)


def git_revision(given: str | None) -> dict[str, Any]:
    """The revision of the tree this runs from, read now; `given` (--rev) is kept beside it
    (a device copy may carry no or stale git metadata: both are recorded, the reader decides)."""
    rec: dict[str, Any] = {"given": given}
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if head.returncode == 0:
            rec["read_at_run_time"] = head.stdout.strip()
            rec["dirty"] = bool(dirty.stdout.strip())
        else:
            rec["read_at_run_time"] = None
            rec["error"] = (head.stderr or "").strip()[:200]
    except (OSError, subprocess.SubprocessError) as exc:
        rec["read_at_run_time"] = None
        rec["error"] = f"{type(exc).__name__}: {exc}"[:200]
    return rec


def grid_points(
    uncached: list[int], cached: list[int], batch_points: list[tuple[int, int, int]], limit: int
) -> list[tuple[int, int, int]]:
    """(u, c, B) points to measure: the batch-1 grid within the prompt limit, then the batch
    points whose members fit it."""
    pts = [(u, c, 1) for c in cached for u in uncached if u + c <= limit]
    pts += [(u, c, b) for u, c, b in batch_points if u + c <= limit and b > 1]
    return pts


def measure_profile(
    engine: Any,
    points: list[tuple[int, int, int]],
    repeats: int,
    *,
    warmup_passes: int = 1,
    deadline_s: float | None = None,
    seed: int = 0,
    say: Any = None,
    cheap_samples: int = 1,
    cheap_below_s: float = 0.1,
) -> tuple[dict[tuple[int, int, int], list[float]], dict[str, Any]]:
    """Seconds per point in pass order (one value a complete pass; `cheap_samples` for a point
    whose warm-up reading was under `cheap_below_s`), and a record of what happened."""
    say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
    t_start = time.monotonic()
    rng = random.Random(seed)
    errors: dict[str, str] = {}

    device_s: dict[str, list[float]] = {}

    def one(u: int, c: int, b: int, timed: bool = True) -> float | None:
        """One reading: a step plan of b requests straight to the runner, before the engine
        thread starts (`Engine.measure_prefill_batch`: each its own context, the new KV kept
        when the pool holds the batch, as served). Its device span is kept beside it."""
        key = f"{u}:{c}:{b}"
        if key in errors:
            return None
        try:
            spans: list[float] = []
            wall_s = float(engine.measure_prefill_batch([(u, c)] * b, device_s_out=spans))
            if timed:
                device_s.setdefault(key, []).extend(spans)
            return wall_s
        except Exception as exc:  # noqa: BLE001 - one point failing must not end the profile
            errors[key] = f"{type(exc).__name__}: {exc}"[:300]
            say(f"[profile] point u={u} c={c} B={b} failed: {errors[key]}")
            return None

    samples = dict.fromkeys(points, 1)
    for _ in range(warmup_passes):
        for p in points:
            v = one(*p, timed=False)
            if v is not None and v < cheap_below_s:
                samples[p] = max(1, cheap_samples)
    warm_s = time.monotonic() - t_start
    values: dict[tuple[int, int, int], list[float]] = {p: [] for p in points}
    passes = 0
    pass_s: list[float] = []
    for r in range(repeats):
        if (
            deadline_s is not None
            and passes
            and (time.monotonic() - t_start + max(pass_s) > deadline_s)
        ):
            say(f"[profile] stopping after {passes} passes: the next would pass the deadline")
            break
        t0 = time.monotonic()
        order = list(points)
        rng.shuffle(order)
        for p in order:
            for _ in range(samples[p]):
                v = one(*p)
                if v is not None:
                    values[p].append(v)
        passes += 1
        pass_s.append(time.monotonic() - t0)
        say(f"[profile] pass {r + 1}/{repeats} took {pass_s[-1]:.1f} s")
    record = {
        "warmup_passes": warmup_passes,
        "warmup_s": round(warm_s, 2),
        "passes_done": passes,
        "passes_asked": repeats,
        "pass_s": [round(s, 2) for s in pass_s],
        "errors": errors,
        "pass_order": "shuffled per pass (seeded); a point's values in pass order",
        "samples_per_pass": {f"{u}:{c}:{b}": k for (u, c, b), k in samples.items() if k > 1},
        "cheap_below_s": cheap_below_s,
        # Diagnostic beside the wall times the simulator prices: each point's device span
        # (events around the launch, as a served step's `device_ms` is read), median of the
        # timed readings. Wall minus device is the host's share of an isolated step.
        "device_s_median": {k: statistics.median(v) for k, v in device_s.items() if v},
    }
    return values, record


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.prefill_profile", description=__doc__)
    p.add_argument("--model", default="random:llama-3.1-8b")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-gpu-memory-gb", type=float)
    p.add_argument("--uncached", help="comma list of uncached token counts (default per device)")
    p.add_argument("--cached", help="comma list of cached token counts (default per device)")
    p.add_argument("--batch-points", help="comma list of u:c:B (B prefills in one forward)")
    p.add_argument("--repeats", type=int, help=f"timed passes (default GPU {GPU_REPEATS})")
    p.add_argument("--warmup-passes", type=int, default=1)
    p.add_argument(
        "--cheap-samples",
        type=int,
        help="readings a pass of a point whose warm-up read under --cheap-below-ms "
        f"(default GPU {GPU_CHEAP_SAMPLES}, CPU 1; needs a warm-up pass)",
    )
    p.add_argument("--cheap-below-ms", type=float, default=100.0)
    p.add_argument("--deadline-s", type=float, help="stop after the last pass that fits")
    p.add_argument("--seed", type=int, default=0, help="pass order shuffle")
    p.add_argument("--rev", help="git revision as the caller knows it (recorded beside git's)")
    p.add_argument("--no-progress", action="store_true", help="no per-pass lines on stderr")
    p.add_argument("--out", required=True, help="profile JSON")
    p.add_argument("--jct-out", help="also write the JCT calibration of the calibration half")
    return p


def _ints(text: str | None, default: tuple[int, ...]) -> list[int]:
    return [int(x) for x in text.split(",") if x] if text else list(default)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.monotonic()
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    import torch

    from runtime.calibrate import model_key

    engine = measurement_engine(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        max_gpu_memory_gb=args.max_gpu_memory_gb,
    )
    init_s = time.monotonic() - t0
    on_cpu = engine.device.type == "cpu"
    try:
        uncached = _ints(args.uncached, CPU_UNCACHED if on_cpu else GPU_UNCACHED)
        cached = _ints(args.cached, CPU_CACHED if on_cpu else GPU_CACHED)
        if args.batch_points:
            batch = [tuple(int(v) for v in x.split(":")) for x in args.batch_points.split(",")]
        else:
            batch = list(CPU_BATCH_POINTS if on_cpu else GPU_BATCH_POINTS)
        if any(len(b) != 3 for b in batch):
            raise SystemExit("--batch-points takes u:c:B items")
        limit = engine.max_prompt_tokens
        points = grid_points(uncached, cached, batch, limit)  # type: ignore[arg-type]
        repeats = args.repeats or (CPU_REPEATS if on_cpu else GPU_REPEATS)
        print(
            f"[profile] {engine.device_name}, {args.model}: {len(points)} points x {repeats} "
            f"passes (engine built in {init_s:.1f} s; prompt limit {limit})",
            file=sys.stderr,
            flush=True,
        )
        deadline = None if args.deadline_s is None else args.deadline_s - init_s
        values, record = measure_profile(
            engine,
            points,
            repeats,
            warmup_passes=args.warmup_passes,
            deadline_s=deadline,
            seed=args.seed,
            say=(lambda _msg: None) if args.no_progress else None,
            cheap_samples=args.cheap_samples or (1 if on_cpu else GPU_CHEAP_SAMPLES),
            cheap_below_s=args.cheap_below_ms / 1e3,
        )
        device_name = engine.device_name
        block_size = engine.block_manager.block_size
        # Which attention path each point took (Engine.measure_prefill_batch's default: as a
        # served scoring request would). Profiles without this key were all measured with the
        # suffix discarded, their cached points on the gathered path served steps rarely take.
        kv_path = {
            f"{u}:{c}:{b}": "kept" if engine.served_keeps_kv([(u, c)] * b) else "discarded"
            for u, c, b in points
        }
        backend = getattr(getattr(engine, "backend", None), "name", None)
    finally:
        engine.shutdown()
    skipped = [f"{u}:{c}:{b}" for (u, c, b), v in values.items() if not v]
    pts = [
        ProfilePoint(
            u,
            c,
            tuple(v),
            b,
            "measured",
            "Engine.measure_prefill_batch",
        )
        for (u, c, b), v in values.items()
        if v
    ]
    profile = PrefillProfile(
        pts,
        device=device_name,
        model=args.model,
        origin="measured",
        note=f"measured through the engine by bench.prefill_profile ({record['passes_done']} "
        "passes)",
        provenance={
            "command": "python -m bench.prefill_profile "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            "git_revision": git_revision(args.rev),
            "date": started,
            "device": device_name,
            "engine": {
                "dtype": args.dtype,
                "attention_backend": backend,
                "block_size": block_size,
                "prompt_limit": limit,
                # Hybrid prefill's chunk the forwards ran at (sized from memory since
                # 7992938): a cold forward's price depends on it (6 % less device time a
                # token at 16,384 than at 2,048, H100).
                "prefill_chunk_tokens": engine.config.chunk_tokens(),
                "init_s": round(init_s, 2),
            },
            "torch": torch.__version__,
            "python": platform.python_version(),
            "measurement": record,
            "kv_path": kv_path,
            "points_without_values": skipped,
            "wall_s": round(time.monotonic() - t0, 2),
        },
        block_size=block_size,
    )
    profile.save(args.out)
    print(f"[profile] wrote {args.out} ({len(pts)} points)", file=sys.stderr, flush=True)
    if args.jct_out:
        calib, _ = profile.split_repeats()
        jct = fit_jct(calib, source="fit")
        jct.device, jct.model = device_name, model_key(args.model)
        jct.save(args.jct_out)
        print(f"[profile] wrote {args.jct_out}: {jct!r}", file=sys.stderr, flush=True)
    print(json.dumps(profile.describe()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
