"""`--calibrate`: profile prefill times on the serving device and write a JCT calibration file.

    jct, path = calibrate(engine.measure_prefill, device=engine.device_name,
                          model="llama-3.1-8b", out_dir=default_cache_dir(),
                          max_total_tokens=engine.max_prompt_tokens)
    jct, path = calibrate_engine(engine, model=model_key(spec), out_dir=...)  # same, with the
                                                                # CPU or GPU default grid

`measure(uncached_tokens, cached_tokens) -> seconds` must run one real prefill of
`uncached_tokens` new tokens after `cached_tokens` tokens whose KV is already in the pool, and
return its wall time with the device synchronised before and after. The engine side (which owns
the model runner) provides it (`Engine.measure_prefill`); this module only drives the profile,
fits and saves, so it stays free of tensors and is testable with a synthetic `measure`.

It also owns the calibration *file* and *cache*: one file per (device, model),
`calibration-<device>--<model>.json` in one folder (`default_cache_dir()`), format
`greenlane-calibration/1`, with a section per model:

    {"format": "greenlane-calibration/1", "device": "NVIDIA H200", "model": "random:qwen2.5-3b",
     "updated": "2026-12-01T19:30:00+00:00",
     "jct": {...JCTModel.to_dict(), "format": "greenlane-jct/1"},
     "partition": {...PartitionCalibration.to_dict(), "format": "greenlane-partition/1"}}

Either section may be missing (a CPU has no partition section). `write_section` replaces one
section and keeps the other (atomically); `read_section` reads one, from the one file or from
the old single-model files (`jct-<device>--<model>.json`, `partition-<device>--<model>.json`),
which are still accepted and logged once when read. `resolve_calibration` decides which file a
start-up loads for the JCT model (an explicit path, else the cached file for this device and
model, else none: the JCT model's documented first-principles fallback); runtime/partition/calibrate.py
does the same for the cost model. `calibrate_device` is the one profiler: the JCT points, and
on a GPU with green contexts the partition points, on one engine, into the one file.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from policies.jct import (
    CALIBRATION_FILE_FORMAT,
    JCT_SECTION,
    JCTModel,
    calibration_filename,
    one_calibration_filename,
)
from policies.jct import CALIBRATION_FORMAT as JCT_FORMAT

log = logging.getLogger("greenlane.calibration")

PARTITION_SECTION = "partition"
# The old single-model files: their format tag (that of the section they became) by section.
OLD_FORMATS = {JCT_SECTION: JCT_FORMAT, PARTITION_SECTION: "greenlane-partition/1"}

MeasureFn = Callable[[int, int], float]

# GPU profile: the PrefillOnly regime (profiles of 10k-50k tokens); 15 points x 3 repeats take
# well under a minute on an H100/H200-class GPU with an 8B model.
DEFAULT_UNCACHED_TOKENS = (128, 512, 2048, 8192, 16384)
DEFAULT_CACHED_TOKENS = (0, 4096, 16384)
DEFAULT_REPEATS = 3
# CPU profile: kept small on purpose. SmolLM2-135M on 2 cores prefills ~0.3-1k tokens/s, so
# 8 points x 2 repeats take tens of seconds, not minutes; the CPU is a development target.
CPU_UNCACHED_TOKENS = (32, 128, 512, 1024)
CPU_CACHED_TOKENS = (0, 1024)
CPU_REPEATS = 2

# Relative cost of a point for the progress ETA, in "token equivalents": one forward floor plus
# u tokens plus the attention pairs at a rough 1/4096 token per pair (the ratio of token-wise
# FLOPs to attention FLOPs per pair of a small-to-mid model). Only the ETA uses it.
_ETA_FLOOR_TOKENS = 64.0
_ETA_TOKENS_PER_PAIR = 1.0 / 4096.0


def _print_progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _eta_weight(uncached_tokens: int, cached_tokens: int) -> float:
    u = float(uncached_tokens)
    return _ETA_FLOOR_TOKENS + u + u * (u / 2.0 + cached_tokens) * _ETA_TOKENS_PER_PAIR


def profile_grid(
    uncached_tokens: Sequence[int], cached_tokens: Sequence[int], max_total_tokens: int | None
) -> list[tuple[int, int]]:
    """The (uncached, cached) points to measure, dropping those over `max_total_tokens`."""
    grid = [(u, c) for c in cached_tokens for u in uncached_tokens]
    if max_total_tokens is not None:
        grid = [(u, c) for u, c in grid if u + c <= max_total_tokens]
    return grid


def calibrate(
    measure: MeasureFn,
    *,
    device: str,
    model: str,
    out_dir: str | None = None,
    out_path: str | None = None,
    uncached_tokens: Sequence[int] = DEFAULT_UNCACHED_TOKENS,
    cached_tokens: Sequence[int] = DEFAULT_CACHED_TOKENS,
    max_total_tokens: int | None = None,
    repeats: int = 3,
    warmup: int = 1,
    progress: Callable[[str], None] | None = _print_progress,
) -> tuple[JCTModel, str | None]:
    """Measure each grid point `repeats` times (median kept, after `warmup` untimed runs of the
    first point), fit the JCT model, and write it as the `jct` section of the calibration file
    `out_path` or `out_dir`/calibration-<device>--<model>.json (another section there is
    kept). Returns (model, path written or None). Raises ValueError if the grid is empty or
    the fit fails."""
    grid = profile_grid(uncached_tokens, cached_tokens, max_total_tokens)
    if len(grid) < 3:
        raise ValueError(f"calibration needs >= 3 profile points, got {grid}")
    say = progress or (lambda _msg: None)
    for _ in range(warmup):
        measure(*grid[0])  # first-call costs (allocations, autotuning) must not skew the fit
    samples: list[tuple[int, int, float]] = []
    weights = [_eta_weight(u, c) for u, c in grid]
    t_start = time.monotonic()
    for i, (u, c) in enumerate(grid, 1):
        seconds = statistics.median(measure(u, c) for _ in range(max(repeats, 1)))
        samples.append((u, c, seconds))
        # ETA: time so far scaled by the estimated cost of the points left (an estimate only:
        # the weights are a rough cost model, refined by nothing but the elapsed time).
        elapsed_s = time.monotonic() - t_start
        eta_s = elapsed_s * sum(weights[i:]) / sum(weights[:i])
        say(
            f"[calibrate {i}/{len(grid)}] uncached={u:>6} cached={c:>6}  "
            f"{seconds * 1e3:9.2f} ms  (elapsed {elapsed_s:5.1f} s, ETA {eta_s:5.1f} s)"
        )
    jct = JCTModel(device=device, model=model)
    jct.fit(samples)
    worst = max(abs(jct.predict_s(u, c) - s) / s for u, c, s in samples)
    say(f"[calibrate] fit {jct!r}; worst relative error on the profile {worst:.1%}")
    path = out_path
    if path is None and out_dir is not None:
        path = calibration_file_path(out_dir, device, model)
    if path is not None:
        path = write_section(path, JCT_SECTION, jct.to_dict(), device=device, model=model)
        jct.source = f"calibration:{path}"
        say(f"[calibrate] wrote the {JCT_SECTION} section of {path}")
    return jct, path


# ---------------------------------------------------------------------------------------------
# The calibration cache and the choice made at start-up
# ---------------------------------------------------------------------------------------------


def default_cache_dir() -> str:
    """`$XDG_CACHE_HOME/greenlane/calibration`, else `~/.cache/greenlane/calibration`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "greenlane", "calibration")


