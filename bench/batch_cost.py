"""What a prefill step of warm scoring requests costs, measured three ways (engine-level
diagnostic, issue 17).

Why: the simulator prices a forward from `bench.prefill_profile`'s wall times of isolated,
synchronised steps. On the H100 (2026-12-05, docs/scheduling.md "The default pool's ceiling was
the load generator's") the served steps of warm post-recommendation requests took 0.27-0.70x
that price on the device, the gap widening with the batch (a profile batch of 24: 7.35 ms a
request; served batches of 59: 2.57 ms of device time a request). One cause, found by reading
the code (about half of that gap by arithmetic: ~7.5 GB moved a 14k-token request on the 8B
shape, ~2.2-2.5 ms): the profiles discarded the new tokens' KV, so every warm point attended a
copy of its context made in every layer (the FlashInfer backend's gathered path), while a served
warm request keeps its few new tokens' KV whenever the pool has room and reads the context in
place (paged). This reads each point on both paths, and kept with the members sharing one
context (one user's requests share a profile), alternated, with the wall time and the device
span (events around the launch, as the serial executor times a served step) of each:

- `gathered` against `kept`: the attention path (the profiles' old price against today's);
- `kept` against `kept-shared`: the memory reads of separate contexts;
- wall against device: the host.

    python -m bench.batch_cost --model random:llama-3.1-8b --device cuda \\
        --points 16:14336:1,16:14336:8,16:14336:24,16:14336:48 --out $OUT/batch-cost.json

A point is u:c:B (B requests of u new tokens after c cached). A variant that does not fit the
pool is recorded as an error, the others go on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

# name -> Engine.measure_prefill_batch's keyword arguments
VARIANTS: dict[str, dict[str, bool]] = {
    "gathered": {"keep_kv": False},
    "kept": {"keep_kv": True},
    "kept-shared": {"keep_kv": True, "share_context": True},
}


def measure(
    engine: Any, points: list[tuple[int, int, int]], repeats: int
) -> dict[str, dict[str, Any]]:
    """Per point and variant: the wall and device readings (s) and their medians per request
    (ms). One untimed reading of each first (first-use costs), then `repeats` rounds, each
    point's variants alternated."""
    readings: dict[tuple[str, str], dict[str, list[float]]] = {}
    errors: dict[str, str] = {}

    def one(u: int, c: int, b: int, variant: str, record: bool) -> None:
        key = (f"{u}:{c}:{b}", variant)
        if key in errors:
            return
        spans: list[float] = []
        try:
            wall_s = engine.measure_prefill_batch(
                [(u, c)] * b, device_s_out=spans, **VARIANTS[variant]
            )
        except Exception as exc:  # noqa: BLE001 - one variant failing must not end the run
            errors[f"{key[0]} {variant}"] = f"{type(exc).__name__}: {exc}"[:300]
            return
        if record:
            r = readings.setdefault(key, {"wall_s": [], "device_s": []})
            r["wall_s"].append(wall_s)
            r["device_s"].extend(spans)

    for u, c, b in points:
        for v in VARIANTS:
            one(u, c, b, v, record=False)
    for _ in range(repeats):
        for u, c, b in points:
            for v in VARIANTS:
                one(u, c, b, v, record=True)
    out: dict[str, dict[str, Any]] = {}
    for (point, variant), r in readings.items():
        b = int(point.split(":")[2])
        wall, dev = statistics.median(r["wall_s"]), statistics.median(r["device_s"])
        out.setdefault(point, {})[variant] = {
            "wall_s": r["wall_s"],
            "device_s": r["device_s"],
            "wall_ms_per_request": wall * 1e3 / b,
            "device_ms_per_request": dev * 1e3 / b,
        }
    for name, err in errors.items():
        point, variant = name.split(" ")
        out.setdefault(point, {})[variant] = {"error": err}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.batch_cost", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", default="random:llama-3.1-8b")
    p.add_argument("--device", default="auto")
    p.add_argument("--points", default="16:14336:1,16:14336:8,16:14336:24,16:14336:48")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rev", help="git revision as the caller knows it (recorded beside git's)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    points = [tuple(int(x) for x in item.split(":")) for item in args.points.split(",") if item]
    if any(len(pt) != 3 for pt in points):
        raise SystemExit("--points takes u:c:B items")

    from bench.prefill_profile import git_revision, measurement_engine

    t0 = time.monotonic()
    engine = measurement_engine(model=args.model, device=args.device)
    try:
        results = measure(engine, points, args.repeats)  # type: ignore[arg-type]
        device = engine.device_name
    finally:
        engine.shutdown()
    record = {
        "command": "python -m bench.batch_cost "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "git_revision": git_revision(args.rev),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": device,
        "note": "engine-level diagnostic (isolated steps before the engine thread starts); "
        "not a headline figure",
        "wall_s_total": round(time.monotonic() - t0, 1),
        "points": results,
    }
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    for point, variants in results.items():
        for v, r in variants.items():
            if "error" in r:
                print(f"{point} {v}: {r['error']}")
            else:
                print(
                    f"{point} {v}: wall {r['wall_ms_per_request']:.2f} ms/req, "
                    f"device {r['device_ms_per_request']:.2f} ms/req"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
