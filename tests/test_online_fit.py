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


def test_ridge_recovers_its_terms_and_holds_what_it_cannot_tell_at_the_prior() -> None:
    from runtime.online_fit import DecayingRidge

    fit = DecayingRidge((0.0, 1.0, 0.0), (1e-6, 1e-6, 1e-6), 0.95)
    assert fit.solve() == pytest.approx([0.0, 1.0, 0.0])  # nothing observed: the prior
    points = [(x, z) for x in (1.0, 2.0, 5.0) for z in (0.0, 1.0, 1.6)]
    for x, z in points * 4:
        fit.add((1.0, x, z), 3.0 + 2.0 * x + 0.5 * z)
    assert fit.solve() == pytest.approx([3.0, 2.0, 0.5], rel=1e-3)
    assert fit.count == pytest.approx(sum(0.95**i for i in range(36)))
    # z never varies (always 0): its term stays at the prior, the others are fitted.
    flat = DecayingRidge((0.0, 1.0, 0.25), (1e-6, 1e-6, 1e-6), 0.95)
    for x in (1.0, 2.0, 5.0) * 4:
        flat.add((1.0, x, 0.0), 3.0 + 2.0 * x)
    assert flat.solve() == pytest.approx([3.0, 2.0, 0.25], rel=1e-3)
    # z proportional to x: the data fix only their sum; the prior splits it, and the fit
    # still reproduces every observation.
    tied = DecayingRidge((0.0, 1.0, 0.0), (1e-3, 1e-3, 1e-3), 0.95)
    for x in (1.0, 2.0, 5.0) * 4:
        tied.add((1.0, x, x), 3.0 + 2.0 * x)
    a, bx, bz = tied.solve()
    assert bx + bz == pytest.approx(2.0, rel=1e-3) and a == pytest.approx(3.0, rel=1e-2)
    assert bx > 1.0 > bz > 0.0  # pulled toward the prior's split (1, 0)
    with pytest.raises(ValueError):
        DecayingRidge((0.0, 1.0), (1.0, 0.0), 0.95)