def calibration_file_path(directory: str | None, device: str, model: str) -> str:
    """`directory` (None: `default_cache_dir()`)/calibration-<device>--<model>.json."""
    folder = os.path.expanduser(directory or default_cache_dir())
    return os.path.join(folder, one_calibration_filename(device, model))


_old_files_logged: set[str] = set()


def _note_old_file(path: str, section: str) -> None:
    """Say once per file that an old single-model file was read (no silent fallback)."""
    if path in _old_files_logged:
        return
    _old_files_logged.add(path)
    log.warning(
        "calibration: read the old %s file %s (%s); still accepted. `python -m app calibrate` "
        "writes the one file calibration-<device>--<model>.json (greenlane-calibration/1) with "
        "every section",
        section,
        path,
        OLD_FORMATS[section],
    )


def read_section(path: str, section: str) -> tuple[dict[str, Any] | None, bool]:
    """One section of a calibration file: (its dict or None when the one file lacks it,
    whether `path` is an old single-model file). An old file of `section`'s model is that
    section whole (and is logged once). ValueError: not JSON, or neither the one file nor an
    old file of this section's model. OSError: unreadable."""
    path = os.path.expanduser(path)
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from e
    fmt = data.get("format") if isinstance(data, dict) else None
    if fmt == CALIBRATION_FILE_FORMAT:
        got = data.get(section)
        if got is not None and not isinstance(got, dict):
            raise ValueError(f"{path}: malformed {section} section")
        return got, False
    if fmt == OLD_FORMATS[section]:
        _note_old_file(path, section)
        return data, True
    raise ValueError(
        f"{path}: not a {CALIBRATION_FILE_FORMAT} file nor an old {OLD_FORMATS[section]} one"
    )


