"""trimpass.train.losses: E[L] from the formulas against Monte-Carlo runs of the real acceptance
rules (drafts sampled from q, with and without a column subset), hand-computed values, NaN-free
gradients with masks, -inf logits and subsets, GRPO pieces on hand-built cases, a 20-step
optimization that lowers every loss, and the errors bad input raises. Expected values are computed
here by hand or by simulation, never by the code under test."""
import math

import pytest
import torch
import torch.nn.functional as F

from trimpass.train import (
    eal_loss,
    expected_length,
    greedy_acceptance,
    group_advantages,
    grpo_objective,
    kl_loss,
    sampling_acceptance,
    simulate_greedy,
    simulate_sampling,
    wtv_loss,
)

N_MC = 40_000


def _leading_runs(accept, gamma):
    """accept [n, B, S] bool -> accepted length of every window start [n, B, S - gamma + 1]."""
    S = accept.shape[-1]
    runs = []
    for i in range(S - gamma + 1):
        length = torch.zeros(accept.shape[:2], dtype=torch.long)
        alive = torch.ones(accept.shape[:2], dtype=torch.bool)
        for j in range(i, i + gamma):
            alive &= accept[..., j]
            length += alive
        runs.append(length)
    return torch.stack(runs, -1).double()


def _assert_within_3se(expected, runs):
    mean, se = runs.mean(0), runs.std(0) / math.sqrt(runs.shape[0])
    gap = (expected.double() - mean).abs()
    assert (gap <= 3 * se + 1e-3).all(), f"E[L] {expected} vs Monte-Carlo {mean} (se {se})"
    return mean, se


def _sample(q, n):
    """n draws per position from q [B, S, C] -> [n, B, S] column indices."""
    B, S, C = q.shape
    return torch.multinomial(q.reshape(-1, C), n, replacement=True).T.reshape(n, B, S)


@pytest.mark.parametrize("subset", [False, True])
def test_greedy_expected_length_matches_monte_carlo(subset):
    B, S, V, gamma = 2, 6, 11 if subset else 8, 3 if subset else 4
    ystar = torch.randint(0, V, (B, S))
    logits = torch.randn(B, S, V)
    logits.scatter_add_(-1, ystar.unsqueeze(-1), torch.full((B, S, 1), 2.5))  # often accepted
    cols = torch.randperm(V)[:6].sort().values if subset else torch.arange(V)
    if subset:  # some y* inside the columns, at least one outside (target_index -1)
        ystar[0, 1], ystar[1, 3] = cols[2], [v for v in range(V) if v not in cols.tolist()][0]
    draft = logits[..., cols]
    hit = ystar.unsqueeze(-1) == cols
    index = torch.where(hit.any(-1), hit.long().argmax(-1), -1)
    assert (index == -1).any() == subset
    expected = expected_length(greedy_acceptance(draft, index), gamma)
    drafted = cols[_sample(torch.softmax(draft, -1), N_MC)]  # the drafter samples its columns
    _assert_within_3se(expected, _leading_runs(drafted == ystar, gamma))


@pytest.mark.parametrize("subset,T", [(False, 1.0), (False, 0.7), (True, 1.0), (True, 1.3)])
def test_sampling_expected_length_matches_monte_carlo(subset, T):
    B, S, V, gamma = 2, 6, 10 if subset else 7, 4 if subset else 3
    target = torch.randn(B, S, V) * 2
    draft_full = target + torch.randn(B, S, V)
    cols = torch.randperm(V)[:6].sort().values if subset else torch.arange(V)
    lse = torch.logsumexp(target / T, -1) if subset else None
    expected = expected_length(sampling_acceptance(draft_full[..., cols], target[..., cols], T,
                                                   lse), gamma)
    q = torch.softmax(draft_full[..., cols] / T, -1)  # the drafter proposes its columns only
    p = torch.softmax(target / T, -1)  # the target's distribution over the full vocabulary
    x = _sample(q, N_MC)
    qx = q.unsqueeze(0).expand(N_MC, -1, -1, -1).gather(-1, x.unsqueeze(-1)).squeeze(-1)
    px = p.unsqueeze(0).expand(N_MC, -1, -1, -1).gather(-1, cols[x].unsqueeze(-1)).squeeze(-1)
    accept = torch.rand(x.shape) < torch.clamp(px / qx, max=1.0)
    mean, se = _assert_within_3se(expected, _leading_runs(accept, gamma))
    if subset:  # the test can tell: renormalizing p over the columns would be far off
        renorm = expected_length(sampling_acceptance(draft_full[..., cols], target[..., cols], T),
                                 gamma)
        assert ((renorm.double() - mean).abs() > 3 * se + 1e-3).any()


