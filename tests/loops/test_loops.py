"""Every loop stays lossless with a trimmed drafter: greedy chain and tree equal the target's greedy
output; rejection sampling keeps the target's distribution (chi-square), and a wrong acceptance
rule is caught by the same test. Each test also proves the trimmed head ran on every drafter call
(greedy verification is lossless whatever the drafter computes), so with ``TRIMPASS_DISABLE=1``
every one of them fails."""
import copy

import pytest
import torch

import trimpass
from trimpass.loops import chain, tree
from trimpass.testing.checks import head_runs
from trimpass.testing.models import EagleDrafter, Transformer

V = 256


def _target(seed=0):
    torch.manual_seed(seed)
    return Transformer(V, d=64, layers=2).double().eval()


def _greedy(target, ids, n):
    for _ in range(n):
        ids = torch.cat([ids, chain.logits_of(target, ids)[:, -1].argmax(-1, keepdim=True)], 1)
    return ids


@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_chain_greedy_is_lossless_with_a_trimmed_drafter(mode):
    torch._dynamo.reset()
    target = _target()
    ids = torch.randint(0, V, (1, 10))
    ref = _greedy(target, ids, 24)
    kw = dict(vocab=torch.unique(torch.cat([ref[0], torch.arange(0, V, 5)]))[3:]) \
        if mode == "static" else dict(refresh_every=4)
    draft = trimpass.trim(copy.deepcopy(target), inner="aot_eager", **kw)
    with head_runs(draft) as runs:
        out, st = chain.generate(target, draft, ids, 24, gamma=4)
    assert torch.equal(out, ref)
    runs.check()
    assert runs.calls == st.draft_calls == st.drafted
    assert st.mat > 1.5, "the trimmed copy of the target should have most drafts accepted"


class EagleOnTokens(torch.nn.Module):
    """The EAGLE drafter fed a fixed stand-in hidden state."""

    def __init__(self, eagle):
        super().__init__()
        self.eagle = eagle

    def forward(self, ids):
        return self.eagle(ids, torch.zeros(*ids.shape, 64, dtype=torch.float64))[0]


@pytest.mark.parametrize("drafter", ["eagle", "target-copy"])
def test_tree_greedy_is_lossless_with_a_trimmed_drafter(drafter):
    torch._dynamo.reset()
    target = _target(1)
    ids = torch.randint(0, V, (1, 6))
    ref = _greedy(target, ids, 12)
    if drafter == "eagle":  # a random EAGLE drafter: its drafts are mostly rejected
        torch.manual_seed(2)
        eagle = EagleDrafter(V, d=64).double().eval()
        draft = trimpass.trim(EagleOnTokens(eagle).eval(), vocab=torch.arange(0, V, 2),
                              inner="aot_eager")
    else:  # the target trimmed to a vocabulary holding its output: drafts mostly accepted
        vocab = torch.unique(torch.cat([ref[0], torch.arange(0, V, 5)]))
        draft = trimpass.trim(copy.deepcopy(target), vocab=vocab, inner="aot_eager")
    depth, budget = 3, 6
    with head_runs(draft) as runs:
        out, st = tree.generate(target, draft, ids, 12, depth=depth, topk=2, budget=budget)
    assert torch.equal(out, ref)
    runs.check()
    assert runs.calls == st.draft_calls and 0 < st.draft_calls <= depth * st.rounds
    assert sum(st.per_round) == st.emitted == 12 and len(st.per_round) == st.rounds
    assert all(1 <= n <= depth + 1 for n in st.per_round)
    assert st.accepted == st.emitted - st.rounds and 0 < st.drafted <= budget * st.rounds
    if drafter == "target-copy":  # the walk must follow accepted tree children, not only roots
        assert st.rounds < 12 and st.mat > 1.5, f"tree walk accepted too little: {st.per_round}"


class TableLM(torch.nn.Module):
    """Next-token logits ``table[last token]``: a one-hot embedding and a [V, V] head. Fast,
    exact, small V."""

    def __init__(self, table):
        super().__init__()
        n = table.shape[0]
        self.onehot = torch.nn.Embedding.from_pretrained(torch.eye(n, dtype=table.dtype))
        self.head = torch.nn.Parameter(table.T.contiguous(), requires_grad=False)

    def forward(self, ids):
        return torch.nn.functional.linear(self.onehot(ids), self.head)


def _chi2(samples, p):
    n = len(samples)
    obs = torch.bincount(torch.tensor(samples), minlength=p.numel()).double()
    exp = n * p
    keep = exp > 0
    assert obs[~keep].sum() == 0, "a token the target gives probability 0 was emitted"
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


def _first_tokens(accept, n=3000):
    Vs = 12
    g = torch.Generator().manual_seed(0)
    tgt = TableLM(torch.randn(Vs, Vs, generator=g, dtype=torch.float64) * 1.5)
    drf = TableLM(torch.randn(Vs, Vs, generator=g, dtype=torch.float64) * 1.5)
    draft = trimpass.trim(drf, vocab=[0, 1, 2, 3, 5, 8, 11], inner="eager")
    with torch.no_grad():
        q = draft(torch.tensor([[4]]))[0, -1]
    assert torch.isneginf(q).sum() == Vs - 7, "the drafter was not trimmed"
    gen = torch.Generator().manual_seed(1)
    prompt = torch.tensor([[4]])
    with head_runs(draft) as runs:
        samples = [int(chain.generate(tgt, draft, prompt, 2, gamma=1, temperature=0.8,
                                      generator=gen, accept=accept)[0][0, 1]) for _ in range(n)]
    runs.check()
    assert runs.calls == n, "one draft per sample"
    p = torch.softmax(tgt(prompt)[0, -1] / 0.8, -1)
    return samples, p


CHI2_CRIT = {11: 31.26, 10: 29.59, 9: 27.88}  # p = 0.001


def test_rejection_sampling_keeps_the_target_distribution():
    torch._dynamo.reset()
    samples, p = _first_tokens(chain.exact_accept)
    stat, df = _chi2(samples, p)
    assert stat < CHI2_CRIT[df], f"chi-square {stat:.1f} over {CHI2_CRIT[df]} (df={df})"


def test_negative_control_wrong_acceptance_rule_is_detected():
    torch._dynamo.reset()
    samples, p = _first_tokens(lambda p_t, q, x, u: True)  # accept every draft: emits q, not p
    stat, df = _chi2(samples, p) if all(p[s] > 0 for s in samples) else (float("inf"), 11)
    assert stat > CHI2_CRIT.get(df, 31.26)
