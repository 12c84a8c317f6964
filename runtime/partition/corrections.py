"""What the pacer learns from the steps that ran: the mixed step's corrected prefill cost and
the tail factor the TBT cut aims with (`StepPacer`, runtime/partition/pacing.py).

`CorrectedCost` scales the JCT model's terms (`policies.jct.JCTModel`) to what mixed whole-GPU
steps (prefill parts beside decodes) measure, with an offset and a cached-prefix term, fitted
online (`runtime.online_fit.DecayingRidge`); `TailFactor` reads how far the steps' waits run
past their predictions at the tail. The scheduler sees only the result, as a `PrefillCost`
(`runtime.scheduler.StepCapacity.prefill_cost`): it deals in tokens, not in fits.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from policies.jct import attention_pairs
from runtime.online_fit import DecayingRidge


class JctTerms(Protocol):
    """The JCT model's two marginal terms (`policies.jct.JCTModel`): seconds per new token
    and per query-key pair. `CorrectedCost` scales each on its own."""

    b_s_per_token: float
    k_s_per_pair: float


@dataclass(frozen=True, slots=True)
class MixedPrefill:
    """A mixed step's prefill parts as `CorrectedCost` sees them: the JCT model's two terms
    summed over the parts (seconds) and the parts' cached tokens."""

    token_s: float  # b · new tokens
    pair_s: float  # k · query-key pairs (`policies.jct.attention_pairs`)
    context_tokens: int

    @classmethod
    def of(cls, jct: JctTerms, parts: Iterable[tuple[int, int]]) -> MixedPrefill:
        """From (new tokens, cached tokens) per prefill part."""
        tokens = pairs = 0.0
        context = 0
        for new, cached in parts:
            u, c = max(0, new), max(0, cached)
            tokens += u
            pairs += attention_pairs(u, c)
            context += c
        return cls(jct.b_s_per_token * tokens, jct.k_s_per_pair * pairs, context)