def test_expected_length_is_gamma_for_a_perfect_drafter():
    x = torch.randn(2, 5, 9) * 3
    for gamma in (1, 3, 4):
        assert torch.allclose(expected_length(sampling_acceptance(x, x), gamma),
                              torch.full((2, 6 - gamma), float(gamma)), atol=1e-5)
    same = wtv_loss(x.bfloat16(), x.bfloat16(), 4, temperature=0.5)
    assert same.item() == pytest.approx(-4, abs=1e-4)
    ystar = torch.randint(0, 9, (2, 5))
    sure = x.scatter(-1, ystar.unsqueeze(-1), 80.0)
    assert torch.allclose(expected_length(greedy_acceptance(sure, ystar), 4),
                          torch.full((2, 2), 4.0), atol=1e-4)
    assert eal_loss(sure, ystar, 3).item() == pytest.approx(-3, abs=1e-4)


def test_hand_computed_values():
    a = torch.tensor([[0.9, 0.8, 0.5, 1.0]])
    assert torch.allclose(expected_length(a, 2), torch.tensor([[1.62, 1.2, 1.0]]))
    half = torch.full((1, 4), 0.5)
    assert torch.allclose(expected_length(half, 3), torch.tensor([[0.875, 0.875]]))
    mask = torch.tensor([[True, True, False, True]])  # a window ends at its first masked position
    assert torch.allclose(expected_length(half, 3, mask), torch.tensor([[0.75, 0.5]]))
    assert eal_loss(torch.zeros(1, 4, 2), torch.zeros(1, 4, dtype=torch.long), 3,
                    mask).item() == pytest.approx(-(0.75 + 0.5) / 2)
    q = torch.tensor([[[0.0, math.log(3)]] * 3])  # q = [0.25, 0.75]
    assert torch.allclose(greedy_acceptance(q, torch.tensor([[1, -1, 0]])),
                          torch.tensor([[0.75, 0.0, 0.25]]))
    p, qq = torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.25, 0.25, 0.5])
    alpha = sampling_acceptance(qq.log().view(1, 1, 3), p.log().view(1, 1, 3))
    assert alpha.item() == pytest.approx(0.5)
    full = torch.tensor([0.4, 0.3, 0.3]).log()  # target over V = 3, columns {0, 1}, q = [.5, .5]
    lse = torch.logsumexp(full, -1).view(1, 1)
    sub_d, sub_t = torch.zeros(1, 1, 2), full[:2].view(1, 1, 2)
    assert sampling_acceptance(sub_d, sub_t, target_lse=lse).item() == pytest.approx(0.7)
    assert kl_loss(sub_d, sub_t, target_lse=lse).item() == pytest.approx(
        0.4 * math.log(0.4 / 0.5) + 0.3 * math.log(0.3 / 0.5), abs=1e-6)
    kl = kl_loss(torch.tensor([[[0.0, math.log(3)]]]), torch.zeros(1, 1, 2))
    assert kl.item() == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3), abs=1e-6)


def test_kl_matches_torch_kl_div_at_temperature():
    d, t = torch.randn(3, 4, 9), torch.randn(3, 4, 9) * 2
    ref = F.kl_div(torch.log_softmax(d / 2, -1), torch.log_softmax(t / 2, -1), log_target=True,
                   reduction="none").sum(-1)
    assert kl_loss(d, t, temperature=2.0).item() == pytest.approx(ref.mean().item(), rel=1e-5)
    mask = torch.rand(3, 4) > 0.4
    assert kl_loss(d, t, 2.0, mask=mask).item() == pytest.approx(ref[mask].mean().item(), rel=1e-5)


