"""Measured prefill-time profiles: the file format, and service times drawn from one.

A profile is what `python -m bench.prefill_profile` measures on a device through the engine:
wall seconds of one prefill forward at grid points (uncached tokens u, cached tokens c, batch
B), each measured several times. The simulator draws its *service times* from it
(`ProfileService`), independently of the JCT model the scheduler ranks with; that model is
fitted on a separate half of the repeats (`split_repeats`, `fit_jct`), as the engine fits its
calibration on a profile taken at another time than the serving it predicts.

File format (`greenlane-prefill-profile/1`, JSON):

    {"format": "greenlane-prefill-profile/1",
     "device": "NVIDIA H200", "model": "random:llama-3.1-8b",
     "origin": "measured" | "derived",   # derived: not a measurement of this grid (see note)
     "note": "...", "provenance": {...},  # command, git revision, date, sources
     "block_size": 16,                    # the engine's KV block size (informational)
     "points": [
        {"uncached": 1024, "cached": 0, "batch": 1,       # batch: identical requests in one
         "seconds": [0.0203, 0.0214, ...],                #   forward (optional, default 1)
         "origin": "measured", "source": "..."},          # optional per point
        ...]}

`seconds` are in repeat order (repeat i of every point was taken in the same pass over the
grid), which is what `split_repeats` relies on.

Service-time model (no fitted formula: interpolation of the measurements):
* median(u, c): for each measured cached level c_j with >= 2 batch-1 points, time is
  piecewise-linear in u between measured points; above the largest u it follows the power law
  through the last two points (log-log: prefill time grows faster than linearly, by attention);
  below the smallest u it is flat (a forward of a few tokens costs its floor, not less), the
  attention to a cached prefix included (kernels compute whole tiles of query rows). Between
  levels it is linear in c (attention grows linearly in the cached length for a fixed u);
  above the largest level it is extrapolated from the two largest.
* noise: the median times a ratio drawn from the measured repeats (seconds / median) of the
  nearest measured point with >= 2 repeats; pooled over all such points for a point without.
* batch of n prefills in one forward: tw(sum of u) + sum_i [median(u_i, c_i) - tw(u_i)], where
  tw(u) = median(u, 0) - k * u^2 / 2 is the token-wise part of a cold prefill (its floor and
  matrix products) and k the attention cost per query-key pair, read off the profile itself:
  the median of (median(u, c) - median(u, 0)) / (u * c) over measured points with c > 0. So the
  batch pays the token-wise work of all its new tokens together, as one forward runs them, and
  each member's own attention. With batch points in the profile, the rule is corrected by the
  geometric mean of measured / rule over them (`batch_correction`); without, the correction is 1
  (stated in `describe()`).
Pure Python: no torch, no numpy.
"""

from __future__ import annotations

import bisect
import json
import math
import random
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from policies.jct import JCTModel

PROFILE_FORMAT = "greenlane-prefill-profile/1"
REPO_DIR = Path(__file__).resolve().parent.parent
# The default: the H200 profile measured through the engine by plan o of bench/gpu_next.sh on
# 2026-12-01 (bench.prefill_profile, random:llama-3.1-8b, FlashInfer, 5 interleaved passes; cold,
# warm and batch points; its provenance is in the file). It stays under bench/results/ with the
# name the run gave it, next to the GPU results it belongs to, because bench.sim_vs_gpu looks for
# a run's profile beside its results file: one copy, not two that could drift.
DEFAULT_PROFILE = REPO_DIR / "bench" / "results" / "prefill-profile-gpu-scheduling-2026-12-01.json"
# The interim profile used before that run (derived from earlier H200 results; see
# bench/derive_profile.py), kept so that the results computed on it stay reproducible
# (`--profile bench/profiles/h200-llama-3.1-8b-derived.json`).
INTERIM_PROFILE = REPO_DIR / "bench" / "profiles" / "h200-llama-3.1-8b-derived.json"


@dataclass(frozen=True, slots=True)
class ProfilePoint:
    """One grid point: `batch` identical prefills of `uncached` tokens after `cached`."""

    uncached: int
    cached: int
    seconds: tuple[float, ...]
    batch: int = 1
    origin: str = "measured"
    source: str = ""

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "uncached": self.uncached,
            "cached": self.cached,
            "batch": self.batch,
            "seconds": list(self.seconds),
            "origin": self.origin,
        }
        if self.source:
            out["source"] = self.source
        return out


