"""D-Cut against brute force: the chosen cut's rate equals the best over every per-request prefix
vector on random small instances (ties, zeros, flat and non-monotone costs, buckets), the kept
tokens are the highest scores with ties in (request, position) order, the two limits (no speculation
under a prohibitive per-token cost, whole drafts when verification is free), draft_more's rule
recomputed by enumeration and its promise checked on continuations, and the input checks."""
import itertools
import random

import pytest
import torch

from trimpass.budget import dcut, draft_more, drafting_pays, next_step_pays


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


def brute_active(conf, cost, step, gmax, base):
    """draft_more's rule by enumeration, scalar cost calls."""
    B, d = len(conf), len(conf[0]) if conf else 0
    S = py_scores(conf)
    T = base + gmax * step
    r_lb = max((B + sum(sum(S[i][:m]) for i, m in enumerate(n))) / (T + cost(B, B + sum(n)))
               for n in itertools.product(range(d + 1), repeat=B))
    marg = [cost(B, B + K) - cost(B, B + K - 1) for K in range(1, B * gmax + 1)]
    out = []
    for i in range(B):
        last = S[i][-1] if d else 1.0
        k = 1 + sum(1 for j in range(B) for t in range(d)
                    if S[j][t] > last or (S[j][t] == last and j <= i))
        out.append(last > r_lb * min(marg[k - 1:]))
    return out


def test_draft_more_rule_and_promise():
    rng = random.Random(3)
    stopped = 0
    for _ in range(120):
        B, gmax = rng.randint(1, 3), rng.randint(1, 4)
        full = random_conf(rng, B, gmax)
        cost, vals = random_cost(rng, B, B * gmax, tensor=rng.random() < 0.5)
        step, base = rng.uniform(0, 0.3), rng.choice([0.0, 0.1])
        for d in range(gmax + 1):
            prefix = [row[:d] for row in full]
            got = draft_more(torch.tensor(prefix, dtype=torch.float64).reshape(B, d), cost, step,
                             gamma_max=gmax, draft_time_base=base).tolist()
            want = [False] * B if d == gmax else brute_active(prefix, cost, step, gmax, base)
            assert got == want
            off = [i for i in range(B) if not got[i]]
            stopped += len(off)
            # promise: whatever is drafted next and wherever drafting ends, the cut never takes
            # a token of a stopped request past d
            for tail in ("ones", "random", "mine"):
                for i0 in off or [None]:
                    cont = [row[:d] + [1.0 if tail == "ones" or (tail == "mine" and i == i0)
                                       else (rng.random() if tail == "random" else 0.0)
                                       for _ in range(gmax - d)] for i, row in enumerate(full)]
                    for D in range(max(d, 1), gmax + 1):
                        n = dcut(torch.tensor([r[:D] for r in cont]), cost, base + D * step)
                        assert all(n[i] <= d for i in off), (prefix, cont, D, n, off)
    assert stopped > 50  # the rule does stop requests in these instances


def test_draft_more_stops_everything_when_tokens_are_costly():
    conf = torch.tensor([[0.9], [0.8]])
    assert not draft_more(conf, lambda b, t: 0.01 + 10.0 * (t - b), 0.001, gamma_max=4).any()
    assert draft_more(conf, lambda b, t: 0.01, 0.001, gamma_max=4).all()
    assert draft_more(torch.zeros(2, 0), lambda b, t: 0.01, 0.001, gamma_max=4).all()


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
    with pytest.raises(ValueError, match="gamma_max"):
        draft_more(ok, cost, 0.1, gamma_max=0)
    with pytest.raises(ValueError, match="exceed gamma_max"):
        draft_more(ok, cost, 0.1, gamma_max=2)
    with pytest.raises(ValueError, match="draft_time_per_step"):
        draft_more(ok, cost, float("nan"), gamma_max=4)


def _brute_best_rate(scores, cost, B, dt):
    """max over every K of (B + sum of the K highest of ``scores``) / (dt + cost(B, B + K))."""
    top = sorted(scores, reverse=True)
    return max((B + sum(top[:K])) / (dt + cost(B, B + K)) for K in range(len(top) + 1))