def write_section(
    path: str, section: str, content: dict[str, Any], *, device: str, model: str
) -> str:
    """Write `content` as `section` of the calibration file `path` and return the path written.

    The other sections already there are kept when the file is for the same device and model
    (else they are dropped, and that is logged); an old single-model file of the other model at
    `path` becomes that section (it is not lost). Atomic: a temp file in the same folder, then a
    rename, so a server starting meanwhile reads the old file or the new one, never half."""
    path = os.path.expanduser(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    sections: dict[str, Any] = {}
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                old = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            log.warning("calibration: %s is unreadable (%s); replacing it", path, e)
            old = None
        fmt = old.get("format") if isinstance(old, dict) else None
        if fmt == CALIBRATION_FILE_FORMAT:
            if (old.get("device"), old.get("model")) == (device, model):
                sections = {k: old[k] for k in OLD_FORMATS if isinstance(old.get(k), dict)}
            else:
                log.warning(
                    "calibration: %s was for device %r, model %r; its sections are replaced by "
                    "this one for device %r, model %r",
                    path,
                    old.get("device"),
                    old.get("model"),
                    device,
                    model,
                )
        else:
            other = [k for k, f in OLD_FORMATS.items() if f == fmt and k != section]
            if other:
                sections[other[0]] = old  # an old file of the other model: keep it as a section
    sections[section] = content
    data: dict[str, Any] = {
        "format": CALIBRATION_FILE_FORMAT,
        "device": device,
        "model": model,
        "updated": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }
    data.update({k: sections[k] for k in OLD_FORMATS if k in sections})
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)
    return path


def model_key(model_spec: str) -> str:
    """The model name a calibration file is keyed by: SmolLM2-135M-Instruct for "default", a
    folder's base name for a path, the spec itself otherwise (e.g. "random:tiny")."""
    if model_spec == "default":
        return "SmolLM2-135M-Instruct"
    if os.sep in model_spec or os.path.isdir(model_spec):
        return os.path.basename(os.path.normpath(model_spec))
    return model_spec


def device_name_for(device_spec: str) -> str:
    """The device name an engine with `EngineConfig.device == device_spec` reports
    (`Engine.device_name`): "cpu", or the CUDA device's name. Imports torch only for CUDA."""
    if device_spec == "cpu":
        return "cpu"
    import torch  # lazily: callers in app/ must not load torch just to parse options

    if device_spec == "auto":
        device_spec = "cuda" if torch.cuda.is_available() else "cpu"
    if device_spec == "cpu":
        return "cpu"
    return torch.cuda.get_device_name(torch.device(device_spec))