def test_gradients_are_finite_with_masks_inf_logits_and_subsets():
    B, S, V = 2, 6, 10
    cols = torch.tensor([0, 2, 3, 5, 7, 8])
    target_full = torch.randn(B, S, V)
    target_full[0, 4] = float("-inf")  # a padded target row: lse -inf, masked

    def lse(T):
        return torch.logsumexp(target_full / T, -1)

    target = target_full[..., cols].clone().requires_grad_()
    draft = torch.randn(B, S, len(cols))
    draft[..., 1] = float("-inf")  # an inactive column everywhere
    draft[1, 2] = float("-inf")  # a row with nothing active
    draft.requires_grad_()
    index = torch.tensor([[0, -1, 1, 3, -1, 5], [2, 1, 0, -1, 4, 1]])  # -1, and -inf columns (1)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[0, 4] = mask[1, 5] = False
    losses = [kl_loss(draft, target, 1.5, lse(1.5), mask), eal_loss(draft, index, 3, mask),
              wtv_loss(draft, target, 3, 0.8, lse(0.8), mask), eal_loss(draft, index, 2),
              kl_loss(draft, target, mask=mask), wtv_loss(draft, target, 4, mask=mask)]
    for loss in losses:
        assert torch.isfinite(loss)
        draft.grad = target.grad = None
        loss.backward()
        assert torch.isfinite(draft.grad).all()
        assert target.grad is None or torch.isfinite(target.grad).all()
        assert (draft.grad[..., 1] == 0).all() and (draft.grad[1, 2] == 0).all()
    eal_loss(draft, index, 3, mask).backward()
    assert (draft.grad[1, 5] == 0).all() and draft.grad[0, 0].abs().sum() > 0


def test_bf16_inputs_give_fp32_losses_and_bf16_gradients():
    d = torch.randn(2, 5, 8).bfloat16().requires_grad_()
    t = torch.randn(2, 5, 8).bfloat16()
    for loss in (kl_loss(d, t), wtv_loss(d, t, 3), eal_loss(d, t.argmax(-1), 3)):
        assert loss.dtype == torch.float32
        d.grad = None
        loss.backward()
        assert d.grad.dtype == torch.bfloat16 and torch.isfinite(d.grad.float()).all()


def test_group_advantages():
    rewards = torch.tensor([[0.7] * 7, [0.9] * 7, [1.0, 2.0, 3.0, 4.0, 2.5, 2.5, 2.5]])
    assert (rewards[:2] - rewards[:2].mean(1, keepdim=True)).abs().max() > 0  # fp rounding noise
    adv = group_advantages(rewards)
    assert torch.equal(adv[:2], torch.zeros(2, 7))
    std = math.sqrt((1.5**2 + 0.5**2 + 0.5**2 + 1.5**2) / 7)
    assert torch.allclose(adv[2], torch.tensor([-1.5, -0.5, 0.5, 1.5, 0, 0, 0]) / std, atol=1e-5)
    assert torch.equal(group_advantages(torch.tensor([[3, 3, 3]])), torch.zeros(1, 3))


def test_simulate_greedy_hand_cases():
    target = torch.tensor([[5, 6, 7, 8], [1, 1, 1, 1]])
    drafts = torch.tensor([[[5, 6, 7, 8], [5, 6, 0, 8], [0, 6, 7, 8], [5, 6, 7, 9]],
                           [[1, 1, 1, 1], [2, 1, 1, 1], [1, 2, 1, 1], [1, 1, 1, 2]]])
    assert torch.equal(simulate_greedy(drafts, target), torch.tensor([[4, 2, 0, 3], [4, 0, 1, 3]]))


