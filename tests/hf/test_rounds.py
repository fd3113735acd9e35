"""The fused loop's rounds on the device: Hugging Face's warpers computed from a tensor of values,
and a round that reads the host once (plus one read per near-tie recheck), counted after warm-up
with :class:`trimpass.testing.nosync.host_reads` (``tolist`` and ``numpy`` included), greedy and
sampled, self-draft and lookup rounds."""
import pytest
import torch
from transformers import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import trimpass
from tests.graph.test_hf import V
from tests.hf.test_selfdraft import MODELS
from trimpass.hf.rounds import warped
from trimpass.hf.sampler import Sampler
from trimpass.spec.verify import race, residual
from trimpass.testing.nosync import host_reads

FAST = dict(inner="aot_eager", learn_core=64)


@pytest.mark.parametrize("t,k,p", [(0.7, None, None), (1.0, 7, None), (1.3, None, 0.8),
                                   (0.6, 40, 0.9), (1.0, 1, 0.5)])
def test_warped_is_hugging_faces_warpers_with_the_values_in_a_tensor(t, k, p):
    z = torch.randn(5, 333) * 3
    z[0, :3] = 10.0  # ties at the top
    hf = [TemperatureLogitsWarper(t)] if t != 1.0 else []
    hf += [TopKLogitsWarper(k)] if k is not None else []
    hf += [TopPLogitsWarper(p)] if p is not None else []
    want = LogitsProcessorList(hf)(None, z.clone())
    s = Sampler(t, k, p)
    got = warped(z, s.values(333), s.top_k, s.top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got, want)


def test_race_draws_each_id_as_often_as_its_probability():
    torch.manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    draws = race(p.expand(20000, 4).clone())
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    assert freq[3] == 0 and torch.allclose(freq, p, atol=0.015)


def test_residual_is_p_minus_q_or_p_where_q_covers_it():
    p, q = torch.tensor([[0.5, 0.3, 0.2]]), torch.tensor([[0.2, 0.5, 0.3]])
    assert torch.allclose(residual(p, q), torch.tensor([[0.3, 0.0, 0.0]]))
    assert torch.equal(residual(p, p), p)


def _reads(model, ids, **kw):
    """(the reads of one call after warm-up, its rounds, its near-tie rechecks)."""
    trimpass.generate(model, ids, 8, **FAST, **kw)  # warm-up and the sampled graphs
    before = trimpass.stats(model)
    with host_reads() as r:
        trimpass.generate(model, ids, 40, **FAST, **kw)
    after = trimpass.stats(model)
    return r, after["rounds"] - before["rounds"], after["rechecks"] - before["rechecks"]


@pytest.mark.parametrize("name", ["gemma3", "llama"])
@pytest.mark.parametrize("prompt", ["random", "repeating"])
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_a_round_reads_the_host_once_plus_its_near_tie_rechecks(name, prompt, sample):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    ids = torch.randint(0, V, (1, 11))
    if prompt == "repeating":
        ids = ids.repeat(1, 4)
    kw = dict(do_sample=True, temperature=0.8) if sample else {}
    r, rounds, rechecks = _reads(model, ids, **kw)
    assert rounds >= 5
    # per call, besides its rounds: the prompt's ids to the host and the prefill's first token
    assert r.count <= rounds + rechecks + 2, (rounds, rechecks, r.log)
    st = trimpass.stats(model)["sources"]
    assert st["self"]["rounds"] > 0 and (sample or prompt == "random" or st["lookup"]["rounds"])


@torch.no_grad()
def test_the_walk_graphs_sampled_tokens_are_the_targets_distribution_and_its_cache_follows():
    """Rounds.walk (the loop's tree verification, run eagerly): over a root with two children and
    a grandchild, the first emitted token is distributed as the root row's warped softmax, and
    the kept path's keys and values are moved to the positions after the pending token's."""
    from trimpass.hf.rounds import Rounds
    torch.manual_seed(3)
    model = MODELS["llama"]().eval()
    rounds = Rounds(model)
    d, R, trials = model.config.hidden_size, 5, 4000
    H = torch.randn(R, d) * 6  # peaked: the children hold much of the root's mass
    p = torch.softmax(warped(rounds.logits(H), torch.tensor([0.7, V, 1.0]), False, False), -1)
    top = p[0].topk(2).indices.tolist()  # the root's two likeliest tokens are its children
    ids = torch.tensor([1, top[0], top[1], int(p[1].argmax()), 0])  # row 4: padding
    parent = torch.tensor([0, 0, 0, 1, 0])
    anc = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0],
                        [0, 0, 0, 0, 1]])
    depth = torch.tensor([0, 1, 1, 2, 0])
    first, kept_two = torch.zeros(3), 0  # the two children, any other token
    for _ in range(trials):
        keys = torch.arange(8.0).view(1, 1, 8, 1).repeat(1, 1, 1, 2)
        tok, pos = torch.zeros(1, 1, dtype=torch.long), torch.tensor(2)
        out = rounds.walk(H, ids, parent, anc, depth, torch.tensor([3]), [keys], tok, pos,
                          torch.tensor([0.7, V, 1.0]), True, False, False).tolist()
        n, path = out[0], out[2:2 + R]
        emitted = [int(ids[r]) for r in path[1:n + 1]] + [out[2 + 2 * R + out[1]]]
        first[top.index(emitted[0]) if emitted[0] in top else 2] += 1
        assert int(pos) == 2 + n + 1 and int(tok) == emitted[-1]
        assert keys[0, 0, 2:3 + n, 0].tolist() == [2.0 + r for r in path[:n + 1]]
        kept_two += n == 2
    want = torch.cat([p[0, top], 1 - p[0, top].sum(0, keepdim=True)])
    assert 0.5 * float((first / trials - want).abs().sum()) < 0.03, (first / trials, want)
    assert kept_two > 0  # the grandchild's path was kept, its cache rows moved
