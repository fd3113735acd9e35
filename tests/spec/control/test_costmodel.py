"""The cost model against slow references: weighted PAV and the grid fit equal the min-max formula
of isotonic regression (max over upper sets, min over lower sets, of the weighted mean), evaluated
by enumeration; fits and the interpolated table are exactly monotone; the disk cache is keyed by
device, torch version and model key; update() pulls the table toward observed times; bad tables and
arguments raise."""
import itertools
import math
import time

import numpy as np
import pytest
import torch

from trimpass import measure as tm
from trimpass.spec.control import (
    CostTable,
    best_rate,
    cached_table,
    dcut,
    isotonic_grid,
    measure,
    pav,
)
from trimpass.spec.control.costmodel import StepCost


def minmax_1d(y, w):
    n = len(y)
    mean = lambda j, k: sum(w[j:k + 1] * y[j:k + 1]) / sum(w[j:k + 1])  # noqa: E731
    return np.array([max(min(mean(j, k) for k in range(i, n)) for j in range(i + 1))
                     for i in range(n)])


def staircases(nb, nk):
    """Lower sets of the (batch, drafts) grid: row heights non-increasing down the rows."""
    for h in itertools.product(range(nk + 1), repeat=nb):
        if all(a >= b for a, b in itertools.pairwise(h)):
            yield {(b, t) for b in range(nb) for t in range(h[b])}


def minmax_2d(y, w):
    nb, nk = y.shape
    cells = {(b, t) for b in range(nb) for t in range(nk)}
    lowers = list(staircases(nb, nk))
    uppers = [cells - L for L in lowers]
    mean = lambda S: sum(w[c] * y[c] for c in S) / sum(w[c] for c in S)  # noqa: E731
    out = np.empty_like(y)
    for x in cells:
        out[x] = max(min(mean(U & L) for L in lowers if x in L) for U in uppers if x in U)
    return out


def data(rng, shape):
    kind = rng.integers(3)
    if kind == 0:
        y = rng.normal(size=shape)
    elif kind == 1:
        y = rng.integers(0, 3, size=shape).astype(float)  # ties
    else:
        y = np.add.accumulate(rng.normal(0.5, 1, size=shape), axis=-1)  # mostly increasing
    w = rng.choice([1.0, 1.0, 0.3, 4.0], size=shape) if rng.random() < 0.6 else np.ones(shape)
    return y, w