def test_simulate_sampling_rule():
    ids = torch.tensor([[[0, 1, 2], [2, 2, 2]]])
    q = torch.tensor([0.2, 0.3, 0.5]).expand(1, 2, 3, 3)
    generous = torch.tensor([0.2, 0.5, 0.5]).expand(1, 3, 3)  # p >= q on every column
    assert torch.equal(simulate_sampling(ids, q, generous), torch.tensor([[3, 3]]))
    p = torch.tensor([[[0.3, 0.3, 0.4]] * 3, [[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [0.1, 0.1, 0.8]]])
    # window 0: columns 0 and 1 have p >= q, column 2 is accepted with probability 0.8;
    # window 1 drafts column 2 where its p = 0 at the first position: rejected at once
    out = simulate_sampling(ids, q, p.unsqueeze(0))
    assert out[0, 1] == 0 and out[0, 0] >= 2
    n = 40_000  # one token, q(x) = 0.8, p(x) = 0.2: accepted with probability 0.25
    one = torch.zeros(1, n, 1, dtype=torch.long)
    qx, px = torch.tensor([0.8, 0.2]).expand(1, n, 1, 2), torch.tensor([[[0.2, 0.8]]])
    g = torch.Generator().manual_seed(7)
    rate = simulate_sampling(one, qx, px, generator=g).double().mean().item()
    assert abs(rate - 0.25) < 3 * math.sqrt(0.25 * 0.75 / n)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(simulate_sampling(one, qx, px, g1), simulate_sampling(one, qx, px, g2))


def test_grpo_objective_hand_cases():
    A = torch.tensor([[1.0, -1.0, 2.0]])
    base = torch.randn(1, 3, 4)
    new = base.clone().requires_grad_()
    assert grpo_objective(new, base, base, A).item() == pytest.approx(-2 / 3, abs=1e-6)
    k3 = math.exp(0.5) - 0.5 - 1
    assert grpo_objective(new, base, base + 0.5, A, kl_coef=0.1).item() == pytest.approx(
        -2 / 3 + 0.1 * k3, abs=1e-6)
    loss = grpo_objective(new, base - 0.5, base, A, kl_coef=0.0)  # ratio e^0.5 > 1 + clip
    loss.backward()
    assert (new.grad[0, 0] == 0).all() and (new.grad[0, 2] == 0).all()  # A > 0: clipped
    assert torch.allclose(new.grad[0, 1], torch.full((4,), math.exp(0.5) / 12))  # A < 0: not
    mask = torch.tensor([[[True, True, False, False], [False] * 4, [True] * 4]])
    padded = base.masked_fill(~mask, float("-inf")).requires_grad_()
    loss = grpo_objective(padded, base.masked_fill(~mask, float("-inf")), base, A, mask)
    assert loss.item() == pytest.approx(-(1.0 + 2.0) / 2, abs=1e-6)  # window 1 has no tokens
    loss.backward()
    assert torch.isfinite(padded.grad).all()


def _fit(loss_fn, steps=20, lr=0.05):
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 10)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    values = []
    for _ in range(steps):
        loss = loss_fn(model)
        opt.zero_grad()
        loss.backward()
        opt.step()
        values.append(loss.item())
    return values, model


H = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1))
TARGET = torch.randn(4, 8, 10, generator=torch.Generator().manual_seed(2)) * 3


@pytest.mark.parametrize("name", ["kl", "eal", "wtv", "wtv_subset"])
def test_twenty_steps_lower_each_loss(name):
    cols = torch.tensor([0, 1, 3, 4, 6, 9])
    lse = torch.logsumexp(TARGET, -1)
    fns = {"kl": lambda m: kl_loss(m(H), TARGET),
           "eal": lambda m: eal_loss(m(H), TARGET.argmax(-1), 3),
           "wtv": lambda m: wtv_loss(m(H), TARGET, 3),
           "wtv_subset": lambda m: wtv_loss(m(H)[..., cols], TARGET[..., cols], 3, target_lse=lse)}
    values, _ = _fit(fns[name])
    assert values[-1] < values[0] - 0.1 * abs(values[0]), values


def test_twenty_grpo_steps_lower_the_objective_and_raise_acceptance():
    G, greedy = 16, TARGET.argmax(-1)  # windows: the 8 positions of each of 4 rows

    def rollout(model):
        logp = torch.log_softmax(model(H), -1)
        ids = torch.multinomial(logp.exp().reshape(-1, 10), G, True).reshape(4, 8, G)
        return ids.permute(0, 2, 1), logp

    def tokens_logp(logp, ids):
        return logp.unsqueeze(1).expand(-1, G, -1, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 10)
    ids, logp0 = rollout(model)
    old = tokens_logp(logp0, ids).detach()
    adv = group_advantages(simulate_greedy(ids, greedy))
    values, _ = _fit(lambda m: grpo_objective(tokens_logp(torch.log_softmax(m(H), -1), ids),
                                              old, old, adv))
    assert values[-1] < values[0] - 0.03, values

    torch.manual_seed(0)
    reference = torch.nn.Linear(16, 10).requires_grad_(False)  # _fit's initial drafter, frozen

    def on_policy(m):
        ids, logp = rollout(m)
        lp = tokens_logp(logp, ids)
        ref = tokens_logp(torch.log_softmax(reference(H), -1), ids)
        return grpo_objective(lp, lp.detach(), ref, group_advantages(simulate_greedy(ids, greedy)))

    start = expected_length(greedy_acceptance(reference(H), greedy), 8).mean()
    _, trained = _fit(on_policy, lr=0.1)
    after = expected_length(greedy_acceptance(trained(H), greedy), 8).mean()
    assert after > start + 0.1, (start, after)