def resolve_calibration(
    explicit_path: str | None, cache_dir: str | None, device_spec: str, model_spec: str
) -> tuple[str | None, str]:
    """Which calibration file an engine should load for its JCT model, and why (one line for
    the log). `JCTModel.load` reads the path returned, whichever of the two formats it is.

    1. `explicit_path` (e.g. `--jct-calibration`) wins: the one file (it must have a `jct`
       section) or an old `greenlane-jct/1` file; missing: FileNotFoundError, no `jct`
       section or another format: ValueError.
    2. else, in `cache_dir` (default `default_cache_dir()`), the one file for this device and
       model if it has a `jct` section, else the old `jct-<device>--<model>.json` (logged);
    3. else None: the engine uses the JCT model's first-principles fallback for this model's
       shape (`JCTModel.for_shape`: FLOP counts and weight bytes on an H100/H200-class GPU,
       not measured) and refines it online.
    """
    if explicit_path:
        path = os.path.expanduser(explicit_path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"JCT calibration file not found: {path}")
        section, old = read_section(path, JCT_SECTION)
        if section is None:
            raise ValueError(f"{path}: this calibration file has no {JCT_SECTION} section")
        kind = f"old {JCT_FORMAT} file" if old else f"calibration file, {JCT_SECTION} section"
        return path, f"JCT model: explicit {kind} {path}"
    directory = os.path.expanduser(cache_dir or default_cache_dir())
    key = model_key(model_spec)
    # Find candidates by the model part of the name first, so that the common case (no
    # calibration cached for this model) never needs torch to learn the device's name.
    model_suffix = "--" + calibration_filename("x", key).split("--", 1)[1]
    try:
        candidates = [n for n in os.listdir(directory) if n.endswith(model_suffix)]
    except OSError:
        candidates = []
    problem = ""
    if candidates:
        device = device_name_for(device_spec)
        one = os.path.join(directory, one_calibration_filename(device, key))
        if os.path.isfile(one):
            try:
                section, _ = read_section(one, JCT_SECTION)
            except (OSError, ValueError) as e:
                section, problem = None, f"{one} unusable ({e}); "
            if section is not None:
                return one, (
                    f"JCT model: cached calibration {one} (device {device!r}, model {key!r})"
                )
        old = os.path.join(directory, calibration_filename(device, key))
        if os.path.isfile(old):
            _note_old_file(old, JCT_SECTION)
            return old, (
                f"JCT model: {problem}cached calibration {old} (old {JCT_FORMAT} file, still "
                f"read; device {device!r}, model {key!r})"
            )
        where = f"no JCT calibration for device {device!r}, model {key!r} in {directory}"
    else:
        where = f"no calibration for model {key!r} in {directory}"
    return None, (
        f"JCT model: {problem}{where}; using the fallback (first principles for an "
        "H100/H200-class GPU: on CUDA from the model's shape, elsewhere Llama-3.1-8B's; not "
        "measured, refined online). Run `python -m app calibrate` to profile this device."
    )