@pytest.mark.parametrize("seed", range(20))
def test_next_step_pays_matches_brute_force(seed):
    rng = random.Random(seed)
    B, d = rng.randint(1, 4), rng.randint(1, 3)
    conf = [[rng.random() for _ in range(d)] for _ in range(B)]
    a, b = rng.uniform(0.005, 0.02), rng.uniform(0.0, 0.01)
    cost = lambda _b, t: a + b * t  # noqa: E731
    dt, step = rng.uniform(0.0, 0.02), rng.uniform(0.0, 0.02)
    S = py_scores(conf)
    now = _brute_best_rate([x for r in S for x in r], cost, B, dt)
    guess = [r + [r[-1] * c[-1]] for r, c in zip(S, conf, strict=True)]
    later = _brute_best_rate([x for r in guess for x in r], cost, B, dt + step)
    assert next_step_pays(torch.tensor(conf, dtype=torch.float64), cost, dt, step) == (later > now)


def test_next_step_pays_only_when_drafting_is_cheap_against_its_gain():
    conf = torch.full((2, 2), 0.9, dtype=torch.float64)
    cheap = lambda b, t: 0.01 + 0.0001 * t  # noqa: E731
    assert next_step_pays(conf, cheap, draft_time=0.002, step_time=0.0001)
    assert not next_step_pays(conf, cheap, draft_time=0.002, step_time=0.05)
    assert not next_step_pays(torch.zeros(2, 2), cheap, 0.002, 0.0)  # nothing left to gain
    assert next_step_pays(torch.zeros(2, 0), cheap, 0.0, 1.0)  # nothing drafted yet
    with pytest.raises(ValueError, match="step_time: must be finite and >= 0"):
        next_step_pays(conf, cheap, 0.0, -1.0)


def _brute_drafting_pays(B, vals, first, step, gamma, p):
    """Some depth D and kept K <= B * D beat drafting nothing, each draft at its best (every
    kept token accepted with probability p)."""
    none = B / vals[0]
    return any((B + K * p) / (first + (D - 1) * step + vals[K]) > none
               for D in range(1, gamma + 1) for K in range(1, B * D + 1))


@pytest.mark.parametrize("seed", range(30))
def test_drafting_pays_matches_brute_force_and_no_cut_beats_it_when_false(seed):
    rng = random.Random(seed)
    B, gamma = rng.randint(1, 4), rng.randint(1, 4)
    cost, vals = random_cost(rng, B, B * gamma, tensor=seed % 2 == 0)
    first, step = rng.choice([0.0, rng.uniform(0, 0.5)]), rng.uniform(0, 0.3)
    p = rng.choice([1.0, rng.uniform(0.2, 1.0)])
    pays = drafting_pays(B, cost, first, step, gamma_max=gamma, accept_max=p)
    assert pays == _brute_drafting_pays(B, vals, first, step, gamma, p)
    if not pays:  # then no draft of confidences <= p, at any depth, is worth its time
        for _ in range(20):
            D = rng.randint(1, gamma)
            conf = [[rng.uniform(0, p) for _ in range(D)] for _ in range(B)]
            n = dcut(torch.tensor(conf, dtype=torch.float64), cost, first + (D - 1) * step)
            S = py_scores(conf)
            assert rate(n.tolist(), S, B, first + (D - 1) * step, vals) <= B / vals[0] + 1e-12


def test_drafting_pays_where_verification_is_flat_and_not_where_it_is_linear():
    flat = lambda b, t: 0.05  # noqa: E731
    linear = lambda b, t: 0.01 * t  # noqa: E731  every token costs the same: drafts never pay
    assert drafting_pays(16, flat, 0.01, 0.005, gamma_max=4)
    assert not drafting_pays(16, linear, 0.01, 0.005, gamma_max=4)
    assert not drafting_pays(1, flat, 1.0, 0.0, gamma_max=4)  # the first forward costs too much
    assert drafting_pays(1, flat, 0.01, 0.0, gamma_max=4, accept_max=0.5)
    assert not drafting_pays(1, flat, 0.01, 0.0, gamma_max=4, accept_max=0.0)
    for bad, match in (({"batch": 0}, "batch"), ({"gamma_max": 0}, "gamma_max"),
                       ({"accept_max": 1.5}, "accept_max"), ({"first_time": -1.0}, "first_time")):
        kw = {"batch": 2, "cost": flat, "first_time": 0.0, "step_time": 0.0, "gamma_max": 2,
              **bad}
        with pytest.raises(ValueError, match=match):
            drafting_pays(**kw)