@dataclass(slots=True)
class CorrectedCost:
    """The JCT model's marginal prefill cost as the engine corrects it online from steps that
    mixed prefill with decodes (the JCT model itself learns only from prefill-only steps, which
    a TBT target makes rare): such a step takes

        offset_s + token_scale · b · new tokens + pair_scale · k · pairs
                 + context_s_per_token · cached tokens

    beyond the decode step. Each term, and why it is there:
    - `offset_s`: a mixed step's fixed cost beside the decode step (per step; callers add it
      to the decode step: `StepCapacity.decode_step_s`, `ChunkInput.step_offset_ms`).
    - Two scales, not one: the JCT model is fitted on whole prefills of thousands of tokens,
      where the GEMMs run at their best and attention is long; a merged step's part is a few
      hundred to 2k rows after up to tens of thousands of cached tokens. Over three step
      traces of the 8B beside chat on an H100 (plan whole, 40-60k-token scoring prompts
      chunked or sliced, `bench.step_fit`), one least-squares fit per trace put the
      per-token term at 1.46-1.64x the JCT model's and the pair term at 0.64-0.74x, the
      offset near 0 (-2.2 to -0.5 ms). One scale for both (the correction until 2026-12-06)
      had the offset take the difference: ~4-9 ms, which a short chat prompt's step
      (measured 1.2 ms beyond its decodes) took too: 11.0 / 10.9 / 10.1 % MAPE over those
      traces, replayed as it ran.
    - The context term: a short query still reads its whole cached prefix (attention work
      the pairs leave out at a few query rows).

    `observe` fits the four by exponentially weighted least squares over recent mixed steps
    (`DecayingRidge`, O(1) a step), each pulled toward the previous fit (at first: offset 0,
    scales 1 or `seed_scale`'s value, context 0) with the weight of PRIOR_STEPS steps whose
    terms are REF_S. So what the steps cannot tell apart (a run of scoring suffixes alike, no
    step with a cached prefix, context growing with the chunk) stays where it was, with no
    rule to pick the term to drop; what they can tell moves to them. A prior held at the
    first guess instead drew a short chat prompt's step 23 % over its time after 40 suffixes
    of one shape (at 0.1 steps; tests/test_scheduler.py). Replayed over the three traces above, this reads
    6.1 / 6.3 / 6.7 % MAPE. The terms are held to bounds; a part's marginal cost is never
    below 0."""

    cost: JctTerms
    offset_s: float = 0.0
    token_scale: float = 1.0
    pair_scale: float = 1.0
    context_s_per_token: float = 0.0
    DECAY = 0.95  # weight of the past per observation: ~20 recent mixed steps
    MIN_SCALE, MAX_SCALE = 0.1, 10.0
    # A merged step may take a little less than the decode base it is measured against (the
    # base is the cost model's prediction for the batch).
    MIN_OFFSET_S, MAX_OFFSET_S = -0.005, 0.25
    # 1 µs a cached token is ~7x the 3B's and ~3x the 8B's whole prefill cost per token on the
    # H200: a fit beyond it either way is noise, not a prefix read. Below 0 is allowed: the
    # pair term counts every cached key of a part at its scale, and the fit may take some of
    # that back for short queries after long prefixes.
    MAX_CONTEXT_S_PER_TOKEN = 1e-6
    PRIOR_STEPS = 0.3
    REF_S = 0.03  # a term's typical size in a mixed step (s)
    # The context term's regressor is cached tokens x 1 µs, so its coefficient is in µs a
    # token and its typical size REF_S too (30k cached tokens).
    _CONTEXT_UNIT_S = 1e-6
    _fit: DecayingRidge | None = None

    def __post_init__(self) -> None:
        self._refit_prior()

    def _refit_prior(self) -> None:
        """A fresh fit whose prior is the current terms (none observed yet)."""
        ref = self.PRIOR_STEPS * self.REF_S**2
        per_us = self.context_s_per_token / self._CONTEXT_UNIT_S
        self._fit = DecayingRidge(
            (self.offset_s, self.token_scale, self.pair_scale, per_us),
            (self.PRIOR_STEPS, ref, ref, ref),
            self.DECAY,
        )

    def seed_scale(self, scale: float) -> None:
        """Start both scales (and their prior) at `scale`: the engine's guess of how far the
        JCT model is off before it is fitted to the device (`StepPacer._seed_prefill_scale`)."""
        self.token_scale = self.pair_scale = min(self.MAX_SCALE, max(self.MIN_SCALE, scale))
        self._refit_prior()

    def marginal_s(self, uncached_tokens: int, cached_tokens: int = 0) -> float:
        u, c = max(0, uncached_tokens), max(0, cached_tokens)
        jct = self.cost
        return max(
            0.0,
            self.token_scale * jct.b_s_per_token * u
            + self.pair_scale * jct.k_s_per_pair * attention_pairs(u, c)
            + self.context_s_per_token * c,
        )

    def max_tokens_within(self, seconds: float, cached_tokens: int = 0) -> int:
        """The most new tokens after `cached_tokens` whose `marginal_s` fits in `seconds`."""
        c = max(0, cached_tokens)
        left_s = seconds - self.context_s_per_token * c
        if left_s <= 0.0:
            return 0
        jct = self.cost
        k = self.pair_scale * jct.k_s_per_pair
        b = self.token_scale * jct.b_s_per_token + k * c
        if k <= 0.0:
            return int(left_s / b) if b > 0.0 else 1 << 62
        # k/2 u² + b u = left (attention_pairs(u, c) = u² / 2 + u c): the positive root
        return int((-b + math.sqrt(b * b + 2.0 * k * left_s)) / k)

    def prefill(self, parts: Iterable[tuple[int, int]]) -> MixedPrefill:
        """A step's prefill parts, (new tokens, cached tokens) each, as `extra_s` and
        `observe` take them."""
        return MixedPrefill.of(self.cost, parts)

    def extra_s(self, prefill: MixedPrefill) -> float:
        """What a mixed step with these prefill parts takes beyond its decode part."""
        return max(
            0.0,
            self.offset_s
            + self.token_scale * prefill.token_s
            + self.pair_scale * prefill.pair_s
            + self.context_s_per_token * prefill.context_tokens,
        )

    def observe(self, prefill: MixedPrefill, extra_s: float) -> None:
        """One mixed step: its prefill parts and what it measured beyond its decode part
        (beyond the engine's decode base for its batch, `StepPacer.decode_base_s`)."""
        if prefill.token_s + prefill.pair_s <= 1e-9:
            return
        fit = self._fit
        assert fit is not None
        z = prefill.context_tokens * self._CONTEXT_UNIT_S
        fit.add((1.0, prefill.token_s, prefill.pair_s, z), extra_s)
        offset, token_scale, pair_scale, per_us = fit.solve()
        self.offset_s = min(self.MAX_OFFSET_S, max(self.MIN_OFFSET_S, offset))
        self.token_scale = min(self.MAX_SCALE, max(self.MIN_SCALE, token_scale))
        self.pair_scale = min(self.MAX_SCALE, max(self.MIN_SCALE, pair_scale))
        bound = self.MAX_CONTEXT_S_PER_TOKEN
        self.context_s_per_token = min(bound, max(-bound, per_us * self._CONTEXT_UNIT_S))
        # The next fit is pulled toward this one: what the steps stop telling apart (a run of
        # one shape) is held where it was, not drawn back to the first prior as the steps
        # that told it decay.
        fit.prior = (
            self.offset_s,
            self.token_scale,
            self.pair_scale,
            self.context_s_per_token / self._CONTEXT_UNIT_S,
        )