def calibrate_engine(
    engine: Any,
    *,
    model: str,
    out_dir: str | None = None,
    out_path: str | None = None,
    uncached_tokens: Sequence[int] | None = None,
    cached_tokens: Sequence[int] | None = None,
    repeats: int | None = None,
    progress: Callable[[str], None] | None = _print_progress,
) -> tuple[JCTModel, str | None]:
    """`calibrate()` over a built, not yet started `runtime.engine.Engine`: its
    `measure_prefill`, its `device_name`, its prompt limit, and the CPU or GPU default profile
    for its device (any of which the arguments override)."""
    on_cpu = getattr(engine.device, "type", "cpu") == "cpu"
    return calibrate(
        engine.measure_prefill,
        device=engine.device_name,
        model=model,
        out_dir=out_dir,
        out_path=out_path,
        uncached_tokens=uncached_tokens
        or (CPU_UNCACHED_TOKENS if on_cpu else DEFAULT_UNCACHED_TOKENS),
        cached_tokens=cached_tokens or (CPU_CACHED_TOKENS if on_cpu else DEFAULT_CACHED_TOKENS),
        max_total_tokens=engine.max_prompt_tokens,
        repeats=repeats or (CPU_REPEATS if on_cpu else DEFAULT_REPEATS),
        progress=progress,
    )


# ---------------------------------------------------------------------------------------------
# The one profiler: every model the device supports, one engine, one file
# ---------------------------------------------------------------------------------------------
CALIBRATE_WHAT = ("all", "jct", "partition")


@dataclass(slots=True)
class CalibrationRun:
    """What `calibrate_device` did: the models fitted (None: not profiled), the files written
    (one, unless `--partition-calibration-dir` puts the partition section elsewhere), and why
    the partition points were not profiled (None when they were or were not asked for)."""

    jct: JCTModel | None = None
    partition: Any = None  # runtime.partition.calibrate.PartitionCalibration
    paths: list[str] | None = None
    partition_skipped: str | None = None


def partition_unavailable_reason(engine: Any) -> str | None:
    """Why `engine` cannot profile the SM-partition cost model (no green-context pairs), or
    None when it can."""
    if getattr(engine, "_green", None) is not None:
        return None
    return f"SM partitioning is unavailable: {engine.partition.state().reason}"


def calibrate_device(
    engine: Any,
    *,
    model: str,
    what: str = "all",
    out_path: str | None = None,
    cache_dir: str | None = None,
    partition_cache_dir: str | None = None,
    grid: dict[str, Any] | None = None,
    progress: Callable[[str], None] | None = _print_progress,
) -> CalibrationRun:
    """`python -m app calibrate`: profile a built, not yet started engine for every model its
    device supports and write their sections of one calibration file (`out_path`, else
    `cache_dir`'s file for this device and model). `what`: "all" (the JCT points, then on a
    GPU with green contexts the partition points; elsewhere the partition part is skipped and
    `partition_skipped` says why), "jct" or "partition" (ValueError where unavailable).
    `grid`: the JCT profile's `uncached_tokens` / `cached_tokens` / `repeats` overrides. The
    partition section goes to `partition_cache_dir`'s file when that is given and no
    `out_path` is (`--partition-calibration-dir`)."""
    if what not in CALIBRATE_WHAT:
        raise ValueError(f"what must be one of {CALIBRATE_WHAT}, got {what!r}")
    run = CalibrationRun(paths=[])
    why_not = partition_unavailable_reason(engine)
    if what == "partition" and why_not:
        raise ValueError(why_not)
    if what in ("jct", "all"):
        log.info("calibrating the JCT model on %s for %s", engine.device_name, model)
        run.jct, path = calibrate_engine(
            engine,
            model=model,
            out_dir=None if out_path else (cache_dir or default_cache_dir()),
            out_path=out_path,
            progress=progress,
            **{k: v for k, v in (grid or {}).items() if v is not None},
        )
        if path is not None:
            run.paths.append(path)
    if what in ("partition", "all"):
        if why_not:
            run.partition_skipped = why_not
            log.info("calibration: partition section not profiled (%s)", why_not)
        else:
            from runtime.partition.gpu import profile_engine  # lazily: loads torch

            log.info("profiling the partition cost model on %s", engine.device_name)
            run.partition = profile_engine(
                engine,
                full=True,
                cache_dir=partition_cache_dir or cache_dir,
                out_path=out_path,
                progress=progress,
            )
            if run.partition.path not in run.paths:
                run.paths.append(run.partition.path)
    return run
