"""Stage latency vs SM share (Nexus-style), and the split controller (Nexus Alg. 1).

Model (all latencies in ms, SM shares r in (0, 1] of the device's SMs):

  T_stage(shape, r) = base(shape) * (f + (1 - f) * S(1) / S(r))     with the saturation curve
  S(r) = r                       for r <= R_sat      (compute scales with SMs)
       = R_sat + lam * (r - R_sat) for r > R_sat     (diminishing returns, 0 <= lam <= 1)
  and f the fixed (launch-bound) fraction of the stage that does not scale with SMs: an eager
  decode step is mostly kernel-launch gaps, so its latency is flat over wide SM ranges and then
  rises sharply on few SMs; a single saturation curve (f = 0) cannot fit both.

  base_prefill = a0 + a1 * tokens + a2 * attention_pairs   (x layers; whole GPU)
  base_decode  = b0 + b1 * batch  + b2 * kv_tokens         (x layers; whole GPU)
  (a profile must vary batch and context independently, or b1/b2 are not identifiable.)

Concurrent execution on a disjoint pair adds a memory-bandwidth contention term. A phase on a
small partition issues few memory requests and loses most of the bandwidth to a large
neighbour, so the slowdown grows with the ratio of the neighbour's share to its own:
  T_conc = T_alone(r_self) * (1 + kappa * r_other / r_self) * (1 + nu * t_neighbour_ms)
The last factor is the neighbour's *load*, which the profile cannot see (it measures one light
decode batch beside one prefill launched whole): while serving, a split prefill is launched in
slices of layers that the host tops up between the decode steps it waits for, and the heavier
the decode beside it, the longer each of those steps and the slower the prefill. t_neighbour_ms
is the neighbour's predicted step on its own partition; nu (per ms) was fitted on the H200's
serving records (`DEFAULT_PREFILL_INTERFERENCE_PER_MS`, `fit_interference`, bench/cost_replay.py).
All parameters are fitted from a profile measured on the actual GPU (`fit`), then refined online
from measured latencies (`observe`: an affine correction per (stage, regime, split), measured ~
offset + scale x prediction fitted on recent relative errors, with a per-(stage, regime)
fallback for splits never measured; a correction's first measurement replaces the prior
instead of moving it by a fifth -- a split's prior was 1.5-2x off on the H200 and the slow
start was most of its error -- and a fixed cost that short prefills feel most is an offset,
not a factor that swings between short and long ones).
Every observation is scored against
the prediction made *before* it updates the model, so `error_stats()` is a genuine
out-of-sample prediction error (MAPE).

Controller: below `kv_switch` KV usage favour prefill (minimise prefill latency with decode
within `beta` of its best), above it favour decode (minimise decode latency with prefill within
`alpha` of its best); greedy search over the pre-created splits from the current one; then the
split is kept only if running the phases concurrently is predicted faster than time-slicing the
whole GPU for the same work (H200.md: with eager kernels it often is not); hysteresis stops
flapping; a manual pin wins over everything. With a TBT target it also weighs, for a prefill
that may be cut by tokens, chunked time-slicing (chunks sized to the target on the whole GPU,
`ChunkInput`) against the best split or layer slices, and takes what meets the target and
finishes the prefill first (docs/partition.md, "How auto chooses").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from runtime.online_fit import DecayingLine
from runtime.partition import TIME_SLICE, SplitDecision
from runtime.scheduler import PrefillCost, tbt_chunk_tokens

PREFILL = "prefill"
DECODE = "decode"
# A kind of prediction's measured error counts once this many are logged (fewer: noise).
ERROR_MIN_SAMPLES = 8
# The online correction (`_Correction`): the past's weight per observation (0.8, as the one
# factor's EMA before it: decode steps beside a split change with the prefill next to them,
# and 0.9-0.95 tracked them worse in the replays of bench/cost_replay.py), how much the
# predictions must vary (coefficient of variation) and how many must be in before a fixed
# cost is told from a scale, and the scale's bounds.
CORRECTION_DECAY = 0.8
CORRECTION_MIN_CV = 0.25
CORRECTION_MIN_COUNT = 3.0
CORRECTION_MIN_SCALE, CORRECTION_MAX_SCALE = 0.1, 10.0
# A split prefill's slowdown per ms of the concurrent decode step on the other partition
# (`CostModel.interference`), fitted on the H200's serving records (plans s and t, 3B and 8B,
# 2026-12-02 at aebd7bb and 0475b77; bench/cost_replay.py): 0.0068 and 0.0218 per ms on each
# day's records alone, 0.0071-0.0085 on both together. Loosely pinned (31 split prefills in
# all, nearly all 8,192 tokens on 112 SMs): a default until a profile measures it per device.
# The decode side shows no such term (0).
DEFAULT_PREFILL_INTERFERENCE_PER_MS = 0.0085


def interference_slope(groups: list[tuple[np.ndarray, np.ndarray]]) -> float:
    """The slowdown per ms of the neighbour's step that best explains `groups` of (log of
    measured / predicted without the term, the neighbour's predicted step in ms), each group
    with a level of its own (a run, a model): least absolute deviation of each group's
    residuals from their median, over a grid of 0..0.05 per ms (robust to the odd slow
    step). `CostModel.fit_interference` fits one group; bench/cost_replay.py one per run."""
    best, best_err = 0.0, math.inf
    for nu in np.linspace(0.0, 0.05, 501):
        err = 0.0
        for log_ratio, x in groups:
            r = log_ratio - np.log1p(nu * x)
            err += float(np.sum(np.abs(r - np.median(r))))
        if err < best_err - 1e-12:
            best, best_err = float(nu), err
    return best


# Spans of a prompt over which `_chunk_steps` holds the chunk size constant.
CHUNK_SPANS = 16

# Added to the controller's objective where a split breaks the bound on the phase not
# favoured (ms): above any feasible split's value.
_INFEASIBLE_MS = 1e6


def _chunk_steps(
    cost: PrefillCost, room_s: float, context_tokens: int, num_tokens: int, cap: int | None
) -> tuple[int, float]:
    """(steps, prefill ms) to prefill `num_tokens` after `context_tokens` in chunks cut by
    time to `room_s` a step (`tbt_chunk_tokens`, at most `cap`). The chunks shrink as the
    context grows: every step reads its whole context again (the corrected cost's context
    term, `CorrectedCost`), so the prompt is walked in CHUNK_SPANS spans, each at the chunk
    its middle context gets, and every step pays its own context read. Costed as one whole
    marginal (until 2026-12-06), 40k- and 44k-token scoring prompts beside chat on an H100
    (8B, 80 ms target, the run's own fitted costs) were predicted at 32 and 37 steps, 2.1 and
    2.4 s, where their chunks (2,038 tokens at first, ~350 at 44k of context) took 42-43 and
    51-57 steps, 2.6-2.7 and 3.2-3.5 s; walked so, 46 and 56 steps, 3.0 and 3.7 s."""
    span = num_tokens / CHUNK_SPANS
    steps = prefill_s = 0.0
    for i in range(CHUNK_SPANS):
        ctx = int(context_tokens + (i + 0.5) * span)
        tokens = tbt_chunk_tokens(cost, room_s, ctx)
        if cap is not None:
            tokens = min(tokens, cap)
        tokens = max(1, min(tokens, num_tokens))
        k = span / tokens  # steps in this span (fractional)
        steps += k
        prefill_s += k * cost.marginal_s(tokens, ctx)
    return max(2, math.ceil(steps - 1e-9)), prefill_s * 1e3


@dataclass(frozen=True, slots=True)
class PrefillShape:
    num_tokens: int
    attention_pairs: float  # sum over sequences of q * (context + (q + 1) / 2)
    num_layers: int = 1

    @staticmethod
    def from_seqs(seqs: list[tuple[int, int]], num_layers: int = 1) -> PrefillShape:
        """seqs: (num_context_tokens, num_query_tokens) per sequence."""
        tokens = sum(q for _, q in seqs)
        pairs = sum(q * (c + (q + 1) / 2) for c, q in seqs)
        return PrefillShape(tokens, pairs, num_layers)

    def features(self) -> list[float]:
        # Scaled to keep the least-squares system well conditioned.
        return [
            self.num_layers,
            self.num_layers * self.num_tokens / 1e3,
            self.num_layers * self.attention_pairs / 1e6,
        ]


@dataclass(frozen=True, slots=True)
class DecodeShape:
    batch_size: int
    kv_tokens: int  # total context tokens read by the step
    num_layers: int = 1

    def features(self) -> list[float]:
        return [
            self.num_layers,
            self.num_layers * self.batch_size / 1e2,
            self.num_layers * self.kv_tokens / 1e5,
        ]


Shape = PrefillShape | DecodeShape


@dataclass(slots=True)
class SaturationCurve:
    r_sat: float = 1.0
    lam: float = 1.0
    fixed: float = 0.0  # fraction of the whole-GPU latency that does not scale with SMs

    def speed(self, r: float) -> float:
        r = min(max(r, 1e-6), 1.0)
        return r if r <= self.r_sat else self.r_sat + self.lam * (r - self.r_sat)

    def slowdown(self, r: float) -> float:
        """T(r) / T(1)."""
        return self.fixed + (1.0 - self.fixed) * self.speed(1.0) / self.speed(r)


@dataclass(slots=True)
class ProfileSample:
    stage: str  # PREFILL | DECODE
    shape: Shape
    sms: int
    latency_ms: float
    other_sms: int = 0  # SMs of the other phase running concurrently (0 = alone)
    # The other phase's work beside it (its mean shape), where known (`fit_interference`).
    neighbour: Shape | None = None


@dataclass(slots=True)
class _Correction:
    """measured ≈ offset_ms + scale · the uncorrected prediction, for one (stage, regime[,
    split]): fitted online on relative errors over recent observations (`DecayingLine`, decay
    CORRECTION_DECAY). Affine, not one factor: on a pinned split (H200, 3B, plan z at
    8c86337) short prefills (150-token scoring suffixes, chat prompts) measured 1.3-3.1x their
    uncorrected prediction and 8k-16k-token ones 1.28-1.35x; one factor moved a fifth of the
    way per step chased both, and even the long ones read ~30 % MAPE. Relative weights (1 /
    measured²): a 5-ms prefill counts as much as a 250-ms one. Until x varies enough to tell a
    slope from an offset (CORRECTION_MIN_CV), or when the fit wants a negative fixed cost, it
    is one factor (the relative-error fit of y = c · x); its first observation sets it whole."""

    scale: float = 1.0
    offset_ms: float = 0.0
    line: DecayingLine = field(default_factory=lambda: DecayingLine(CORRECTION_DECAY))

    def apply(self, raw_ms: float) -> float:
        return self.offset_ms + self.scale * raw_ms

    def update(self, raw_ms: float, measured_ms: float) -> None:
        self.line.add(raw_ms, measured_ms, 1.0 / (measured_ms * measured_ms))
        slope = self.line.slope(CORRECTION_MIN_CV, CORRECTION_MIN_COUNT)
        if slope is not None and CORRECTION_MIN_SCALE <= slope <= CORRECTION_MAX_SCALE:
            mx, my = self.line.means()
            offset = my - slope * mx
            if offset >= 0.0:
                self.scale, self.offset_ms = slope, offset
                return
        c = self.line.ratio()
        if c is not None:
            self.scale = min(CORRECTION_MAX_SCALE, max(CORRECTION_MIN_SCALE, c))
            self.offset_ms = 0.0


@dataclass(slots=True)
class _ErrorLog:
    abs_pct: list[float] = field(default_factory=list)
    total: float = 0.0  # sum of abs_pct: the mean in O(1) (the controller reads it per choice)
    # measured / predicted of the same predictions: which way they miss (the MAPE cannot say)
    ratios: list[float] = field(default_factory=list)

    def add(self, predicted: float, measured: float) -> float:
        e = abs(predicted - measured) / max(measured, 1e-9)
        self.abs_pct.append(e)
        self.ratios.append(measured / max(predicted, 1e-9))
        self.total += e
        if len(self.abs_pct) > 2000:  # bounded: a rolling window
            del self.abs_pct[:1000]
            del self.ratios[:1000]
            self.total = sum(self.abs_pct)  # once per 1,000 additions
        return e

    def mean(self) -> float:
        return self.total / len(self.abs_pct) if self.abs_pct else math.nan


def _lstsq_nonneg(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with negative coefficients dropped and refitted (tiny NNLS)."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            return coef
        active = [a for a, s in zip(active, sol, strict=True) if s > 0]
    return coef


class CostModel:
    """Stage latency predictions for one GPU and model (see the module docstring).

    `calibrated` is False for a model built without parameters (`CostModel(total_sms)`): its
    flat defaults say nothing about the device, so the controller time-slices instead of
    trusting them (`SplitController.choose`). `fit` and `from_dict` make calibrated models;
    `source` says where the parameters came from (for the log and the admin page).
    """

    def __init__(
        self, total_sms: int, *, calibrated: bool = False, source: str = "uncalibrated"
    ) -> None:
        self.total_sms = total_sms
        self.calibrated = calibrated
        self.source = source
        self.base: dict[str, list[float]] = {PREFILL: [0.0, 1.0, 1.0], DECODE: [0.0, 1.0, 1.0]}
        self.curve: dict[str, SaturationCurve] = {
            PREFILL: SaturationCurve(),
            DECODE: SaturationCurve(),
        }
        self.kappa: dict[str, float] = {PREFILL: 0.0, DECODE: 0.0}
        # Slowdown per ms of the neighbour's step when its shape is known (`predict`'s
        # `neighbour`); calibrated models start from the H200 fit (`fit`, `from_dict`).
        self.interference: dict[str, float] = {PREFILL: 0.0, DECODE: 0.0}
        # Online refinement per "stage/regime" (regime "alone" or "concurrent") and per
        # "stage/regime/sms" (one split); a split never measured uses its regime's.
        self.correction: dict[str, _Correction] = {}
        self.errors: dict[str, _ErrorLog] = {}
        # One prefill model (issue 13): when set, a prefill's whole-GPU latency (ms) comes from
        # here -- the JCT model that the scheduler's and auto's chunks are sized with -- and
        # this model adds what SM shares change (saturation curve, contention, per-split
        # corrections). None (or it answers None): its own fitted base (the calibration file's).
        self.whole_prefill_ms: Callable[[PrefillShape], float | None] | None = None

    # ---- prediction -----------------------------------------------------------------------
    def base_ms(self, stage: str, shape: Shape) -> float:
        """Whole-GPU latency of `stage` for `shape` (ms), before any correction."""
        if stage == PREFILL and self.whole_prefill_ms is not None:
            assert isinstance(shape, PrefillShape)
            ms = self.whole_prefill_ms(shape)
            if ms is not None:
                return ms
        return float(np.dot(self.base[stage], shape.features()))

    def _corrected(self, stage: str, regime: str, sms: int, raw_ms: float) -> float:
        c = self.correction.get(f"{stage}/{regime}/{sms}") or self.correction.get(
            f"{stage}/{regime}"
        )
        return raw_ms if c is None else c.apply(raw_ms)

    def predict_alone(self, stage: str, shape: Shape, sms: int, *, corrected: bool = True) -> float:
        t = self.base_ms(stage, shape) * self.curve[stage].slowdown(sms / self.total_sms)
        return self._corrected(stage, "alone", sms, t) if corrected else t

    def contention(self, stage: str, sms: int, other_sms: int) -> float:
        """Slowdown factor (>= 1) of `stage` on `sms` SMs from the other phase's traffic."""
        if other_sms <= 0:
            return 1.0
        return 1.0 + self.kappa[stage] * other_sms / max(sms, 1)

    def neighbour_ms(self, stage: str, sms: int, other_sms: int, neighbour: Shape) -> float:
        """The neighbour's predicted step (ms) on its `other_sms` beside `stage` on `sms`."""
        other = DECODE if stage == PREFILL else PREFILL
        return self.predict(other, neighbour, other_sms, sms)

    def interference_factor(
        self, stage: str, sms: int, other_sms: int, neighbour: Shape | None
    ) -> float:
        """Slowdown factor (>= 1) of `stage` from the neighbour's load: 1 + nu * its step (ms)."""
        nu = self.interference.get(stage, 0.0)
        if other_sms <= 0 or neighbour is None or nu <= 0.0:
            return 1.0
        return 1.0 + nu * self.neighbour_ms(stage, sms, other_sms, neighbour)

    def predict(
        self,
        stage: str,
        shape: Shape,
        sms: int,
        other_sms: int = 0,
        *,
        neighbour: Shape | None = None,
    ) -> float:
        """Latency of `stage` on `sms` SMs while the other phase runs on `other_sms` (0 = alone).
        `neighbour`: the other phase's shape, where known (its load slows this one)."""
        if other_sms <= 0:
            return self.predict_alone(stage, shape, sms)
        return self._corrected(
            stage, "concurrent", sms, self._uncorrected(stage, shape, sms, other_sms, neighbour)
        )

    def _uncorrected(
        self, stage: str, shape: Shape, sms: int, other_sms: int, neighbour: Shape | None
    ) -> float:
        t = self.predict_alone(stage, shape, sms, corrected=False)
        if other_sms <= 0:
            return t
        t *= self.contention(stage, sms, other_sms)
        return t * self.interference_factor(stage, sms, other_sms, neighbour)

    # ---- fitting --------------------------------------------------------------------------
    @classmethod
    def fit(cls, total_sms: int, samples: list[ProfileSample]) -> CostModel:
        """Fit base latencies (whole-GPU samples), saturation curves (alone on a partition)
        and contention coefficients (concurrent samples)."""
        m = cls(total_sms, calibrated=True, source="fit")
        # (A profile runs one light decode beside the prefill: no load to fit a slope on.)
        m.interference[PREFILL] = DEFAULT_PREFILL_INTERFERENCE_PER_MS
        for stage in (PREFILL, DECODE):
            full = [
                s for s in samples if s.stage == stage and s.sms == total_sms and s.other_sms == 0
            ]
            if full:
                x = np.array([s.shape.features() for s in full])
                y = np.array([s.latency_ms for s in full])
                m.base[stage] = _lstsq_nonneg(x, y).tolist()
            part = [s for s in samples if s.stage == stage and s.other_sms == 0]
            if part:
                m.curve[stage] = m._fit_curve(stage, part)
            conc = [s for s in samples if s.stage == stage and s.other_sms > 0]
            if conc:
                ks = []
                for s in conc:
                    alone = m.predict_alone(stage, s.shape, s.sms, corrected=False)
                    ks.append((s.latency_ms / alone - 1.0) / (s.other_sms / s.sms))
                m.kappa[stage] = max(0.0, float(np.median(ks)))
        return m

    def fit_interference(self, stage: str, samples: list[ProfileSample]) -> float:
        """Fit `interference[stage]` (slowdown per ms of the neighbour's step) from measured
        concurrent latencies whose neighbour shape is known, e.g. a server's split steps
        (bench/cost_replay.py). Only the slope is fitted: the level is what the online
        correction learns, so each sample counts by how its measured / predicted ratio moves
        with the neighbour's step (least absolute log deviation from the median, over a
        grid: robust to the odd slow step). Returns it."""
        rows = [
            (s.latency_ms, self.predict(stage, s.shape, s.sms, s.other_sms, neighbour=None), s)
            for s in samples
            if s.stage == stage and s.other_sms > 0 and s.neighbour is not None
        ]
        rows = [(y, p, s) for y, p, s in rows if y > 0 and p > 0]
        if len(rows) < 2:
            return self.interference.get(stage, 0.0)
        log_ratio = np.log([y / p for y, p, _ in rows])
        x = np.array([self.neighbour_ms(stage, s.sms, s.other_sms, s.neighbour) for *_, s in rows])
        self.interference[stage] = interference_slope([(log_ratio, x)])
        return self.interference[stage]

    def _fit_curve(self, stage: str, samples: list[ProfileSample]) -> SaturationCurve:
        # Grid search in log space (vectorised over samples): r_sat x lam x fixed fraction.
        base = np.array([max(self.base_ms(stage, s.shape), 1e-9) for s in samples])
        meas = np.array([s.latency_ms for s in samples])
        r = np.clip(np.array([s.sms / self.total_sms for s in samples]), 1e-6, 1.0)
        best, best_err = SaturationCurve(), math.inf
        for r_sat in np.linspace(0.05, 1.0, 39):
            for lam in np.linspace(0.0, 1.0, 21):
                speed = np.where(r <= r_sat, r, r_sat + lam * (r - r_sat))
                ratio = (r_sat + lam * (1.0 - r_sat)) / speed if r_sat < 1.0 else 1.0 / r
                for fixed in np.linspace(0.0, 0.9, 10):
                    pred = base * (fixed + (1.0 - fixed) * ratio)
                    err = float(np.sum(np.log(pred / meas) ** 2))
                    if err < best_err:
                        best = SaturationCurve(float(r_sat), float(lam), float(fixed))
                        best_err = err
        return best

    # ---- online refinement and validation ---------------------------------------------------
    def observe(
        self,
        stage: str,
        shape: Shape,
        sms: int,
        measured_ms: float,
        other_sms: int = 0,
        *,
        neighbour: Shape | None = None,
    ) -> float:
        """Score the prediction for a measured latency, then refine. Returns |error| / measured.
        `neighbour`: the other phase's (mean) shape while this one ran, where known."""
        regime = "concurrent" if other_sms > 0 else "alone"
        key = f"{stage}/{regime}"
        raw = self._uncorrected(stage, shape, sms, other_sms, neighbour)
        pred = self._corrected(stage, regime, sms, raw)  # = predict(...), computed once
        err = self.errors.setdefault(key, _ErrorLog()).add(pred, measured_ms)
        if raw > 0 and measured_ms > 0:
            # The split's own correction and its regime's (what unmeasured splits use) both
            # learn from it; a split's first measurement sets its own whole.
            for k in (f"{key}/{sms}", key):
                self.correction.setdefault(k, _Correction()).update(raw, measured_ms)
        return err

    def score(self, key: str, predicted_ms: float, measured_ms: float) -> float:
        """Record how far a prediction made elsewhere from this model was off (e.g. a chunked
        time-slice step, key "chunked/step"), without refining anything. Returns
        |error| / measured."""
        return self.errors.setdefault(key, _ErrorLog()).add(predicted_ms, measured_ms)

    def recent_error(self, key: str, min_samples: int = ERROR_MIN_SAMPLES) -> float:
        """Mean |predicted - measured| / measured of the predictions logged under `key`
        ("prefill/concurrent", "decode/concurrent", ...) over the rolling window; 0 until
        `min_samples` are in (no evidence yet: the configured margins alone apply)."""
        log = self.errors.get(key)
        if log is None or len(log.abs_pct) < min_samples:
            return 0.0
        return log.mean()

    def error_stats(self) -> dict[str, float | int]:
        """Out-of-sample |predicted - measured| / measured: `mape_<stage>_<regime>` (a split's
        prefill and decode are the concurrent regime), `mape_chunked_step` (auto's chunked
        time-slice steps), and `mape` over all of them; `num_<kind>` beside each says over
        how many steps of the rolling window (a split may run a handful a run: its MAPE is
        then a few readings, not a rate), and `ratio_p50_<kind>` the median measured /
        predicted (above 1: the kind is predicted too short)."""
        out: dict[str, float | int] = {}
        all_e: list[float] = []
        for key, log in self.errors.items():
            if log.abs_pct:
                kind = key.replace("/", "_")
                out[f"mape_{kind}"] = float(np.mean(log.abs_pct))
                out[f"num_{kind}"] = len(log.abs_pct)
                out[f"ratio_p50_{kind}"] = float(np.median(log.ratios))
                all_e.extend(log.abs_pct)
        out["mape"] = float(np.mean(all_e)) if all_e else float("nan")
        out["num_observations"] = len(all_e)
        return out

    # ---- persistence (runtime/partition/calibrate.py writes the calibration file) -----------
    def to_dict(self) -> dict:
        """The fitted parameters (JSON-ready); `from_dict` inverts it."""
        return {
            "total_sms": self.total_sms,
            "base": self.base,
            "kappa": self.kappa,
            "curve": {k: asdict(v) for k, v in self.curve.items()},
            "interference": self.interference,
        }

    @classmethod
    def from_dict(cls, d: dict, source: str = "parameters") -> CostModel:
        """A calibrated model from `to_dict`'s output. Raises KeyError/TypeError/ValueError on
        a malformed dict (missing stage, wrong coefficient count, bad curve field)."""
        m = cls(int(d["total_sms"]), calibrated=True, source=source)
        base = {k: [float(x) for x in v] for k, v in d["base"].items()}
        kappa = {k: float(v) for k, v in d["kappa"].items()}
        curve = {
            k: SaturationCurve(**{f: float(x) for f, x in v.items()}) for k, v in d["curve"].items()
        }
        for stage in (PREFILL, DECODE):
            if len(base[stage]) != 3 or stage not in kappa or stage not in curve:
                raise ValueError(f"cost-model parameters incomplete for stage {stage!r}")
        m.base, m.kappa, m.curve = base, kappa, curve
        # Files written before the term have none: the H200 fit (as a fresh profile gets).
        nu = d.get("interference") or {PREFILL: DEFAULT_PREFILL_INTERFERENCE_PER_MS}
        m.interference = {stage: max(0.0, float(nu.get(stage, 0.0))) for stage in (PREFILL, DECODE)}
        return m


# ---------------------------------------------------------------------------------- controller


@dataclass(frozen=True, slots=True)
class RowStream:
    """A planned prefill that streams its rows (one sequence past the hybrid chunk and the
    prefill budget: `DecoderLayer.forward_rows`): the shape sub-layer slices are cut from, a
    layer's rows in pieces of whole `chunk_tokens` chunks (`SplitController._layer_slices`)."""

    context_tokens: int
    num_tokens: int
    chunk_tokens: int


def num_row_chunks(num_tokens: int, chunk_tokens: int) -> int:
    """Hybrid chunks a row-streamed layer of `num_tokens` rows runs (the last may be short)."""
    return -(-num_tokens // chunk_tokens)


# `SplitController._row_slices`'s inputs (the row stream, room ms, error, layers) and the
# layer's predicted time, which moves when the prefill model does; and its answer (slice
# ends, the heaviest slice's ms; None: no cut fits).
RowSlicesKey = tuple["RowStream", float, float, int, float]
RowSlicesCut = tuple[tuple[int, ...], float] | None


@dataclass(frozen=True, slots=True)
class LayerSlices:
    """Time-slicing a prefill by layers (`SplitController._layer_slices`): `layers` a slice,
    or sub-layer slices cut at `slice_ends` (`SplitDecision.slice_ends`; empty: whole
    layers), the predicted completion (the slices and the decode steps between them), ms,
    and what a decode step waits meanwhile: the heaviest slice and the step itself, ms."""

    layers: int
    predicted_ms: float
    decode_wait_ms: float
    slice_ends: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ChunkInput:
    """The chunked time-slicing option of `SplitController.choose`: the prefill is the head of
    the queue, may be cut by tokens across steps, and each step's chunk is sized so that the
    decodes plus the chunk meet `tbt_slo_ms`."""

    # Whole-GPU marginal prefill seconds: the JCT model, as the engine corrects it online
    # (`runtime.partition.corrections.CorrectedCost`).
    prefill_cost: PrefillCost
    context_tokens: int  # the prefill's context (prefix-cache hits or earlier chunks)
    # The chunks' aim: the target (--tbt-slo-ms, else the controller's) divided by the
    # engine's measured tail factor (`runtime.partition.corrections.TailFactor`).
    tbt_slo_ms: float
    # The chunked step's decode part (ms): the engine's decode base, the one `step_offset_ms`
    # is fitted against (`StepPacer.decode_base_s`; 0: none yet, the cost model predicts it).
    decode_step_ms: float = 0.0
    # What a step that mixes a chunk with decodes takes beyond the decode step, whatever the
    # chunk's size (it runs without the decode graphs): `CorrectedCost.offset_s`, in ms.
    step_offset_ms: float = 0.0
    # The most prefill tokens a chunked step may take whatever the room (the engine's cap on
    # a step with decodes, `--mixed-step-token-budget`, less the decodes); None: the room alone.
    max_chunk_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    kv_switch: float = 0.70  # KV usage at which the objective flips from prefill to decode
    alpha: float = 1.3  # prefill slack when decode is favoured
    beta: float = 1.1  # decode slack when prefill is favoured
    hysteresis_sms: int = 8  # ignore split changes smaller than this
    min_gain: float = 0.05  # a change must improve the objective by this fraction
    min_split_speedup: float = 1.1  # split only if concurrent beats time-slicing by this
    allow_time_slice: bool = True
    # A TBT target (ms) replaces beta's relative slack while prefill is favoured: time-slice
    # (prefill gets every SM, decode waits for it, as `off`) whenever the predicted wait meets
    # the target, else the split with the most prefill SMs whose decode step meets it.
    tbt_slo_ms: float | None = None
    # With a TBT target that time-slicing a whole prefill would miss: may also time-slice by
    # slices of layers (prefill on every SM, a decode step between slices) when that is
    # predicted to finish the prefill sooner than the best split meeting the target.
    layer_slicing: bool = False


class SplitController:
    """Chooses among pre-created splits (prefill SM counts) or time-slicing."""

    def __init__(
        self, model: CostModel, splits: list[int], config: ControllerConfig | None = None
    ) -> None:
        if not splits:
            raise ValueError("no pre-created splits")
        self.model = model
        self.splits = sorted(splits)
        self.config = config or ControllerConfig()
        self.current = TIME_SLICE
        self.pinned: int | None = None
        self._num_evals = 0  # cost-model evaluations of the last choose()
        # The last sub-layer cut (`_row_slices`), by its inputs and the layer's predicted
        # time: a prompt waiting at the queue's head is judged every step, and its cut
        # costs ~1 ms (a 56k-token prompt in 2k chunks) to ~6 (in 512-token chunks).
        self._row_slices_memo: tuple[RowSlicesKey, RowSlicesCut] | None = None

    def pin(self, prefill_sms: int) -> None:
        if prefill_sms != TIME_SLICE and prefill_sms not in self.splits:
            raise ValueError(f"split {prefill_sms} was not pre-created; choose from {self.splits}")
        self.pinned = prefill_sms
        self.current = prefill_sms

    def release(self) -> None:
        self.pinned = None

    def _eval(self, prefill_sms: int, p: PrefillShape, d: DecodeShape) -> tuple[float, float]:
        total = self.model.total_sms
        if prefill_sms == TIME_SLICE:
            # One prefill slice then one decode step, each on the whole GPU.
            tp = self.model.predict(PREFILL, p, total)
            td = self.model.predict(DECODE, d, total)
            return tp + td, tp + td
        ds = total - prefill_sms
        return (
            self.model.predict(PREFILL, p, prefill_sms, ds, neighbour=d),
            self.model.predict(DECODE, d, ds, prefill_sms, neighbour=p),
        )

    def speedup(self, prefill_sms: int, p: PrefillShape, d: DecodeShape) -> float:
        """Time-slicing time / concurrent time for the same work: one prefill slice plus the
        decode steps the split runs meanwhile (the H200.md comparison)."""
        if prefill_sms == TIME_SLICE:
            return 1.0
        tp, td = self._eval(prefill_sms, p, d)
        steps = tp / td
        total = self.model.total_sms
        serial = self.model.predict(PREFILL, p, total) + steps * self.model.predict(
            DECODE, d, total
        )
        return serial / tp

    def choose(
        self,
        p: PrefillShape | None,
        d: DecodeShape | None,
        kv_usage: float,
        *,
        chunk: ChunkInput | None = None,
        aim_ms: float | None = None,
        rows: RowStream | None = None,
        slice_aim_ms: float | None = None,
    ) -> SplitDecision:
        """How to run the next prefill `p` beside the decode batch `d` (None: that phase has
        no work). `chunk`: `p` is the head of the prefill queue, not yet planned, and may be
        cut by tokens across steps; chunked time-slicing then competes with the splits and
        layer slices (`_versus`), and a whole-GPU time-slice is always cut to chunks. Without
        it, `p` is what will run whole (a planned batch, or an unchunkable prompt). `aim_ms`:
        what a decode should wait at most, the target less the tail the engine measured
        (`StepPacer.chunk_tbt_ms`; `chunk.tbt_slo_ms` when chunked); layer slices are sized to
        it (`_layer_slices`). None: the target itself. `slice_aim_ms`: the aim for layer
        slices from their own measured tail (`StepPacer.slice_aim_ms`), which then replaces
        `aim_ms` and the layer-sliced error margin there; None: not measured yet. `rows`: `p`
        streams its rows, so a layer may be cut into row pieces where no whole layer fits
        (sub-layer slices)."""
        cfg = self.config
        if self.pinned is not None:
            tp, td = self._eval(self.pinned, p, d) if p and d else (math.nan, math.nan)
            sp = self.speedup(self.pinned, p, d) if p and d else math.nan
            return SplitDecision(
                self.pinned,
                predicted_prefill_ms=tp,
                predicted_decode_ms=td,
                speedup_vs_time_slice=sp,
                reason="pinned",
            )
        chunked = None
        if chunk is not None and p is not None and d is not None and cfg.allow_time_slice:
            chunked = self._chunked(p, d, chunk)
        if not self.model.calibrated:
            # No parameters for this device/model: any split choice would be a guess, and
            # time-slicing is what `off` does (logged once at start-up by the engine), with
            # the prefill cut to the TBT target when it may be.
            if chunked is not None:
                return dataclasses.replace(
                    chunked, reason="cost model uncalibrated: chunked time-slicing"
                )
            return SplitDecision(TIME_SLICE, reason="cost model uncalibrated: time-slicing")
        if p is None or d is None:
            # One phase only: nothing to overlap; it gets the whole GPU. `current` is left
            # alone: hysteresis is about consecutive prefill batches, not decode-only gaps.
            return SplitDecision(TIME_SLICE, reason="one phase only")
        if chunked is None:
            return self._choose_whole(p, d, kv_usage, aim_ms, rows, slice_aim_ms=slice_aim_ms)
        assert chunk is not None
        if chunked.chunk_tokens is not None and chunked.chunk_tokens >= p.num_tokens:
            if chunked.predicted_decode_ms <= chunk.tbt_slo_ms:
                # One step holds the whole prefill within the target: nothing beats giving
                # it every SM (as `off`), and no split needs evaluating.
                self.current = TIME_SLICE
                return dataclasses.replace(
                    chunked, reason="the prefill fits the TBT target in one step"
                )
        whole = self._choose_whole(
            p, d, kv_usage, chunk.tbt_slo_ms, rows, chunkable=True, slice_aim_ms=slice_aim_ms
        )
        return self._versus(chunked, chunk, whole, kv_usage)

    def _chunked(self, p: PrefillShape, d: DecodeShape, chunk: ChunkInput) -> SplitDecision:
        """Time-slicing with the prefill `p` cut into chunks: every step runs the decodes and
        one chunk on the whole GPU, the chunk being the most tokens whose marginal cost fits
        the target after the decode step (`tbt_chunk_tokens`: the arithmetic of the
        scheduler's `--tbt-slo-ms` cut), at most `chunk.max_chunk_tokens`. Predicted prefill:
        until the last chunk is done (the chunks' marginal cost plus one decode step per chunk
        step, `_chunk_steps`); predicted decode: one step (decodes + the first chunk), which
        is what a decode waits."""
        room_ms = self.chunk_room_ms(d, chunk)
        decode_ms = chunk.tbt_slo_ms - room_ms  # the decode step with a chunk beside it
        cost, ctx, n = chunk.prefill_cost, chunk.context_tokens, max(p.num_tokens, 1)
        tokens = tbt_chunk_tokens(cost, room_ms / 1e3, ctx)
        cap = chunk.max_chunk_tokens
        if cap is not None:
            tokens = min(tokens, cap)
        if tokens >= n:
            steps, prefill_ms = 1, cost.marginal_s(n, ctx) * 1e3
        else:
            steps, prefill_ms = _chunk_steps(cost, room_ms / 1e3, ctx, n, cap)
        return SplitDecision(
            TIME_SLICE,
            chunk_tokens=tokens,
            predicted_prefill_ms=steps * decode_ms + prefill_ms,
            predicted_decode_ms=decode_ms + cost.marginal_s(min(tokens, n), ctx) * 1e3,
            reason="chunked time-slicing",
            evaluations=1,
        )

    def chunk_room_ms(self, d: DecodeShape, chunk: ChunkInput) -> float:
        """What a chunked step leaves its prefill parts (ms): the aim less the decode step
        with a chunk beside it. `_chunked` cuts the head's chunk to it; the engine holds every
        prefill planned into that step to the same room (`StepPacer.auto_capacity`)."""
        return chunk.tbt_slo_ms - (self._whole_decode_ms(d, chunk) + chunk.step_offset_ms)

    def _whole_decode_ms(self, d: DecodeShape, chunk: ChunkInput) -> float:
        """The decode part of a chunked step (ms): the engine's decode base
        (`StepPacer.decode_base_s`: this model's prediction for the batch when calibrated, else
        the measured decode-only average), the cost model's own prediction only when the engine
        has none. The base is what `step_offset_ms` was fitted against; a room computed on
        another base counts their difference twice. On the H200 (3B, mixed, plan s at
        `8b4553d`) the offset, fitted against the measured average, read 7 and 24 ms, and this
        model's prediction plus that offset planned auto's chunked steps over 1,024 tokens to a
        median 48.3-48.6 ms where `off` cut to the same target planned 54.2-55.3 ms: smaller
        steps, and a max QPS of 24 against 36 at `96bc96d`, when a token-only cap on the
        prefills behind the head overfilled the steps (median 57.8 ms) and hid the short room."""
        if chunk.decode_step_ms > 0.0:
            return chunk.decode_step_ms
        return self.predicted_decode_ms(d) or 0.0

    def predicted_decode_ms(self, d: DecodeShape) -> float | None:
        """The cost model's decode step for `d` on the whole GPU (ms); None while uncalibrated."""
        m = self.model
        return m.predict(DECODE, d, m.total_sms) if m.calibrated else None

    def chunked_step_ms(
        self, prefill: list[tuple[int, int]], d: DecodeShape, chunk: ChunkInput
    ) -> float:
        """Predicted time of a planned chunked time-slice step: its decodes `d` plus the
        marginal cost of its prefill parts ((new tokens, context tokens) each), as `_chunked`
        predicts it (scored against the measured step: `CostModel.score`)."""
        cost = chunk.prefill_cost
        return (
            self._whole_decode_ms(d, chunk)
            + chunk.step_offset_ms
            + 1e3 * sum(cost.marginal_s(n, c) for n, c in prefill)
        )

    def _versus(
        self, chunked: SplitDecision, chunk: ChunkInput, best: SplitDecision, kv_usage: float
    ) -> SplitDecision:
        """Chunked time-slicing against the best whole-prefill choice (`_choose_whole`):
        whatever meets the TBT target and finishes the prefill first; a split or layer slices
        must be predicted faster by `min_split_speedup` (a split: or by its prefill
        prediction's measured error, if larger, and its decode step must meet the target with
        that prediction's measured error added). A whole-GPU time-slice is always cut
        into chunks (a decode then waits for one chunk, not for the whole prefill), and while
        decode is favoured (KV usage above the switch) or without a split target, a split is
        kept as that rule chose it."""
        cfg = self.config
        evaluations = best.evaluations + 1

        def pick_chunked(reason: str) -> SplitDecision:
            self.current = TIME_SLICE
            return dataclasses.replace(chunked, reason=reason, evaluations=evaluations)

        if best.prefill_sms == TIME_SLICE and not best.layers_per_slice:
            return pick_chunked("chunked time-slicing (a whole prefill cut to the TBT target)")
        if kv_usage >= cfg.kv_switch or cfg.tbt_slo_ms is None:
            return best
        what = "layer slices" if best.layers_per_slice else f"split {best.prefill_sms}"
        # A split's two predictions carry the error its kind of prediction has measured while
        # serving (on the H200 12-20 % for a split's prefill against 5-10 % for a chunked
        # step): its decode step must meet the aim with that error added, and its prefill
        # must win by more than it. Chunks need no such margin: the engine's aim already
        # holds the measured tail of chunked steps (`TailFactor`).
        split = not best.layers_per_slice
        need_speedup = self._split_margin() if split else cfg.min_split_speedup
        # Both against the engine's aim (`chunk.tbt_slo_ms`: the target less the tail
        # headroom the engine measured), not one against the aim and one against the target.
        chunk_ok = chunked.predicted_decode_ms <= chunk.tbt_slo_ms
        # Layer slices are sized to the aim (`_layer_slices`); a split's decode step is predicted.
        best_ok = not split or self._split_decode_ok(best.predicted_decode_ms, chunk.tbt_slo_ms)
        if chunk_ok and not best_ok:
            return pick_chunked(f"chunked time-slicing ({what} misses the TBT target)")
        if chunk_ok and chunked.predicted_prefill_ms <= best.predicted_prefill_ms * need_speedup:
            return pick_chunked(f"chunks finish the prefill before {what}")
        if not chunk_ok and not best_ok and chunked.predicted_decode_ms < best.predicted_decode_ms:
            return pick_chunked(
                "chunked time-slicing (nothing meets the TBT target; it is closest)"
            )
        return dataclasses.replace(best, evaluations=evaluations)

    def _split_decode_limit(self, aim_ms: float | None) -> float:
        """The longest predicted decode step a split may have (ms): the aim (None: the
        target) less its kind's measured error. One bound wherever a split is weighed (the
        search, against layer slices, against chunks): with the target alone against layer
        slices and the aim with the error against chunks, a split that passed the first and
        failed the second put chunks in place of layer slices, even chunks predicted far
        slower (tests/test_cost_model.py). On an H100 (8B, 40-44k-token scoring prompts beside
        chat) chunks ran such prompts at ~1.45x the slices' time."""
        cfg = self.config
        assert cfg.tbt_slo_ms is not None
        aim = cfg.tbt_slo_ms if aim_ms is None else min(aim_ms, cfg.tbt_slo_ms)
        return aim / (1.0 + self.model.recent_error(f"{DECODE}/concurrent"))

    def _split_decode_ok(self, decode_ms: float, aim_ms: float | None) -> bool:
        """Whether a split's predicted decode step is within `_split_decode_limit`."""
        return decode_ms <= self._split_decode_limit(aim_ms)

    def _split_margin(self) -> float:
        """How much faster a split's prefill must be predicted than the alternative (chunks,
        layer slices) to be taken: min_split_speedup, or its prefill prediction's measured
        error while serving if larger."""
        err = self.model.recent_error(f"{PREFILL}/concurrent")
        return max(self.config.min_split_speedup, 1.0 + err)

    def _choose_whole(
        self,
        p: PrefillShape,
        d: DecodeShape,
        kv_usage: float,
        aim_ms: float | None = None,
        rows: RowStream | None = None,
        chunkable: bool = False,
        slice_aim_ms: float | None = None,
    ) -> SplitDecision:
        """Nexus's rule with the TBT target for a prefill `p` that runs whole: a whole-GPU
        time-slice, a split, or (layer slicing on) slices of layers sized to `aim_ms` (to
        `slice_aim_ms` where given), or of row pieces of a layer where `p` streams its `rows`
        and no layer fits. `chunkable`: `p` may be cut by tokens instead (`_versus` then cuts
        a whole time-slice to chunks)."""
        cfg = self.config
        favour_prefill = kv_usage < cfg.kv_switch
        evals: dict[int, tuple[float, float]] = {}
        self._num_evals = 0

        def ev(s: int) -> tuple[float, float]:
            if s not in evals:
                evals[s] = self._eval(s, p, d)
                self._num_evals = len(evals)
            return evals[s]

        # References for the slack: each phase's best latency over the splits (and time-slicing).
        # Extremes bound the references: decode is best with the fewest prefill SMs, prefill
        # with the most (monotone curves), so only the two ends are evaluated for them.
        ends = [self.splits[0], self.splits[-1]] + ([TIME_SLICE] if cfg.allow_time_slice else [])
        p_ref = min(ev(s)[0] for s in ends)
        d_ref = min(ev(s)[1] for s in ends)

        tbt_rule = favour_prefill and cfg.tbt_slo_ms is not None
        if tbt_rule and cfg.allow_time_slice and ev(TIME_SLICE)[1] <= cfg.tbt_slo_ms:
            # Decode can afford to wait for a whole-GPU prefill: nothing beats that for TTFT
            # and throughput (one monolithic step, as `off`).
            return self._settle(TIME_SLICE, "time-slicing meets the TBT target", p, d, ev, None)
        # Under the TBT rule, the bound a split is held to wherever it is weighed.
        decode_limit = self._split_decode_limit(aim_ms) if tbt_rule else cfg.beta * d_ref

        def objective(s: int) -> float:
            # The favoured phase's time where the other phase's bound holds; past the bound,
            # the bounded phase's time (plus a constant above any feasible value), so that
            # the search walks toward the bound rather than deeper past it. Penalised by the
            # favoured phase's time instead, a bound no split meets sent the search to the
            # far end: on an H100 (8B in 24 GB, decode favoured at high KV usage, the bound
            # set by the whole GPU's prefill) 8,192-token prefills went to 8 SMs beside one
            # decode and took 3.7-7.6 s, against 0.35 s on the whole GPU.
            tp, td = ev(s)
            if favour_prefill:
                return tp if td <= decode_limit else _INFEASIBLE_MS + td
            return td if tp <= cfg.alpha * p_ref else _INFEASIBLE_MS + tp

        # Greedy: from the current split, step to the better neighbour while it improves.
        idx = (
            self.splits.index(self.current)
            if self.current in self.splits
            else len(self.splits) // 2
        )
        while True:
            here = objective(self.splits[idx])
            nbrs = [i for i in (idx - 1, idx + 1) if 0 <= i < len(self.splits)]
            best = min(nbrs, key=lambda i: objective(self.splits[i]), default=idx)
            if objective(self.splits[best]) < here:
                idx = best
            else:
                break
        best_split = self.splits[idx]
        if tbt_rule and cfg.allow_time_slice and cfg.layer_slicing:
            sliced = self._layer_slices(p, d, aim_ms, rows, slice_aim_ms)
            tp_split, td_split = ev(best_split)
            # The split must finish the prefill sooner by its margin, as against chunks
            # (`_versus`): the larger of min_split_speedup and its prefill prediction's
            # measured error. Without one, on an H100 (8B in 24 GB, scoring prompts beside
            # chat) 59k-token prompts went to 112 SMs and took 3.60-3.67 s, 1.25x the whole
            # GPU's 2.89 s, where 50-52k-token ones in layer slices took 1.07x its time.
            need = self._split_margin()
            if sliced is not None and (
                not self._split_decode_ok(td_split, aim_ms)
                or sliced.predicted_ms <= tp_split * need
            ):
                return self._sliced(sliced, "meet the TBT target", p, d, ev)
        sp = self.speedup(best_split, p, d)
        choice = best_split
        reason = (
            "TBT target" if tbt_rule else "favour prefill" if favour_prefill else "favour decode"
        )
        # (Under the TBT rule time-slicing was ruled out above: it would miss the target.)
        if cfg.allow_time_slice and sp < cfg.min_split_speedup and not tbt_rule:
            # Decode favoured (KV usage above the switch) and no split worth taking: a whole
            # time-slice holds every decode for the whole prefill. Under a TBT target that
            # misses it by seconds where layer slices keep it: on an H100 (8B in 24 GB,
            # `58a82b9`) a 50k-token scoring prompt planned while the previous whole prompt
            # held the pool ran merged with 10-13 decodes in 2.2 s, in every run.
            # (A chunkable prefill's whole time-slice is cut to chunks by `_versus`, as before.)
            sliced = (
                self._layer_slices(p, d, aim_ms, rows, slice_aim_ms)
                if cfg.tbt_slo_ms is not None
                and cfg.layer_slicing
                and not chunkable
                and ev(TIME_SLICE)[1] > cfg.tbt_slo_ms
                else None
            )
            if sliced is not None:
                return self._sliced(
                    sliced, "keep the TBT target while decode is favoured", p, d, ev
                )
            choice, reason = TIME_SLICE, f"time-slicing predicted faster (split speedup {sp:.2f})"
        return self._settle(choice, reason, p, d, ev, objective, time_slice_ok=not tbt_rule)

    def _sliced(
        self,
        sliced: LayerSlices,
        why: str,
        p: PrefillShape,
        d: DecodeShape,
        ev: Callable[[int], tuple[float, float]],
    ) -> SplitDecision:
        """The decision to time-slice `p` in `sliced`'s slices (a rule's choice: no hysteresis)."""
        what = (
            f"sub-layer slices ({len(sliced.slice_ends)} of whole chunks)"
            if sliced.slice_ends
            else f"layer slices of {sliced.layers}"
        )
        dec = self._settle(TIME_SLICE, f"{what} {why}", p, d, ev, None)
        # (`_settle` priced a whole time-slice: a decode would wait for the whole prefill;
        # with slices it waits one slice.)
        return dataclasses.replace(
            dec,
            predicted_prefill_ms=sliced.predicted_ms,
            predicted_decode_ms=sliced.decode_wait_ms,
            layers_per_slice=sliced.layers,
            slice_ends=sliced.slice_ends or None,
        )

    def _layer_slices(
        self,
        p: PrefillShape,
        d: DecodeShape,
        aim_ms: float | None = None,
        rows: RowStream | None = None,
        slice_aim_ms: float | None = None,
    ) -> LayerSlices | None:
        """How to time-slice the prefill `p` by slices of layers on the whole GPU, one decode
        step between slices, so that a decode waits at most one slice, and its predicted
        completion; None when not even one layer fits the TBT target and `p` cannot be cut
        into row pieces.

        A slice and the decode step after it are sized to `aim_ms` (the target less the tail
        the engine measured; None: the target), with the layer-sliced prediction's own
        measured error as a margin, as a split's predictions carry theirs (`_versus`). Sized
        to the target itself, a slice is what a decode waits on average, so the P99 lands
        above it: on the H200 (3B, plan z at e604abe, scoring unchunked next to chat at
        16 QPS) slices of a 16k prompt predicted at ~77 ms for an 80 ms target left 70-79 ms
        between decode steps, up to 106, and the chats' P99 ITL read 89 ms. Smaller slices
        cost the prefill one decode step (~3 ms there) each. Once the engine has measured
        the slices' own tail (what decodes waited behind them over this promise), they are
        sized to `slice_aim_ms`, the target over that tail, with no second margin: the
        chunks' tail is read from chunked steps, which miss differently. On an H100 (8B in
        24 GB, `58a82b9`) its aim cut the slices of 50-60k-token prompts to 31-43 ms where
        ~65 ms fitted (the cuts of an aim of 52-55 ms: a tail of ~1.5): 64-96 slices a
        prompt, ~1.12x its whole-GPU time, where their span read within 2 % of its
        prediction.

        Where `p` streams its rows (`rows`), its layers may run in row pieces of whole hybrid
        chunks, each slice as many chunks (across a layer's end into the next) as fit the aim
        less the decode step with the same margin: sub-layer slices (`_row_slices`), taken
        where the aim admits no whole layer, or where they make fewer slices than whole
        layers (a slice of 1.4 layers where one layer fills 0.7 of the room). On
        an H100 (8B in 24 GB, 80-ms target) no layer fits the target itself for prompts over
        ~52k tokens, which otherwise went to a 112-SM split at 1.2-1.3x the whole GPU's time;
        one-layer slices of 40-52k-token prompts, within the target but past the aim, held
        the chats' P99 gap at 78.7-80.5 ms. Without rows (or with no piece small enough), a
        slice is one layer when the target admits one, and there are none when it does
        not."""
        target_ms = self.config.tbt_slo_ms
        assert target_ms is not None
        total = self.model.total_sms
        tp = self.model.predict(PREFILL, p, total)
        td = self.model.predict(DECODE, d, total)
        num_layers = max(p.num_layers, 1)
        per_layer_ms = tp / num_layers
        if not per_layer_ms > 0:
            return None
        if slice_aim_ms is not None:
            # The slices' own tail (what decodes waited behind them over this promise) holds
            # their prediction's error already: no second margin.
            aim, err = min(slice_aim_ms, target_ms), 0.0
        else:
            aim = target_ms if aim_ms is None else min(aim_ms, target_ms)
            err = self.model.recent_error(f"{PREFILL}/layer_sliced")
        no_layer = target_ms - td < per_layer_ms
        fit = 0 if no_layer or aim <= td else int((aim - td) // (per_layer_ms * (1.0 + err)))
        whole: LayerSlices | None = None
        if not no_layer:
            layers = min(num_layers, max(1, fit))
            num_slices = math.ceil(num_layers / layers)
            whole = LayerSlices(layers, tp + (num_slices - 1) * td, layers * per_layer_ms + td)
        if rows is not None and (whole is None or whole.layers < num_layers):
            key = (rows, aim - td, err, num_layers, tp)
            memo = self._row_slices_memo
            if memo is not None and memo[0] == key:
                cut = memo[1]
            else:
                cut = self._row_slices(rows, aim - td, err, num_layers)
                self._row_slices_memo = (key, cut)
            if cut is not None:
                ends, heaviest_ms = cut
                sliced = LayerSlices(1, tp + (len(ends) - 1) * td, heaviest_ms + td, ends)
                # Pieces where no whole layer fits the aim, or where they make fewer slices
                # than whole layers do (a slice of 1.4 layers' pieces for a 40k-token prompt
                # whose layer fills 0.8 of the room: 23 slices for 32).
                if whole is None or fit == 0 or sliced.predicted_ms < whole.predicted_ms:
                    return sliced
        return whole

    def _row_slices(
        self, rows: RowStream, room_ms: float, err: float, num_layers: int
    ) -> RowSlicesCut:
        """Cut a row-streamed prefill of `num_layers` layers into slices of whole hybrid
        chunks, each as many as fit `room_ms` with the margin 1 + `err`, in order, a slice
        running on into the next layer where its room allows: the fewest slices (a
        greedy cut is the fewest where a slice's cost grows with its length, as here).
        Returns where each slice ends (`SplitDecision.slice_ends`: chunks counted from the
        prefill's start, layer after layer) and the heaviest slice's predicted time, ms;
        None if a chunk alone does not fit.

        Why by cost, not by rows: a later chunk of a layer attends to more keys, so pieces
        of equal rows differ in cost, and the heaviest sets what a decode waits. On an H100
        (8B in 24 GB, `9ddecb5`, 50-60k-token prompts) such slices promised ~72 ms and the
        decode steps behind them waited ~60 at the median: filled to the promise, ~17 %
        fewer slices (and decode steps between them) do the same prefill.

        A piece of rows [s, e) of one layer after a context c is the prefill model's
        one-layer shape of e - s tokens with (e - s) * (c + s + (e - s + 1) / 2) attention
        pairs, priced on its own (the model's per-forward terms count once a piece); a
        slice costs the sum of its pieces (at most one a layer, as the executor runs them).
        Not modelled: the first piece of a layer also projects every row's keys and values
        (on the 8B ~4 % of a layer's per-token work), left to the margin. Cost: one
        prediction per distinct piece (at most chunks² / 2 of them) and a step per chunk
        of every layer."""
        if room_ms <= 0:
            return None
        total = self.model.total_sms
        n_rows, ctx, chunk = rows.num_tokens, rows.context_tokens, rows.chunk_tokens
        num_chunks = num_row_chunks(n_rows, chunk)
        margin = 1.0 + err
        cost: dict[tuple[int, int], float] = {}

        def piece_ms(a: int, b: int) -> float:
            """Chunks [a, b) of a layer as one piece."""
            key = (a, b)
            if key not in cost:
                start, q = a * chunk, min(b * chunk, n_rows) - a * chunk
                shape = PrefillShape(q, q * (ctx + start + (q + 1) / 2), 1)
                cost[key] = self.model.predict(PREFILL, shape, total)
            return cost[key]

        ends: list[int] = []
        heaviest = 0.0
        pos, last = 0, num_chunks * num_layers
        while pos < last:
            # Extend the slice from `pos` one chunk at a time: `done` is the cost of the
            # layers it has finished, `first` where its piece of the current layer starts.
            done, first, end, ms = 0.0, pos % num_chunks, pos, 0.0
            while end < last:
                chunk_in_layer = end % num_chunks
                if chunk_in_layer == 0 and end > pos:
                    done, first = ms, 0  # a new layer: the last piece is whole
                trial = done + piece_ms(first, chunk_in_layer + 1)
                if trial * margin > room_ms:
                    break
                ms, end = trial, end + 1
            if end == pos:
                return None  # the chunk at `pos` alone does not fit
            ends.append(end)
            heaviest = max(heaviest, ms)
            pos = end
        return tuple(ends), heaviest

    def _settle(
        self,
        choice: int,
        reason: str,
        p: PrefillShape,
        d: DecodeShape,
        ev: Callable[[int], tuple[float, float]],
        objective: Callable[[int], float] | None,
        *,
        time_slice_ok: bool = True,
    ) -> SplitDecision:
        """Apply hysteresis to a choice, make it current, and describe it. A rule's choice
        (objective None), or leaving a time-slice that misses the TBT target
        (time_slice_ok False), is never held back by hysteresis."""
        cfg = self.config
        cands = list(self.splits) + ([TIME_SLICE] if cfg.allow_time_slice else [])
        sp = self.speedup(choice, p, d)
        # Hysteresis: keep the current choice unless the new one is clearly different/better.
        cur = self.current
        if choice != cur and cur in cands:
            small_move = (
                choice != TIME_SLICE
                and cur != TIME_SLICE
                and abs(choice - cur) < cfg.hysteresis_sms
            )
            if objective is None or (cur == TIME_SLICE and not time_slice_ok):
                gain = math.inf
            else:
                gain = (objective(cur) - objective(choice)) / max(objective(cur), 1e-9)
            if math.isfinite(gain) and (choice == TIME_SLICE or cur == TIME_SLICE):
                sp_cur = self.speedup(cur, p, d) if cur != TIME_SLICE else 1.0
                sp_new = sp if choice != TIME_SLICE else 1.0
                gain = (sp_new - sp_cur) / max(sp_cur, 1e-9)
            if small_move or gain < cfg.min_gain:
                choice, reason = cur, f"hysteresis (kept {cur})"
        self.current = choice
        tp, td = ev(choice)
        sp_final = self.speedup(choice, p, d)
        return SplitDecision(
            choice,
            predicted_prefill_ms=tp,
            predicted_decode_ms=td,
            speedup_vs_time_slice=sp_final,
            reason=reason,
            evaluations=self._num_evals,
        )