BAD = [
    (lambda: eal_loss(torch.randn(1, 4, 5), torch.zeros(1, 4, dtype=torch.long), 0), "gamma"),
    (lambda: expected_length(torch.rand(1, 4), 5), "gamma=5 is larger"),
    (lambda: wtv_loss(torch.randn(1, 4, 5), torch.randn(1, 4, 5), 2, temperature=0), "temperature"),
    (lambda: kl_loss(torch.randn(1, 4, 5), torch.randn(1, 4, 5), -1.0), "temperature"),
    (lambda: greedy_acceptance(torch.randn(1, 4, 5), torch.full((1, 4), 5)), r"\[-1, C=5\)"),
    (lambda: greedy_acceptance(torch.randn(1, 4, 5), torch.full((1, 4), -2)), "target_index"),
    (lambda: greedy_acceptance(torch.randn(1, 4, 5), torch.zeros(1, 3, dtype=torch.long)),
     "target_index must be"),
    (lambda: greedy_acceptance(torch.randn(1, 4, 5), torch.zeros(1, 4)), "int tensor"),
    (lambda: greedy_acceptance(torch.randn(1, 4, 0), torch.zeros(1, 4, dtype=torch.long)),
     "empty column set"),
    (lambda: sampling_acceptance(torch.randn(1, 4, 0), torch.randn(1, 4, 0)), "empty column set"),
    (lambda: sampling_acceptance(torch.randn(1, 4, 5), torch.randn(1, 4, 6)), "column counts"),
    (lambda: kl_loss(torch.randn(1, 4, 5), torch.randn(2, 4, 5)), "same"),
    (lambda: sampling_acceptance(torch.randn(1, 4, 5), torch.randn(1, 4, 5),
                                 target_lse=torch.zeros(4)), "target_lse"),
    (lambda: sampling_acceptance(torch.randn(1, 4, 5), torch.randn(1, 4, 5) + 9,
                                 target_lse=torch.zeros(1, 4)), "FULL|full target logits"),
    (lambda: eal_loss(torch.randn(1, 4, 5), torch.zeros(1, 4, dtype=torch.long), 2,
                      torch.ones(1, 3, dtype=torch.bool)), "mask"),
    (lambda: expected_length(torch.rand(1, 4), 2, torch.ones(1, 4)), "mask must be a bool"),
    (lambda: grpo_objective(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4), torch.zeros(2, 3, 5),
                            torch.zeros(2, 3)), "logp_ref"),
    (lambda: grpo_objective(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4), torch.zeros(2, 3, 4),
                            torch.zeros(2, 4)), "advantages"),
    (lambda: grpo_objective(*[torch.zeros(2, 3, 4)] * 3, torch.zeros(2, 3), clip=0), "clip"),
    (lambda: group_advantages(torch.zeros(4)), "rewards"),
    (lambda: simulate_greedy(torch.zeros(2, 3, 4, dtype=torch.long),
                             torch.zeros(2, 5, dtype=torch.long)), "target_ids"),
    (lambda: simulate_sampling(torch.full((1, 2, 3), 4), torch.rand(1, 2, 3, 4),
                               torch.rand(1, 3, 4)), r"draft_ids must be columns"),
    (lambda: simulate_sampling(torch.zeros(1, 2, 3, dtype=torch.long), torch.rand(1, 2, 3, 4),
                               torch.rand(1, 3, 5)), "target_probs"),
]


@pytest.mark.parametrize("call,match", BAD)
def test_bad_input_raises_a_clear_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()
