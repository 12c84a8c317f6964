"""A straight line fitted online to recent observations: the one fit behind the engine's affine
latency corrections (`scheduler.CorrectedCost` for mixed steps, `partition.cost_model`'s
per-split corrections). Pure Python, O(1) an observation, no history kept."""

from __future__ import annotations

from dataclasses import dataclass


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
class DecayingPlane:
    """y ≈ intercept + bx · x + bz · z by weighted least squares over the observations so far,
    the past discounted by `decay` per observation (as `DecayingLine`, with a second regressor).
    O(1) an observation, no history kept."""

    decay: float
    _count: float = 0.0
    _w: float = 0.0
    _sx: float = 0.0
    _sz: float = 0.0
    _sy: float = 0.0
    _sxx: float = 0.0
    _szz: float = 0.0
    _sxz: float = 0.0
    _sxy: float = 0.0
    _szy: float = 0.0

    def add(self, x: float, z: float, y: float, weight: float = 1.0) -> None:
        d = self.decay
        self._count = d * self._count + 1.0
        self._w = d * self._w + weight
        self._sx = d * self._sx + weight * x
        self._sz = d * self._sz + weight * z
        self._sy = d * self._sy + weight * y
        self._sxx = d * self._sxx + weight * x * x
        self._szz = d * self._szz + weight * z * z
        self._sxz = d * self._sxz + weight * x * z
        self._sxy = d * self._sxy + weight * x * y
        self._szy = d * self._szy + weight * z * y

    @property
    def count(self) -> float:
        return self._count

    def means(self) -> tuple[float, float, float]:
        """Weighted means of x, z and y; zeros before the first observation."""
        if self._w <= 0.0:
            return 0.0, 0.0, 0.0
        w = self._w
        return self._sx / w, self._sz / w, self._sy / w

    def slope_x(self, bz: float, min_cv: float, min_count: float) -> float | None:
        """The least-squares slope of y − bz · z on x (z's slope held at `bz`), or None while
        it cannot be told from an intercept (as `DecayingLine.slope`)."""
        if self._count < min_count or self._w <= 0.0:
            return None
        mx, mz, my = self.means()
        w = self._w
        vxx = max(0.0, self._sxx / w - mx * mx)
        if vxx <= 0.0 or vxx < (min_cv * mx) ** 2:
            return None
        vxy = self._sxy / w - mx * my
        vxz = self._sxz / w - mx * mz
        return (vxy - bz * vxz) / vxx

    def solve(
        self, min_cv: float, min_count: float, max_abs_corr: float
    ) -> tuple[float, float, float] | None:
        """(intercept, bx, bz), or None while the three cannot be told apart: fewer than
        `min_count` observations, x or z varying by less than `min_cv` of its mean, or x and z
        so correlated (|r| > `max_abs_corr`) that one slope could stand in for the other."""
        if self._count < min_count or self._w <= 0.0:
            return None
        w = self._w
        mx, mz, my = self._sx / w, self._sz / w, self._sy / w
        vxx = self._sxx / w - mx * mx
        vzz = self._szz / w - mz * mz
        vxz = self._sxz / w - mx * mz
        if vxx <= 0.0 or vzz <= 0.0:
            return None
        if vxx < (min_cv * mx) ** 2 or vzz < (min_cv * mz) ** 2:
            return None
        if vxz * vxz > max_abs_corr * max_abs_corr * vxx * vzz:
            return None
        vxy = self._sxy / w - mx * my
        vzy = self._szy / w - mz * my
        det = vxx * vzz - vxz * vxz
        bx = (vzz * vxy - vxz * vzy) / det
        bz = (vxx * vzy - vxz * vxy) / det
        return my - bx * mx - bz * mz, bx, bz
