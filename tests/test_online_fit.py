from __future__ import annotations

import pytest

from runtime.online_fit import DecayingLine


def test_a_line_is_recovered_once_x_varies_and_not_before() -> None:
    line = DecayingLine(0.9)
    assert line.slope(0.25, 3) is None and line.ratio() is None and line.means() == (0.0, 0.0)
    for _ in range(3):
        line.add(10.0, 23.0)  # one x: a slope cannot be told from an intercept
    assert line.slope(0.25, 3) is None
    assert line.ratio() == pytest.approx(2.3)
    for x in (5.0, 40.0, 20.0):
        line.add(x, 3.0 + 2.0 * x)
    assert line.slope(0.25, 3) == pytest.approx(2.0)
    mx, my = line.means()
    assert my - 2.0 * mx == pytest.approx(3.0)
    assert line.count == pytest.approx(sum(0.9**k for k in range(6)))


def test_relative_weights_keep_short_observations_from_being_drowned() -> None:
    """Points off the line by the same relative amount, one short and one long: unweighted, the
    long point pulls the fit's error onto the short ones; weighted by 1 / y² both count alike."""
    pts = [(1.0, 2.0), (1.2, 2.6), (100.0, 150.0), (120.0, 170.0)]

    def short_error(weighted: bool) -> float:
        line = DecayingLine(1.0)
        for x, y in pts:
            line.add(x, y, 1.0 / (y * y) if weighted else 1.0)
        slope = line.slope(0.1, 2)
        assert slope is not None
        mx, my = line.means()
        return abs(my - slope * mx + slope * 1.0 - 2.0) / 2.0

    assert short_error(weighted=True) < 0.5 * short_error(weighted=False)


def test_old_observations_fade() -> None:
    line = DecayingLine(0.5)
    for x in (1.0, 2.0, 3.0):
        line.add(x, 10.0 * x)
    for x in (1.0, 2.0, 3.0) * 10:
        line.add(x, 2.0 * x)
    assert line.count == pytest.approx(2.0, rel=1e-6)  # 1 / (1 - decay): a window, not all
    assert line.slope(0.25, 1.5) == pytest.approx(2.0, rel=1e-3)


def test_plane_recovers_two_slopes_and_refuses_what_it_cannot_tell() -> None:
    from runtime.online_fit import DecayingPlane

    plane = DecayingPlane(0.95)
    points = [(x, z) for x in (1.0, 2.0, 5.0) for z in (0.0, 1e4, 1.6e4)]
    for x, z in points * 4:
        plane.add(x, z, 3.0 + 2.0 * x + 1e-4 * z)
    a, bx, bz = plane.solve(min_cv=0.25, min_count=3.0, max_abs_corr=0.9)
    assert a == pytest.approx(3.0) and bx == pytest.approx(2.0) and bz == pytest.approx(1e-4)
    # z constant (no step had a cached prefix): no z slope to tell from the intercept.
    flat = DecayingPlane(0.95)
    for x in (1.0, 2.0, 5.0) * 4:
        flat.add(x, 0.0, 3.0 + 2.0 * x)
    assert flat.solve(min_cv=0.25, min_count=3.0, max_abs_corr=0.9) is None
    # z proportional to x: one slope could stand for the other.
    tied = DecayingPlane(0.95)
    for x in (1.0, 2.0, 5.0) * 4:
        tied.add(x, 1e3 * x, 3.0 + 2.0 * x)
    assert tied.solve(min_cv=0.25, min_count=3.0, max_abs_corr=0.9) is None
    # z's slope held at a value: x's slope on what is left (None while x does not vary).
    assert plane.slope_x(1e-4, min_cv=0.25, min_count=3.0) == pytest.approx(2.0)
    assert flat.slope_x(0.0, min_cv=0.25, min_count=3.0) == pytest.approx(2.0)
    mx, mz, my = plane.means()  # decay-weighted: the exact relation holds for them too
    assert my == pytest.approx(3.0 + 2.0 * mx + 1e-4 * mz)
    # Too few observations.
    few = DecayingPlane(0.95)
    few.add(1.0, 0.0, 1.0)
    few.add(2.0, 1e4, 2.0)
    assert few.solve(min_cv=0.25, min_count=3.0, max_abs_corr=0.9) is None
