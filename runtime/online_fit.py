"""Fits online to recent observations behind the engine's latency corrections: a straight line
(`partition.cost_model`'s per-split corrections) and a ridge fit of a few terms
(`runtime.partition.corrections.CorrectedCost` for mixed steps). Pure Python, no history kept."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class DecayingLine:
    """y ≈ intercept + slope · x by weighted least squares over the observations so far, the
    past discounted by `decay` per observation (1 / (1 - decay) recent ones carry most of it).

    `add`'s `weight` is the observation's own weight: 1 for absolute errors, 1 / y² to fit
    relative ones (then a 5-ms step counts as much as a 250-ms one)."""

    decay: float
    _count: float = 0.0  # decayed number of observations, whatever their weights
    _w: float = 0.0
    _sx: float = 0.0
    _sy: float = 0.0
    _sxx: float = 0.0
    _sxy: float = 0.0

    def add(self, x: float, y: float, weight: float = 1.0) -> None:
        d = self.decay
        self._count = d * self._count + 1.0
        self._w = d * self._w + weight
        self._sx = d * self._sx + weight * x
        self._sy = d * self._sy + weight * y
        self._sxx = d * self._sxx + weight * x * x
        self._sxy = d * self._sxy + weight * x * y

    @property
    def count(self) -> float:
        """The decayed number of observations (a fresh line: 0)."""
        return self._count

    def means(self) -> tuple[float, float]:
        """Weighted means of x and y; (0, 0) before the first observation."""
        if self._w <= 0.0:
            return 0.0, 0.0
        return self._sx / self._w, self._sy / self._w

    def slope(self, min_cv: float, min_count: float) -> float | None:
        """The least-squares slope, or None while it cannot be told from an intercept: fewer
        than `min_count` observations, or x varying by less than `min_cv` of its mean
        (coefficient of variation)."""
        if self._count < min_count or self._w <= 0.0:
            return None
        mx, my = self.means()
        var_x = max(0.0, self._sxx / self._w - mx * mx)
        if var_x <= 0.0 or var_x < (min_cv * mx) ** 2:
            return None
        return (self._sxy / self._w - mx * my) / var_x

    def ratio(self) -> float | None:
        """The one factor c in y ≈ c · x that fits best (no intercept); None without data."""
        if self._sxx <= 0.0:
            return None
        return self._sxy / self._sxx


@dataclass(slots=True)
class DecayingRidge:
    """y ≈ θ · x by least squares over the observations so far, the past discounted by `decay`
    per observation, each coefficient θ[i] pulled toward `prior[i]` with weight `strength[i]`
    (ridge regression with a prior mean). Where the observations cannot tell two terms apart
    (a run of steps alike, a regressor that never varies) the prior decides, smoothly, in
    place of rules that drop a term or hold it at its last fit. A `strength` equal to
    n · x_i² makes the prior weigh as n observations whose term i is x_i.

    O(k²) an observation and O(k³) a solve (k terms, a handful); no history kept."""

    prior: tuple[float, ...]
    strength: tuple[float, ...]
    decay: float
    _xx: list[list[float]] = field(default_factory=list)
    _xy: list[float] = field(default_factory=list)
    _count: float = 0.0

    def __post_init__(self) -> None:
        k = len(self.prior)
        if len(self.strength) != k or any(w <= 0.0 for w in self.strength):
            raise ValueError("one positive strength per prior term")
        self._xx = [[0.0] * k for _ in range(k)]
        self._xy = [0.0] * k

    @property
    def count(self) -> float:
        """The decayed number of observations (a fresh fit: 0)."""
        return self._count

    def add(self, x: Sequence[float], y: float) -> None:
        d, k = self.decay, len(self.prior)
        self._count = d * self._count + 1.0
        for i in range(k):
            self._xy[i] = d * self._xy[i] + x[i] * y
            row = self._xx[i]
            for j in range(k):
                row[j] = d * row[j] + x[i] * x[j]

    def solve(self) -> list[float]:
        """θ minimising Σ decay^age (y − θ·x)² + Σ strength_i (θ_i − prior_i)²: the prior
        itself before any observation. The prior's strength keeps the system positive
        definite, so there is always one answer."""
        k = len(self.prior)
        a = [
            [self._xx[i][j] + (self.strength[i] if i == j else 0.0) for j in range(k)]
            + [self._xy[i] + self.strength[i] * self.prior[i]]
            for i in range(k)
        ]
        for c in range(k):  # Gauss-Jordan with partial pivoting
            pivot = max(range(c, k), key=lambda r: abs(a[r][c]))
            a[c], a[pivot] = a[pivot], a[c]
            for r in range(k):
                if r != c and a[r][c] != 0.0:
                    f = a[r][c] / a[c][c]
                    for j in range(c, k + 1):
                        a[r][j] -= f * a[c][j]
        return [a[i][k] / a[i][i] for i in range(k)]