@dataclass(slots=True)
class TailFactor:
    """How far below the TBT target the cut aims a step's predicted time, so that the target
    holds at the tail and not only on average: the cut divides the target by `factor`.

    `CorrectedCost` fits the mean mixed step; a P99 target needs its tail. On the H200 (3B,
    plan u) the correction had the mean right and `--tbt-slo-ms 80` still gave a P99 ITL of
    99.7 ms. The ratio observed is what a decode waited (the device idle before the step, i.e.
    the host's gap, plus the step's device time) over what the cut predicted for the step,
    taken only from steps predicted to fill at least MIN_FILL of the target: those are the
    steps the cut sized, and a short step's ratio (host gap over a few ms) says nothing about a
    full one. `factor` is the QUANTILE of the recent ratios, recomputed every RECOMPUTE_EVERY
    observations (a sort of WINDOW floats, not per step), within [1, MAX_FACTOR]: never
    above the target, and never so far below that one stall starves prefill.

    Until MIN_SAMPLES steps are in, the factor is MAX_FACTOR: a new server has no tail to read,
    and its first steps are the likeliest to run long (the cost correction has not learned its
    scale yet, the decode step's time is unknown). On the H200 (3B, plan v at 4af23c2, a fresh
    server) the first second of steps, cut at the target itself, took up to 104 ms for 80.

    The engine keeps one for the chunked steps the cut sizes and one for layer slices
    (`StepPacer.slice_tail`: what a decode waited behind a slice over the wait the controller
    promised), as the two kinds miss differently."""

    WINDOW = 256
    QUANTILE = 0.99  # the target is a P99; mixed steps carry most tokens under long prompts
    MIN_FILL = 0.5
    MIN_SAMPLES = 32
    RECOMPUTE_EVERY = 16
    MAX_FACTOR = 1.5

    factor: float = MAX_FACTOR  # until MIN_SAMPLES steps are in
    floor: float = 1.0  # the least factor a measured tail gives (1: aim at the target)
    measured: bool = False  # the factor has been read from steps (not the start's MAX_FACTOR)
    _ratios: deque[float] = field(default_factory=lambda: deque(maxlen=TailFactor.WINDOW))
    _since: int = 0

    def observe(self, predicted_s: float, waited_s: float, target_s: float) -> None:
        """One mixed step: its predicted time as the cut saw it, what a decode waited for it
        (host gap + device time), and the TBT target it was cut to."""
        if predicted_s < self.MIN_FILL * target_s or predicted_s <= 0.0:
            return
        self._ratios.append(waited_s / predicted_s)
        self._since += 1
        if self._since < self.RECOMPUTE_EVERY or len(self._ratios) < self.MIN_SAMPLES:
            return
        self._since = 0
        xs = sorted(self._ratios)
        q = xs[min(len(xs) - 1, int(self.QUANTILE * len(xs)))]
        self.factor = min(self.MAX_FACTOR, max(self.floor, q))
        self.measured = True


