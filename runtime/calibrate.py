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

It also owns the calibration *cache*: files are named by (device, model) and kept in one folder
(`default_cache_dir()`), and `resolve_calibration` decides which file a start-up loads (an
explicit path, else the cached file for this device and model, else none: the JCT model's
documented fallback default).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from policies.jct import JCTModel, calibration_filename

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
    first point), fit the JCT model, and save it to `out_path` or `out_dir`/<device, model
    file name>. Returns (model, path written or None). Raises ValueError if the grid is empty
    or the fit fails."""
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
        os.makedirs(os.path.expanduser(out_dir), exist_ok=True)
        path = os.path.join(os.path.expanduser(out_dir), calibration_filename(device, model))
    if path is not None:
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        jct.save(path)
        jct.source = f"calibration:{path}"
        say(f"[calibrate] wrote {path}")
    return jct, path


# ---------------------------------------------------------------------------------------------
# The calibration cache and the choice made at start-up
# ---------------------------------------------------------------------------------------------


def default_cache_dir() -> str:
    """`$XDG_CACHE_HOME/greenlane/calibration`, else `~/.cache/greenlane/calibration`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "greenlane", "calibration")


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
    """Which calibration file an engine should load, and why (one line for the log).

    1. `explicit_path` (e.g. `--jct-calibration`) wins; it must exist (FileNotFoundError).
    2. else the cached file for this device and model in `cache_dir` (default
       `default_cache_dir()`), if present;
    3. else None: the engine uses `JCTModel()`'s fallback default (an H100/H200-class
       Llama-3.1-8B model derived from FLOP counts, not measured) and refines it online.
    """
    if explicit_path:
        path = os.path.expanduser(explicit_path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"JCT calibration file not found: {path}")
        return path, f"JCT model: explicit calibration file {path}"
    directory = os.path.expanduser(cache_dir or default_cache_dir())
    key = model_key(model_spec)
    # Find candidates by the model part of the name first, so that the common case (no
    # calibration cached for this model) never needs torch to learn the device's name.
    model_suffix = "--" + calibration_filename("x", key).split("--", 1)[1]
    try:
        candidates = [n for n in os.listdir(directory) if n.endswith(model_suffix)]
    except OSError:
        candidates = []
    if candidates:
        device = device_name_for(device_spec)
        path = os.path.join(directory, calibration_filename(device, key))
        if os.path.isfile(path):
            return path, f"JCT model: cached calibration {path} (device {device!r}, model {key!r})"
        where = f"no calibration for device {device!r}, model {key!r} in {directory}"
    else:
        where = f"no calibration for model {key!r} in {directory}"
    return None, (
        f"JCT model: {where}; using the fallback default (H100/H200-class Llama-3.1-8B, "
        "derived not measured; refined online). Run `python -m app calibrate` to profile "
        "this device."
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