def test_pav_equals_min_max_formula():
    rng = np.random.default_rng(0)
    for _ in range(300):
        y, w = data(rng, (int(rng.integers(1, 9)),))
        np.testing.assert_allclose(pav(y, w), minmax_1d(y, w), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("shape", [(1, 5), (5, 1), (2, 2), (2, 3), (3, 2), (3, 3), (2, 4)])
def test_grid_fit_equals_min_max_formula(shape):
    rng = np.random.default_rng(sum(shape) * 10 + shape[0])
    for _ in range(25):
        y, w = data(rng, shape)
        np.testing.assert_allclose(isotonic_grid(y, w), minmax_2d(y, w), rtol=1e-10, atol=1e-12)


def test_grid_fit_of_a_line_is_pav():
    rng = np.random.default_rng(1)
    for _ in range(50):
        y, w = data(rng, (int(rng.integers(1, 12)),))
        np.testing.assert_allclose(isotonic_grid(y[None], w[None])[0], pav(y, w), rtol=1e-12)
        np.testing.assert_allclose(isotonic_grid(y[:, None], w[:, None])[:, 0], pav(y, w),
                                   rtol=1e-12)


def test_fits_are_exactly_monotone():
    rng = np.random.default_rng(2)
    for _ in range(20):
        y = 1e-3 * (1 + rng.random((6, 9)) + 0.1 * np.arange(9))  # seconds-sized, noisy
        w = rng.choice([1.0, 2.0, 0.5], size=y.shape)
        f = isotonic_grid(y, w)
        assert (np.diff(f, axis=0) >= 0).all() and (np.diff(f, axis=1) >= 0).all()
        assert (np.diff(pav(y[0], w[0])) >= 0).all()
        # least squares: the weighted mean is kept (a clamp would not keep it)
        assert math.isclose((w * f).sum(), (w * y).sum(), rel_tol=1e-10)


def test_table_interpolates_and_is_monotone_everywhere():
    rng = np.random.default_rng(3)
    raw = 0.01 + rng.random((3, 4)) * 0.01
    t = CostTable([1, 4, 8], [0, 2, 8, 16], raw)
    f = isotonic_grid(raw)
    assert t.seconds(4, 8) == pytest.approx(f[1, 2])
    assert t(4, 12) == pytest.approx(f[1, 2])  # tokens = batch + drafts
    assert t.seconds(6, 5) == pytest.approx(0.25 * (f[1, 1] + f[1, 2] + f[2, 1] + f[2, 2]))
    assert t.seconds(1, -3) == pytest.approx(f[0, 0])  # held below the grid
    b = torch.arange(1, 13)
    for seed in range(30):  # noisy grids: the fit has flat blocks, where rounding would show
        g = np.random.default_rng(seed)
        tt = t if seed == 0 else CostTable([1, 3, 8], [0, 3, 7, 16], 0.01 + 0.01 * g.random((3, 4)))
        for batch in range(1, 13):
            tokens = torch.arange(batch, batch + 40)
            c = tt(batch, tokens)
            assert c.shape == tokens.shape and (c > 0).all() and (torch.diff(c) >= 0).all()
    for drafts in range(0, 30):  # in batch: up to rounding (exact in tokens, above)
        assert (torch.diff(t.seconds(b, drafts)) >= -1e-15).all()
    assert t(20, 20 + 40) > t(8, 8 + 16)  # extended past the grid, not flat


def test_a_python_number_is_priced_with_the_bits_of_the_tensor_path():
    rng = np.random.default_rng(7)
    for seed in range(20):
        g = np.random.default_rng(seed)
        nb, nk = int(g.integers(1, 5)), int(g.integers(1, 6))
        batches = np.sort(g.choice(np.arange(1, 70), nb, replace=False)).tolist()
        drafts = np.sort(g.choice(np.arange(0, 300), nk, replace=False)).tolist()
        t = CostTable(batches, drafts, 0.01 + 0.01 * g.random((nb, nk)))
        qb = rng.integers(0, 90, 40).tolist() + rng.uniform(0, 90, 10).tolist()
        qk = rng.integers(-5, 400, 40).tolist() + rng.uniform(-5, 400, 10).tolist()
        for b, k in zip(qb, qk, strict=True):
            got = t.seconds(b, k)
            assert isinstance(got, float)
            f64 = torch.float64
            want = t.seconds(torch.tensor(float(b), dtype=f64), torch.tensor(float(k), dtype=f64))
            assert got == float(want), (batches, drafts, b, k)  # the same bits, not close


def test_update_moves_toward_observations():
    t = CostTable([1, 2, 4], [0, 4, 8], [[1.0, 1.2, 1.4], [1.1, 1.3, 1.5], [1.2, 1.4, 1.6]])
    before = t(2, 2 + 4)
    t.update(2, 2 + 4, 2.0)
    after = t(2, 2 + 4)
    assert before < after < 2.0
    assert t(4, 4 + 4) >= after  # monotone in batch: the fit pools rather than break order
    for _ in range(60):  # an observation the order allows is reached
        t.update(1, 1 + 8, 1.45)
    assert t(1, 1 + 8) == pytest.approx(1.45, rel=1e-3)
    assert (np.diff(t.fit, axis=0) >= 0).all() and (np.diff(t.fit, axis=1) >= 0).all()
    off = t(3, 3 + 6)  # between grid points, observed faster
    t.update(3, 3 + 6, 0.5 * off)
    assert 0.5 * off < t(3, 3 + 6) < off


def test_bad_tables_raise():
    with pytest.raises(ValueError, match="batch=2, drafts=4 is missing or not positive"):
        CostTable([1, 2], [0, 4], [[1.0, 1.0], [1.0, None]])
    with pytest.raises(ValueError, match="batch=1, drafts=0 is missing or not positive"):
        CostTable([1, 2], [0, 4], [[float("nan"), 1.0], [1.0, 1.0]])
    with pytest.raises(ValueError, match="missing or not positive"):
        CostTable([1, 2], [0, 4], [[1.0, 0.0], [1.0, 1.0]])
    with pytest.raises(ValueError, match="missing or not positive"):
        CostTable([1, 2], [0, 4], [[1.0, -2.0], [1.0, 1.0]])
    with pytest.raises(ValueError, match="seconds: expected 2 rows of 2"):
        CostTable([1, 2], [0, 4], [[1.0, 1.0]])
    with pytest.raises(ValueError, match="batches: must be sorted"):
        CostTable([2, 1], [0, 4], [[1.0, 1.0], [1.0, 1.0]])
    with pytest.raises(ValueError, match="drafts: expected a non-empty"):
        CostTable([1], [], [[]])
    with pytest.raises(ValueError, match="weights"):
        CostTable([1], [0], [[1.0]], weights=[[0.0]])
    t = CostTable([1], [0], [[1.0]])
    with pytest.raises(ValueError, match="seconds: must be positive"):
        t.update(1, 1, 0.0)
    with pytest.raises(ValueError, match="isotonic: values must be finite"):
        pav([1.0, float("inf")])
    with pytest.raises(ValueError, match="budget_s"):
        measure(lambda b, k: None, [1], [0], budget_s=0)


def test_cache_keyed_by_device_torch_and_model(tmp_path, monkeypatch):
    monkeypatch.setenv("TRIMPASS_CACHE", str(tmp_path))
    calls = []

    def timer(call, share):
        calls.append(share)
        return 1e-3 * (1 + len(calls))

    def get(key):
        return cached_table(key, lambda b, k: None, [1, 2], [0, 4], timer=timer)

    first = get("model-a")
    assert len(calls) == 4
    again = get("model-a")
    assert len(calls) == 4 and again.raw.tolist() == first.raw.tolist()
    get("model-b")
    assert len(calls) == 8
    real = tm.device_name
    monkeypatch.setattr(tm, "device_name", lambda device="cpu": "another device")
    get("model-a")
    assert len(calls) == 12
    monkeypatch.setattr(tm, "device_name", real)
    monkeypatch.setattr(torch, "__version__", "0.0.1-other")
    get("model-a")
    assert len(calls) == 16
    monkeypatch.undo()
    monkeypatch.setenv("TRIMPASS_CACHE", str(tmp_path))
    assert get("model-a").raw.tolist() == first.raw.tolist() and len(calls) == 16


def test_measure_shares_its_budget_between_the_cells_and_feeds_dcut(monkeypatch):
    """On a fake clock (no dependence on this machine's speed): each cell gets an equal share of
    what is left of the budget, the whole measurement spends the budget, and the table holds
    what the timer measured."""
    from trimpass.spec.control import costmodel
    clock = [0.0]
    monkeypatch.setattr(costmodel.time, "perf_counter", lambda: clock[0])
    shares, seen = [], []

    def timer(call, share):
        shares.append(share)
        call()
        clock[0] += share  # the default timer spends about its share
        return 0.005 * (seen[-1][0] + seen[-1][1])

    table = measure(lambda b, k: seen.append((b, k)), [1, 2], [0, 4], budget_s=0.4,
                    timer=timer)
    assert seen == [(1, 0), (1, 4), (2, 0), (2, 4)]
    assert shares == pytest.approx([0.1] * 4) and clock[0] == pytest.approx(0.4)
    assert table.raw.reshape(-1).tolist() == pytest.approx([0.005, 0.025, 0.01, 0.03])
    assert table(2, 6) == pytest.approx(0.03)
    n = dcut(torch.full((2, 4), 0.9), table, draft_time=1e-3)
    assert n.shape == (2,) and 0 <= int(n.sum()) <= 8


def test_the_default_timer_stays_within_about_one_call_per_cell_of_the_budget():
    """The real clock: the bound is the property itself, one call per cell over the budget,
    with each call's own measured seconds (a loaded machine's slow calls widen it)."""
    calls = []

    def verify(batch, drafts):
        t = time.perf_counter()
        time.sleep(0.005 * (batch + drafts))
        calls.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    table = measure(verify, [1, 2], [0, 4], budget_s=0.4)
    spent = time.perf_counter() - t0
    assert spent < 0.4 + 4 * max(calls) + 0.01 * len(calls) + 0.2, (spent, max(calls))
    assert (table.raw > 0).all()


def test_a_step_cost_adds_the_overhead_and_changes_what_pays():
    table = CostTable([1, 4], [0, 16], [[0.05, 0.21], [0.05, 0.21]])  # 0.05 s + 0.01 s a token
    step = StepCost(table, lambda batch: 0.3, lambda batch: 0.3)
    tokens = torch.tensor([1, 3, 9])
    assert torch.allclose(step(1, tokens), table(1, tokens) + 0.3)
    cheap_plain = StepCost(table, lambda batch: 0.1, lambda batch: 0.3)
    assert torch.allclose(cheap_plain(1, tokens), table(1, tokens) + torch.tensor([0.1, 0.3, 0.3],
                                                                                  dtype=torch.float64))
    assert StepCost(table, lambda b: 0.3, lambda b: 0.1)(1, 2) == pytest.approx(table(1, 2) + 0.3)
    conf = torch.full((1, 4), 0.5)  # scores 0.5, 0.25, 0.125, 0.0625; 0.02 s of drafting
    # by hand, rate(K) = (1 + sum of K scores) / (0.02 + 0.05 + 0.01 K [+ 0.3]):
    # K = 0..4 without overhead 14.3, 18.8, 19.4, 18.8, 17.6; with it 3.57, 5.36, 4.49 (K = 2),
    # 4.69, 4.73 (K = 4 wins)
    assert int(dcut(conf, table, draft_time=0.02).sum()) == 2
    assert int(dcut(conf, step, draft_time=0.02).sum()) == 4
    # a step verifying nothing pays 0.1 s: 1 / 0.17 beats every drafted K (K = 4: 1.94 / 0.41)
    assert int(dcut(conf, cheap_plain, draft_time=0.02).sum()) == 0
    # drafting 4 tokens at 0.9 (0.2 s, then 0.1 s a step) never beats 1 / 0.05 tokens/s, but
    # beats 1 / 1.05 once every step also pays 1 s: 4.1 tokens / 1.59 s
    def pays(cost):
        drafted = best_rate(torch.full((1, 4), 0.9, dtype=torch.float64), cost, 0.5)
        return drafted > best_rate(torch.zeros(1, 1, dtype=torch.float64), cost)
    assert not pays(table)
    assert pays(StepCost(table, lambda batch: 1.0, lambda batch: 1.0))


def test_an_engine_refits_every_few_steps_within_its_share_of_the_forward_seconds():
    from trimpass.spec.control.costmodel import REFIT_AFTER, EngineCost
    table = CostTable([1, 2, 4, 8], [0, 4, 8, 16, 32], 0.05 + 0.001 * np.arange(20).reshape(4, 5))
    cost = EngineCost(lambda b, drafted: 0.0, table.to_dict())
    v0 = cost.table.version
    for _ in range(REFIT_AFTER):  # the first fit after REFIT_AFTER updates
        cost.observe(2, 2, 1e-7)
    assert cost.table.version == v0 + 1 and cost.table(2, 2) < 0.05
    for _ in range(40 * REFIT_AFTER):  # steps far shorter than a fit: fits would dominate
        cost.observe(4, 4, 1e-7)
    assert cost.table.version == v0 + 1 and cost.updates == 41 * REFIT_AFTER
    assert cost.table.raw[2, 0] < 0.01 < cost.table(4, 4)  # the raw timings moved, not the fit
    cost.observe(8, 8, 10.0)  # a long step: fitting is cheap beside it, and updates are due
    assert cost.table.version == v0 + 2 and cost.table(4, 4) < 0.01
    for _ in range(REFIT_AFTER - 1):
        cost.observe(8, 8, 10.0)
    assert cost.table.version == v0 + 2
    cost.observe(8, 8, 10.0)
    assert cost.table.version == v0 + 3 and cost.table(8, 8) > 1


def test_plain_steps_slower_than_measured_raise_the_price_of_drafted_tokens_too():
    # a table measured from forwards of n = B + K tokens, 20 ms a token, and an engine whose real
    # plain steps run at twice that: drafted tokens must not come to look free beside them
    batches, drafts = [1, 2, 4, 8], [0, 1, 2, 4, 8, 16, 32]
    forward = [[0.02 * (b + k) for k in drafts] for b in batches]
    t = CostTable(batches, drafts, forward)
    for _ in range(40):
        t.update(4, 4, 2 * 0.02 * 4)
    assert t(4, 4) == pytest.approx(0.16, rel=1e-3)
    for b, k in ((4, 1), (4, 4), (4, 16), (4, 32), (2, 8), (8, 8)):  # never observed: they
        assert t(b, b + k) == pytest.approx(2 * 0.02 * (b + k), rel=0.02), (b, k)  # follow it
    for _ in range(40):  # a drafted cell's own evidence outweighs the row's ratio
        t.update(4, 4 + 16, 0.02 * 20)
    assert t(4, 4 + 16) == pytest.approx(0.02 * 20, rel=0.02)
    assert t(4, 4) == pytest.approx(0.16, rel=0.15)


def test_drafted_steps_slower_than_measured_leave_the_price_of_a_plain_step_alone():
    # a bucket that always drafts never observes its plain step: if the drafted steps' ratio
    # raised it, drafting would keep looking better than plain steps that are cheaper in truth
    batches, drafts = [1, 2, 4, 8], [0, 1, 2, 4, 8, 16, 32]
    forward = [[0.02 * (b + k) for k in drafts] for b in batches]
    t = CostTable(batches, drafts, forward)
    for _ in range(40):
        t.update(1, 5, 2.5 * 0.02 * 5)  # one request verifying 4 drafted tokens, at 2.5x
    assert t(1, 5) == pytest.approx(0.25, rel=1e-3)
    assert t(1, 1) == pytest.approx(0.02, rel=1e-3)  # the plain step as measured
    assert t(2, 2) == pytest.approx(0.04, rel=1e-3)
    assert t(2, 2 + 8) == pytest.approx(2.5 * 0.02 * 10, rel=0.02)  # drafted cells follow
    for _ in range(40):  # plain steps observed: then they, and their ratio, move the plain cells
        t.update(1, 1, 0.05)
    assert t(1, 1) == pytest.approx(0.05, rel=1e-3)
    assert t(2, 2) == pytest.approx(2.5 * 0.04, rel=0.02)
