"""Acceptance calibration: the isotonic fit of accepted against score; calibrated confidences."""
import numpy as np
import pytest
import torch

from trimpass.spec.control.calibration import Calibration


def _brute_isotonic(xs, ys):
    """Weighted isotonic regression by its min-max formula over tied-pooled points:
    fit_i = max_{j<=i} min_{k>=i} mean(y over points j..k), weights = tie counts."""
    ux = sorted(set(xs))
    w = np.array([sum(1 for x in xs if x == u) for u in ux], dtype=float)
    m = np.array([sum(y for x, y in zip(xs, ys, strict=True) if x == u) for u in ux]) / w
    n = len(ux)
    fit = [max(min((w[j:k + 1] * m[j:k + 1]).sum() / w[j:k + 1].sum() for k in range(i, n))
               for j in range(i + 1)) for i in range(n)]
    return np.array(ux), np.array(fit)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fit_equals_brute_force_isotonic_regression(seed):
    g = np.random.default_rng(seed)
    cal = Calibration(window=500, min_pairs=1, refit_every=1)
    xs, ys = [], []
    for _ in range(37):
        d = int(g.integers(1, 5))
        scores = np.cumprod(np.round(g.uniform(0.3, 1, d), 1))  # ties, non-increasing
        acc = int(g.integers(0, d + 1))
        cal.observe(scores.tolist(), acc)
        xs += scores.tolist()
        ys += [1.0 if k <= acc else 0.0 for k in range(1, d + 1)]
    cal.refit()
    ux, fit = _brute_isotonic(xs, ys)
    np.testing.assert_allclose(cal.xs, ux)
    np.testing.assert_allclose(cal.ys, fit, atol=1e-12)


def test_an_overconfident_drafter_is_scaled_down_to_what_was_accepted():
    g = torch.Generator().manual_seed(0)
    cal = Calibration(window=8192)
    for _ in range(3000):
        s = float(torch.rand((), generator=g))
        cal.observe([s], int(float(torch.rand((), generator=g)) < s ** 3))  # P(accept) = s^3
    got = cal.scores(torch.tensor([0.3, 0.6, 0.9], dtype=torch.float64))
    np.testing.assert_allclose(got.numpy(), [0.027, 0.216, 0.729], atol=0.08)


def test_identity_until_enough_pairs_then_positions_past_the_accepted_count_are_rejections():
    cal = Calibration(window=64, min_pairs=6)
    conf = torch.tensor([[0.9, 0.5, 0.5]], dtype=torch.float64)
    cal.observe([0.9, 0.72, 0.5], 1)
    assert torch.equal(cal.confidences(conf), conf)  # 3 pairs < min_pairs
    cal.observe([0.9, 0.72, 0.5], 1)
    got = cal.scores(torch.tensor([0.9, 0.72, 0.5], dtype=torch.float64))
    np.testing.assert_allclose(got.numpy(), [1, 0, 0])


def test_calibrated_confidences_multiply_to_the_calibrated_scores():
    g = torch.Generator().manual_seed(3)
    cal = Calibration(min_pairs=8)
    for _ in range(200):
        c = torch.rand(4, generator=g, dtype=torch.float64)
        acc = int((torch.rand(4, generator=g, dtype=torch.float64) < c).long().cumprod(0).sum())
        cal.observe(torch.cumprod(c, 0).tolist(), acc)
    raw = torch.rand(5, 6, generator=g, dtype=torch.float64)
    raw[1, 3] = 0.0
    out = cal.confidences(raw)
    torch.testing.assert_close(torch.cumprod(out, 1), cal.scores(torch.cumprod(raw, 1)))


def test_bad_window_is_refused():
    with pytest.raises(ValueError, match="window >= min_pairs"):
        Calibration(window=10, min_pairs=64)
