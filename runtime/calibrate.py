"""`--calibrate`: profile prefill times on the serving device and write a JCT calibration file.

    model = calibrate(measure, device="NVIDIA H200", model="llama-3.1-8b",
                      out_dir="~/.cache/greenlane", max_total_tokens=engine.max_prompt_tokens)

`measure(uncached_tokens, cached_tokens) -> seconds` must run one real prefill of
`uncached_tokens` new tokens after `cached_tokens` tokens whose KV is already in the pool, and
return its wall time with the device synchronised before and after. The engine side (which owns
the model runner) provides it; this module only drives the profile, fits and saves, so it
stays free of tensors and is testable with a synthetic `measure`.
"""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Callable, Sequence

from policies.jct import JCTModel, calibration_filename

MeasureFn = Callable[[int, int], float]

DEFAULT_UNCACHED_TOKENS = (128, 512, 2048, 8192, 16384)
DEFAULT_CACHED_TOKENS = (0, 4096, 16384)


def _print_progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


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
    for i, (u, c) in enumerate(grid, 1):
        seconds = statistics.median(measure(u, c) for _ in range(max(repeats, 1)))
        samples.append((u, c, seconds))
        say(f"[calibrate {i}/{len(grid)}] uncached={u:>6} cached={c:>6}  {seconds * 1e3:9.2f} ms")
    jct = JCTModel(device=device, model=model)
    jct.fit(samples)
    worst = max(abs(jct.predict_s(u, c) - s) / s for u, c, s in samples)
    say(f"[calibrate] fit {jct!r}; worst relative error on the profile {worst:.1%}")
    path = out_path
    if path is None and out_dir is not None:
        os.makedirs(os.path.expanduser(out_dir), exist_ok=True)
        path = os.path.join(os.path.expanduser(out_dir), calibration_filename(device, model))
    if path is not None:
        jct.save(path)
        jct.source = f"calibration:{path}"
        say(f"[calibrate] wrote {path}")
    return jct, path