@dataclass(slots=True)
class PrefillProfile:
    """A loaded profile (see the module docstring for the format)."""

    points: list[ProfilePoint]
    device: str = "unknown"
    model: str = "unknown"
    origin: str = "measured"
    note: str = ""
    provenance: dict[str, Any] = field(default_factory=dict)
    block_size: int = 16
    path: str = ""

    # -- persistence ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": PROFILE_FORMAT,
            "device": self.device,
            "model": self.model,
            "origin": self.origin,
            "note": self.note,
            "provenance": self.provenance,
            "block_size": self.block_size,
            "points": [p.to_dict() for p in self.points],
        }
        return out

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any], path: str = "") -> PrefillProfile:
        where = path or "profile"
        if data.get("format") != PROFILE_FORMAT:
            raise ValueError(
                f"{where}: not a {PROFILE_FORMAT} file (format={data.get('format')!r})"
            )
        points = []
        for i, p in enumerate(data.get("points") or []):
            try:
                secs = tuple(float(s) for s in p["seconds"])
                pt = ProfilePoint(
                    int(p["uncached"]),
                    int(p["cached"]),
                    secs,
                    int(p.get("batch", 1)),
                    str(p.get("origin", data.get("origin", "measured"))),
                    str(p.get("source", "")),
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{where}: point {i} is malformed: {exc}") from None
            if not secs or any(not (s > 0 and math.isfinite(s)) for s in secs):
                raise ValueError(f"{where}: point {i} needs positive finite seconds")
            if pt.uncached < 1 or pt.cached < 0 or pt.batch < 1:
                raise ValueError(f"{where}: point {i} needs uncached >= 1, cached >= 0, batch >= 1")
            points.append(pt)
        prof = cls(
            points,
            device=str(data.get("device", "unknown")),
            model=str(data.get("model", "unknown")),
            origin=str(data.get("origin", "measured")),
            note=str(data.get("note", "")),
            provenance=dict(data.get("provenance") or {}),
            block_size=int(data.get("block_size", 16)),
            path=path,
        )
        prof.check()
        return prof

    @classmethod
    def load(cls, path: str | Path) -> PrefillProfile:
        """One profile file, or several separated by commas, pooled (`pooled`)."""
        paths = [x for x in str(path).split(",") if x]
        if len(paths) > 1:
            return cls.pooled([cls.load(x) for x in paths])
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f), str(path))

    @classmethod
    def pooled(cls, profiles: Sequence[PrefillProfile]) -> PrefillProfile:
        """Profiles of one model on one kind of device measured at different times, as one:
        each grid point's repeats are the repeats of every profile that measured it (in
        profile order; `split_repeats` still halves them by position), points measured by one
        only kept as they are. Why: two H200 profiles a day apart read the points of a short
        prefill after a long cached prefix 12-28 % apart (five repeats each), enough to move
        the simulator's SRJF/FCFS prediction by 20-30 points; pooling halves what one
        machine's reading weighs."""
        if not profiles:
            raise ValueError("pooled: no profiles")
        first = profiles[0]
        for prof in profiles[1:]:
            if (prof.device, prof.model) != (first.device, first.model):
                raise ValueError(
                    f"pooled: {prof.path or 'a profile'} is {prof.model} on {prof.device}, "
                    f"{first.path or 'the first'} {first.model} on {first.device}"
                )
        seconds: dict[tuple[int, int, int], list[float]] = {}
        meta: dict[tuple[int, int, int], ProfilePoint] = {}
        for prof in profiles:
            for pt in prof.points:
                key = (pt.uncached, pt.cached, pt.batch)
                seconds.setdefault(key, []).extend(pt.seconds)
                meta.setdefault(key, pt)
        points = [
            ProfilePoint(k[0], k[1], tuple(v), k[2], meta[k].origin, meta[k].source)
            for k, v in seconds.items()
        ]
        paths = [prof.path or "?" for prof in profiles]
        origin = "measured" if all(x.origin == "measured" for x in profiles) else "derived"
        prof = cls(
            points,
            device=first.device,
            model=first.model,
            origin=origin,
            note=f"pooled repeats of {len(profiles)} profiles",
            provenance={"pooled": [x.provenance for x in profiles], "paths": paths},
            block_size=first.block_size,
            path=",".join(paths),
        )
        prof.check()
        return prof

    def check(self) -> None:
        """Raise ValueError unless at least one cached level has two batch-1 points."""
        if not _levels(self.points):
            raise ValueError(
                f"{self.path or 'profile'}: needs >= 2 batch-1 points (different uncached "
                "lengths) at one cached length at least"
            )

    # -- halves -------------------------------------------------------------------------------
    def split_repeats(self) -> tuple[PrefillProfile, PrefillProfile]:
        """(calibration half, service half): even-position repeats vs odd-position ones.

        A point with a single value appears in both halves (its prediction error is then only
        the JCT formula's, not the measurement noise's); `describe()` counts them."""

        def half(parity: int, tag: str) -> PrefillProfile:
            pts = []
            for p in self.points:
                secs = p.seconds[parity::2] if len(p.seconds) > 1 else p.seconds
                pts.append(ProfilePoint(p.uncached, p.cached, secs, p.batch, p.origin, p.source))
            return PrefillProfile(
                pts,
                self.device,
                self.model,
                self.origin,
                f"{tag} half of {self.path or 'a profile'}",
                self.provenance,
                self.block_size,
                f"{self.path}#{tag}",
            )

        return half(0, "calibration"), half(1, "service")

    def device_priced(self) -> PrefillProfile | None:
        """This profile with each point's recorded device span (median) for its seconds: the
        same forwards priced without the host's share of an isolated step (bench.prefill_profile
        records `device_s_median` since 2026-12-05). None unless every point has one (older
        profiles, pooled ones). A diagnostic to set beside served steps' device times, not a
        service model: a served step's host time is not zero."""
        medians = (self.provenance.get("measurement") or {}).get("device_s_median") or {}
        pts = []
        for p in self.points:
            v = medians.get(f"{p.uncached}:{p.cached}:{p.batch}")
            if not v or not v > 0:
                return None
            pts.append(ProfilePoint(p.uncached, p.cached, (float(v),), p.batch, p.origin, p.source))
        return PrefillProfile(
            pts,
            self.device,
            self.model,
            self.origin,
            f"device spans of {self.path or 'a profile'}",
            self.provenance,
            self.block_size,
            f"{self.path}#device",
        )

    def describe(self) -> dict[str, Any]:
        single = sum(1 for p in self.points if len(p.seconds) == 1)
        return {
            "path": self.path,
            "device": self.device,
            "model": self.model,
            "origin": self.origin,
            "num_points": len(self.points),
            "num_single_value_points": single,
            "num_batch_points": sum(1 for p in self.points if p.batch > 1),
            "uncached_range": [
                min(p.uncached for p in self.points),
                max(p.uncached for p in self.points),
            ],
            "cached_levels": sorted({p.cached for p in self.points if p.batch == 1}),
        }


