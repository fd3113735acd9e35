"""D-Cut against brute force: the chosen cut's rate equals the best over every per-request prefix
vector on random small instances (ties, zeros, flat and non-monotone costs, buckets), the kept
tokens are the highest scores with ties in (request, position) order, the two limits (no speculation
under a prohibitive per-token cost, whole drafts when verification is free), the best rate
against brute force, and the input checks."""
import itertools
import random

import pytest
import torch

from trimpass.spec.control import best_rate, dcut


def py_scores(conf):
    out = []
    for row in conf:
        p, s = 1.0, []
        for c in row:
            p *= c
            s.append(p)
        out.append(s)
    return out


def random_conf(rng, B, gamma):
    kind = rng.choice(["uniform", "ties", "short"])
    conf = []
    for _ in range(B):
        if kind == "ties":
            row = [rng.choice([0.0, 0.5, 1.0, 1.0]) for _ in range(gamma)]
        else:
            row = [rng.random() for _ in range(gamma)]
            if kind == "short":  # zeros past a random draft length
                n = rng.randint(0, gamma)
                row = row[:n] + [0.0] * (gamma - n)
        conf.append(row)
    return conf


def random_cost(rng, B, K_max, tensor):
    """Seconds for B + K verified tokens, K = 0..K_max: monotone (with flat steps) or not."""
    base = rng.uniform(0.05, 1.0)
    if rng.random() < 0.8:
        steps = [rng.choice([0.0, rng.uniform(0, 0.2)]) for _ in range(K_max)]
        vals = list(itertools.accumulate([base, *steps]))
    else:
        vals = [base + rng.uniform(0, 0.5) for _ in range(K_max + 1)]
    if tensor:
        table = torch.tensor(vals, dtype=torch.float64)
        return (lambda b, t: table[torch.as_tensor(t) - b]), vals
    return (lambda b, t: vals[t - b]), vals  # a list: not tensor-capable, per-K calls


def rate(n, S, B, dt, vals):
    return (B + sum(sum(S[i][:m]) for i, m in enumerate(n))) / (dt + vals[sum(n)])


@pytest.mark.parametrize("use_buckets", [False, True])
def test_matches_brute_force(use_buckets):
    rng = random.Random(7 + use_buckets)
    for _ in range(250):
        B, gamma = rng.randint(1, 4), rng.randint(1, 4)
        conf = random_conf(rng, B, gamma)
        cost, vals = random_cost(rng, B, B * gamma, tensor=rng.random() < 0.5)
        dt = rng.choice([0.0, rng.uniform(0, 1)])
        buckets = None
        allowed = set(range(B * gamma + 1))
        if use_buckets:
            buckets = sorted(rng.sample(range(0, B * gamma + 3), rng.randint(0, 4)))
            allowed = {0} | {b for b in buckets if b <= B * gamma}
        S = py_scores(conf)
        best = max(rate(n, S, B, dt, vals)
                   for n in itertools.product(range(gamma + 1), repeat=B) if sum(n) in allowed)
        n = dcut(torch.tensor(conf), cost, dt, buckets).tolist()
        assert sum(n) in allowed and all(0 <= m <= gamma for m in n)
        assert rate(n, S, B, dt, vals) >= best * (1 - 1e-12), (conf, vals, dt, buckets, n)
        # the kept tokens are the highest scores; among equal scores, the first (request, position)
        kept = [(S[i][k], i, k) for i in range(B) for k in range(n[i])]
        left = [(S[i][k], i, k) for i in range(B) for k in range(n[i], gamma)]
        if kept and left:
            assert min(kept)[0] >= max(left)[0]
            for s, i, k in left:
                assert all((i2, k2) < (i, k) for s2, i2, k2 in kept if s2 == s)


def test_prohibitive_cost_means_no_speculation():
    conf = torch.tensor([[0.99, 0.99, 0.99], [0.9, 0.5, 0.2]])
    n = dcut(conf, lambda b, t: 0.01 + 100.0 * (t - b), draft_time=0.002)
    assert n.tolist() == [0, 0]


def test_free_verification_keeps_whole_drafts():
    conf = torch.tensor([[0.99, 0.5, 0.01, 0.3], [0.2, 0.0, 0.7, 0.7], [1e-3, 1e-3, 1e-3, 1e-3]])
    n = dcut(conf, lambda b, t: 0.05, draft_time=0.01)
    assert n.tolist() == [4, 1, 4]  # everything with a positive score, nothing past a zero


def test_buckets_force_a_static_size():
    conf = torch.tensor([[0.9, 0.9], [0.9, 0.0]])
    n = dcut(conf, lambda b, t: 1.0, buckets=[4])  # free tokens: pad to the one bucket
    assert n.tolist() == [2, 2]
    assert dcut(conf, lambda b, t: 1.0 + (t - b), buckets=[4]).tolist() == [0, 0]


def test_bad_input():
    ok = torch.full((2, 3), 0.5)
    cost = lambda b, t: 1.0  # noqa: E731
    for bad in ([[0.5, 1.5]], [[-0.1, 0.5]], [[float("nan"), 0.5]]):
        with pytest.raises(ValueError, match="confidences.*\\[0, 1\\]"):
            dcut(torch.tensor(bad), cost)
    with pytest.raises(ValueError, match="confidences.*2-D"):
        dcut(torch.full((3,), 0.5), cost)
    with pytest.raises(ValueError, match="confidences.*2-D"):
        dcut(torch.full((1, 2, 3), 0.5), cost)
    with pytest.raises(ValueError, match="confidences: gamma"):
        dcut(torch.zeros(2, 0), cost)
    with pytest.raises(ValueError, match="buckets.*sorted"):
        dcut(ok, cost, buckets=[4, 2])
    with pytest.raises(ValueError, match="buckets.*>= 0"):
        dcut(ok, cost, buckets=[-1, 2])
    with pytest.raises(ValueError, match="draft_time"):
        dcut(ok, cost, draft_time=-1.0)
    for bad_cost in (lambda b, t: 0.0, lambda b, t: -1.0, lambda b, t: float("inf"),
                     lambda b, t: float("nan"), lambda b, t: 1.0 - 0.2 * (t - b)):
        with pytest.raises(ValueError, match="cost: must return positive, finite"):
            dcut(ok, bad_cost)
    with pytest.raises(ValueError, match="cost: expected a callable"):
        dcut(ok, 3.0)
    with pytest.raises(ValueError, match="draft_time"):
        best_rate(ok, cost, draft_time=float("nan"))


def _brute_best_rate(scores, cost, B, dt):
    """max over every K of (B + sum of the K highest of ``scores``) / (dt + cost(B, B + K))."""
    top = sorted(scores, reverse=True)
    return max((B + sum(top[:K])) / (dt + cost(B, B + K)) for K in range(len(top) + 1))


@pytest.mark.parametrize("seed", range(20))
def test_best_rate_matches_brute_force(seed):
    rng = random.Random(seed)
    B, gamma = rng.randint(1, 3), rng.randint(1, 3)
    conf = random_conf(rng, B, gamma)
    cost, _ = random_cost(rng, B, B * gamma, tensor=False)
    dt = rng.choice([0.0, 0.01, 0.3])
    scores = [s for row in py_scores(conf) for s in row]
    want = _brute_best_rate(scores, cost, B, dt)
    assert best_rate(torch.tensor(conf, dtype=torch.float64), cost, dt) == pytest.approx(want)
