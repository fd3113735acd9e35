"""Lookup drafts in the fused loop: the proposer finds the longest recurring suffix and what
followed its latest occurrence; greedy output stays the plain loop's and Hugging Face's with lookup
drafts accepted and the trimmed head drafting in the very same call; ``lookup=False`` and
``TRIMPASS_DISABLE=1`` switch off what they name (``lookup=False`` leaves the suffix index on);
sampling with point-mass lookup drafts passes the chi-square test against the model's exact
distribution; a bad lookup setting is refused."""
import pytest
import torch

import trimpass
from tests.graph.test_hf import V
from tests.hf.test_fused import FAST, MODELS, _decode, _exact_marginals, peaked_llama
from trimpass.spec.control.controller import Controller, Plan


@pytest.mark.parametrize("name", ["gemma3", "llama"])
def test_greedy_with_lookup_is_the_plain_output_with_both_sources_in_the_call(name):
    torch._dynamo.reset()
    torch.manual_seed(3)
    model = MODELS[name]().eval()
    ids = torch.randint(0, V, (1, 12)).repeat(1, 3)  # a prompt that repeats itself
    lookup_alone = dict(gamma=4, learn_core=64, suffix=False)  # no suffix index to outbid it
    trimpass.generate(model, ids, 48, **lookup_alone, **FAST)
    before = trimpass.stats(model)
    got = trimpass.generate(model, ids, 48, **lookup_alone, **FAST)
    st = trimpass.stats(model)
    look = st["sources"]["lookup"]["accepted"] - before["sources"]["lookup"]["accepted"]
    own = st["sources"]["self"]["rounds"] - before["sources"]["self"]["rounds"]
    assert look > 0, "no lookup draft was kept in this call"
    assert st["trimmed_calls"] > before["trimmed_calls"] and own >= 0
    assert st["batched_passes"] > before["batched_passes"]
    plain = trimpass.generate(model, ids, 48, speculate=False, **FAST)
    assert torch.equal(got, plain) and torch.equal(got, _decode(model, ids, 48))


def test_the_loop_prices_each_proposal_a_self_draft_round_passed_over(monkeypatch):
    torch._dynamo.reset()
    torch.manual_seed(3)
    model = MODELS["llama"]().eval()
    ids = torch.randint(0, V, (1, 10)).repeat(1, 3)  # every round has a proposal
    monkeypatch.setattr(Controller, "plan", lambda self, batch, gamma, *a, **k: Plan(gamma))
    got = trimpass.generate(model, ids, 30, gamma=4, learn_core=64, **FAST)
    st, record = trimpass.stats(model), model._trimpass_fused.controller.prices["lookup"]
    assert st["sources"]["lookup"]["rounds"] == 0 and st["sources"]["self"]["rounds"] > 0
    # every round but those with no proposal (nothing recurs yet; a budget of one token)
    assert 0 < record.reached[:, 0].sum() <= st["sources"]["self"]["rounds"]
    assert record.kept.sum() > 0  # the text repeats: the passed-over drafts would have kept some
    assert torch.equal(got, _decode(model, ids, 30))


def test_lookup_false_and_disable_switch_off_what_they_name(monkeypatch):
    torch._dynamo.reset()
    torch.manual_seed(3)
    model = MODELS["llama"]().eval()
    ids = torch.randint(0, V, (1, 10)).repeat(1, 3)
    want = _decode(model, ids, 30)
    got = trimpass.generate(model, ids, 30, lookup=False, gamma=4, learn_core=64, **FAST)
    st = trimpass.stats(model)
    assert st["sources"]["lookup"]["rounds"] == 0  # the suffix index alone verifies in batches
    assert st["batched_passes"] == st["sources"]["suffix"]["rounds"]
    assert st["rounds"] > 0
    assert torch.equal(got, want)
    monkeypatch.setenv("TRIMPASS_DISABLE", "1")
    torch._dynamo.reset()
    other = MODELS["llama"]().eval()
    other.load_state_dict(model.state_dict())
    assert torch.equal(trimpass.generate(other, ids, 30, **FAST), want)
    st = trimpass.stats(other)
    assert (st["rounds"], st["batched_passes"], st["trimmed_calls"]) == (0, 0, 0)


@pytest.mark.parametrize("bad", [0, 16, -1, 2.5, "yes"])
def test_a_bad_lookup_setting_is_refused_before_any_compute(bad):
    model = MODELS["llama"]().eval()
    with pytest.raises(ValueError, match=r"lookup: True .* an int in \[1, 15\]"):
        trimpass.generate(model, torch.randint(0, V, (1, 5)), 4, lookup=bad, **FAST)
    assert not hasattr(model, "_trimpass_fused")


def test_sampling_with_lookup_drafts_emits_the_models_own_distribution():
    from transformers import LogitsProcessorList, TemperatureLogitsWarper

    from trimpass.testing.stats import chi_square_p
    Vs, n, steps = 16, 1500, 3
    model = peaked_llama(Vs)
    ids = torch.randperm(Vs).unsqueeze(0)  # every id once: each new token recurs, so lookup
    warp = LogitsProcessorList([TemperatureLogitsWarper(0.8)])
    want = _exact_marginals(model, ids, steps, warp)
    active = torch.arange(0, Vs, 2)  # proposes from the first round; the trimmed head, even ids
    got = torch.stack([trimpass.generate(model, ids, steps, do_sample=True, temperature=0.8,
                                         vocab=active, gamma=3, confidence=0.0, **FAST)[0, Vs:]
                       for _ in range(n)])
    look = trimpass.stats(model)["sources"]["lookup"]
    assert 0 < look["accepted"] < look["drafted"]  # lookup drafts kept and rejected
    for j in range(steps):
        assert chi_square_p(torch.bincount(got[:, j], minlength=Vs), want[j]) > 1e-3, f"token {j}"