def _levels(points: Iterable[ProfilePoint]) -> dict[int, list[ProfilePoint]]:
    """Batch-1 points per cached length, sorted by uncached; levels with < 2 points dropped."""
    by_c: dict[int, dict[int, list[float]]] = {}
    for p in points:
        if p.batch == 1:
            by_c.setdefault(p.cached, {}).setdefault(p.uncached, []).extend(p.seconds)
    return {
        c: [ProfilePoint(u, c, tuple(s)) for u, s in sorted(us.items())]
        for c, us in sorted(by_c.items())
        if len(us) >= 2
    }


def _interp(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """Piecewise-linear through (xs, ys); power-law extrapolation above, flat below."""
    if x <= xs[0]:
        return ys[0]
    x0, x1, y0, y1 = xs[-2], xs[-1], ys[-2], ys[-1]
    if x > x1:
        if y0 > 0 and y1 > y0:
            return y1 * (x / x1) ** (math.log(y1 / y0) / math.log(x1 / x0))
        return y1 + (y1 - y0) * (x - x1) / (x1 - x0)
    i = bisect.bisect_left(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def warm_points_path(profile: PrefillProfile) -> str:
    """Which attention path the profile's warm points (cached > 0) were timed on, as the
    simulator's results say it: profiles before 2026-12-05 (no `kv_path` in their provenance;
    pooled ones, per member) discarded the new KV, so their warm points paid a per-layer copy
    of the context that a served warm request with room in the pool does not."""
    members = profile.provenance.get("pooled") or [profile.provenance]
    paths = [(m or {}).get("kv_path") for m in members]
    if all(p is None for p in paths):
        return "gathered (a profile from before kv_path: warm points copied their context)"
    if any(p is None for p in paths):
        return "mixed (pooled with a profile from before kv_path)"
    # A point that got no values (its batch did not fit the pool) records the path it was
    # planned on but priced nothing: left out.
    unvalued = [set((m or {}).get("points_without_values") or ()) for m in members]
    warm = {
        v
        for p, skip in zip(paths, unvalued, strict=True)
        for k, v in p.items()
        if int(k.split(":")[1]) > 0 and k not in skip
    }
    return "served: " + (", ".join(sorted(warm)) or "no warm points")


class ProfileService:
    """Forward times drawn from a profile: interpolated medians times measured noise."""

    def __init__(self, profile: PrefillProfile) -> None:
        self.profile = profile
        levels = _levels(profile.points)
        self._cs = list(levels)
        self._curves = [
            ([float(p.uncached) for p in pts], [p.median_s for p in pts]) for pts in levels.values()
        ]
        self._u_range = (
            min(p.uncached for pts in levels.values() for p in pts),
            max(p.uncached for pts in levels.values() for p in pts),
        )
        noisy = [p for p in profile.points if p.batch == 1 and len(p.seconds) >= 2]
        self._noise_points = [
            (math.log(p.uncached), p.cached, tuple(s / p.median_s for s in p.seconds))
            for p in noisy
        ]
        pair_costs = [
            (p.median_s - self.median_s(p.uncached, 0)) / (p.uncached * p.cached)
            for p in profile.points
            if p.batch == 1 and p.cached > 0
        ]
        # Attention cost per query-key pair, read off the profile (0 without cached levels).
        self.k_s_per_pair = max(statistics.median(pair_costs), 0.0) if pair_costs else 0.0
        self.batch_correction = 1.0
        ratios = [
            p.median_s / self._batch_rule_s([(p.uncached, p.cached)] * p.batch)
            for p in profile.points
            if p.batch > 1
        ]
        if ratios:
            self.batch_correction = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        self.batch_correction_source = (
            f"geometric mean of measured/rule over {len(ratios)} batch point(s)"
            if ratios
            else "none: the profile has no batch points (correction 1)"
        )

    # -- medians ------------------------------------------------------------------------------
    def median_s(self, uncached: int, cached: int = 0) -> float:
        """Interpolated median seconds of one prefill of `uncached` tokens after `cached`."""
        u = float(max(uncached, 1))
        c = float(max(cached, 0))
        # Below the grid a forward costs what the grid's shortest query costs, its attention
        # to a cached prefix included: attention kernels compute whole tiles of 64-128 query
        # rows per head, so a query of a few rows reads the prefix's KV and fills one tile all
        # the same. The H200 profile reads that flatness inside the grid: 64 and 150 new tokens
        # after 4k, 16k or 32k cached tokens differ by their token-wise part alone (their
        # attention to the prefix 3.9 / 11.5 / 22.7 ms against 3.9 / 12.0 / 23.2 ms at
        # `da95cc8`). Scaling it with the query length instead (as until 2026-12-04) priced a
        # few-token query after a 14k prefix at 0.5 ms in a batch of sixteen, and the replay of
        # the engine's default pool (hit rate 0.997) sustained 455 QPS where the GPU held 90.
        # (Those H200 figures were timed with the new tokens' KV discarded, so the prefix was
        # copied out of the pool in every layer, a path served warm requests do not take when
        # the pool has room; profiles with a `kv_path` record time the served path:
        # bench/prefill_profile.py, docs/scheduling.md "The simulator's price of the GPU's
        # batches".)
        return self._grid_s(max(u, float(self._u_range[0])), c)

    def _grid_s(self, u: float, c: float) -> float:
        vals = [_interp(u, xs, ys) for xs, ys in self._curves]
        cs = self._cs
        if len(cs) == 1:
            out = vals[0]
        elif c <= cs[0]:
            out = vals[0]
        else:
            i = min(bisect.bisect_right(cs, c), len(cs) - 1)
            c0, c1 = cs[i - 1], cs[i]
            out = vals[i - 1] + (vals[i] - vals[i - 1]) * (c - c0) / (c1 - c0)
        return max(out, 1e-6)

    def in_range(self, uncached: int, cached: int) -> bool:
        """Whether (u, c) lies inside the measured grid (no extrapolation)."""
        return self._u_range[0] <= uncached <= self._u_range[1] and cached <= self._cs[-1]

    def _token_wise_s(self, uncached: int) -> float:
        """The cold prefill's time less its own causal attention."""
        u = max(uncached, 1)
        return max(self.median_s(u, 0) - self.k_s_per_pair * u * u / 2, 1e-6)

    def _batch_rule_s(self, items: Sequence[tuple[int, int]]) -> float:
        total_u = sum(u for u, _ in items)
        own = sum(self.median_s(u, c) - self._token_wise_s(u) for u, c in items)
        return self._token_wise_s(total_u) + own

    def median_forward_s(self, items: Sequence[tuple[int, int]]) -> float:
        """Median seconds of one forward over `items` ((uncached, cached) per request)."""
        if len(items) == 1:
            return self.median_s(*items[0])
        return self._batch_rule_s(items) * self.batch_correction

    # -- noise ---------------------------------------------------------------------------------
    def noise_ratio(self, uncached: int, cached: int, rng: random.Random) -> float:
        """A measured seconds/median ratio near (u, c); 1.0 if nothing was repeated."""
        if not self._noise_points:
            return 1.0
        lu = math.log(max(uncached, 1))
        # Distance: log-uncached, and cached in units of 16k tokens (levels are ~that apart).
        best = min(
            self._noise_points, key=lambda p: (p[0] - lu) ** 2 + ((p[1] - cached) / 16384.0) ** 2
        )
        return rng.choice(best[2])

    def forward_s(self, items: Sequence[tuple[int, int]], rng: random.Random) -> float:
        """One sampled forward time over `items` (noise drawn at the largest member)."""
        u, c = max(items, key=lambda it: it[0])
        return self.median_forward_s(items) * self.noise_ratio(u, c, rng)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "profile",
            **self.profile.describe(),
            "warm_points_path": warm_points_path(self.profile),
            "attention_s_per_pair": self.k_s_per_pair,
            "batch_correction": self.batch_correction,
            "batch_correction_source": self.batch_correction_source,
            "noise": (
                f"measured repeats of {len(self._noise_points)} point(s)"
                if self._noise_points
                else "none (no point has repeats)"
            ),
        }


class JCTService:
    """The old simulator's service model, kept for comparison: the JCT model's own batch
    prediction times a log-normal factor. The scheduler then ranks with near-perfect
    knowledge (issue 17: flattering)."""

    def __init__(self, model: JCTModel, noise_sigma: float = 0.05) -> None:
        self.model = model
        self.noise_sigma = noise_sigma

    def median_s(self, uncached: int, cached: int = 0) -> float:
        return self.model.predict_s(uncached, cached)

    def median_forward_s(self, items: Sequence[tuple[int, int]]) -> float:
        return self.model.predict_batch_s(items)

    def in_range(self, uncached: int, cached: int) -> bool:
        return True

    def forward_s(self, items: Sequence[tuple[int, int]], rng: random.Random) -> float:
        t = self.model.predict_batch_s(items)
        return t * math.exp(rng.gauss(0.0, self.noise_sigma)) if self.noise_sigma > 0 else t

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "jct (the scheduler's own model; flattering)",
            "noise_sigma": self.noise_sigma,
            **self.model.coefficients,
            "source": self.model.source,
        }


def fit_jct(profile: PrefillProfile, *, source: str | None = None) -> JCTModel:
    """The JCT model an engine calibrated on `profile` would use: a fit of the batch-1
    points' medians (as `runtime.calibrate` keeps the median of each point's repeats)."""
    samples = [(p.uncached, p.cached, p.median_s) for p in profile.points if p.batch == 1]
    jct = JCTModel(device=profile.device, model=profile.model)
    jct.fit(samples)
    jct.source = source or f"fit:{profile.path or 'profile'}"
    return jct
