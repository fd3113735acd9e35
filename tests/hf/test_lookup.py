"""Lookup drafts in the fused loop: the proposer finds the longest recurring suffix and what
followed its latest occurrence; greedy output stays the plain loop's and Hugging Face's with lookup
drafts accepted and the trimmed head drafting in the very same call; ``lookup=False`` and
``TRIMPASS_DISABLE=1`` switch off what they name; sampling with point-mass lookup drafts passes the
chi-square test against the model's exact distribution; a bad lookup setting is refused."""
import pytest
import torch

import trimpass
from tests.graph.test_hf import V
from tests.hf.test_fused import FAST, MODELS, _decode, _exact_marginals, peaked_llama
from trimpass.hf.lookup import PROBE, PROBE_MAX, Chooser


def test_the_choice_follows_tokens_per_ms():
    c = Chooser(gamma=8, match_cap=4)
    c.time("step_ms", 10.0)
    c.time("verify_ms", 12.0)
    assert not c.use_lookup(0) and not c.prefers_lookup(0)  # nothing recurs: nothing to verify
    for _ in range(20):  # self-drafts emit 6 tokens in 6 steps (0.1 tokens/ms)
        c.self_tokens.add(0, 6)
        c.self_steps.add(0, 6)
    for _ in range(20):  # one-token matches keep nothing: 1 token in 12 ms
        c.lookup.add(1, 1)
    assert not c.prefers_lookup(1)
    for _ in range(20):  # four-token matches keep 5: 6 tokens in 12 ms
        c.lookup.add(4, 6)
    assert c.prefers_lookup(4) and c.prefers_lookup(7)


def test_lookup_is_probed_at_a_requests_first_match_then_less_often_while_it_keeps_losing():
    c = Chooser(gamma=8, match_cap=4)
    c.time("step_ms", 10.0)
    c.time("verify_ms", 60.0)  # a cost that once ran high: lookup is never preferred
    assert not c.prefers_lookup(4)
    assert not c.use_lookup(0)  # no match: no probe
    assert c.use_lookup(2)  # the request's first match
    waits = [PROBE, 2 * PROBE, 4 * PROBE] + [PROBE_MAX] * 3  # probes in a row back off
    assert 4 * PROBE < PROBE_MAX
    picks = [c.use_lookup(2) for _ in range(sum(waits) + len(waits) + 3)]
    assert picks == sum(([False] * w + [True] for w in waits), []) + [False] * 3
    c.new_request()
    assert c.use_lookup(1)
    for _ in range(20):  # lookup now pays: chosen on its record, the wait starts again
        c.lookup.add(4, 12)
    assert c.use_lookup(4) and c.use_lookup(4)
    for _ in range(20):  # one-token matches kept nothing
        c.lookup.add(1, 1)
    picks = [c.use_lookup(1) for _ in range(PROBE + 1)]
    assert picks == [False] * PROBE + [True]


def test_a_match_length_not_yet_seen_starts_from_what_lookup_did_at_the_others():
    c = Chooser(gamma=8, match_cap=4)
    c.time("step_ms", 10.0)
    c.time("verify_ms", 25.0)
    for _ in range(3):  # self-drafts keep 8 of 8: 0.1 tokens / ms, prior or not
        c.self_tokens.add(0, 8)
        c.self_steps.add(0, 8)
    assert not c.prefers_lookup(4)  # the prior alone: 2 tokens in 25 ms
    c.lookup.add(2, 16)  # a two-token match kept a whole proposal of 15
    # a four-token match, never seen: (0 + (16 + 2) / 2) / 1 = 9 tokens in 25 ms
    assert c.prefers_lookup(4)


def test_a_passed_over_proposal_is_recorded_from_the_tokens_its_round_emitted():
    c = Chooser(gamma=8, match_cap=4)
    c.unchosen(3, [5, 6, 7, 9], [5, 6, 7, 8, 2])  # parts at the fourth: 3 kept, 1 emitted
    c.unchosen(4, [5, 6], [5, 6, 7])  # all of it kept, and the head's own token after it
    c.unchosen(7, [5, 6, 7, 8], [5, 6])  # agrees as far as the round went: at least 3
    c.unchosen(1, [4], [5, 6])  # the first token differs: the head's own alone
    assert c.lookup.tokens == {3: 4, 4: 3 + 3, 1: 1}
    assert c.lookup.rounds == {3: 1, 4: 2, 1: 1}
    # a lookup round that kept nothing, then self-drafts keeping 8 of 8 while the proposal agrees
    c = Chooser(gamma=8, match_cap=4)
    c.time("step_ms", 10.0)
    c.time("verify_ms", 25.0)
    c.lookup.add(4, 1)
    for _ in range(3):
        c.self_tokens.add(0, 8)
        c.self_steps.add(0, 8)
    assert not c.prefers_lookup(4)  # (1 + 1.5) / 2 = 1.25 tokens in 25 ms against 0.1 / ms
    c.unchosen(4, list(range(15)), list(range(8)))
    assert c.prefers_lookup(4)  # (1 + 9 + 4) / 3 = 4.7 tokens in 25 ms


@pytest.mark.parametrize("name", ["gemma3", "llama"])
def test_greedy_with_lookup_is_the_plain_output_with_both_sources_in_the_call(name):
    torch._dynamo.reset()
    torch.manual_seed(3)
    model = MODELS[name]().eval()
    ids = torch.randint(0, V, (1, 12)).repeat(1, 3)  # a prompt that repeats itself
    trimpass.generate(model, ids, 48, gamma=4, learn_core=64, **FAST)
    before = trimpass.stats(model)
    got = trimpass.generate(model, ids, 48, gamma=4, learn_core=64, **FAST)
    st = trimpass.stats(model)
    look = st["sources"]["lookup"]["accepted"] - before["sources"]["lookup"]["accepted"]
    own = st["sources"]["self"]["rounds"] - before["sources"]["self"]["rounds"]
    assert look > 0, "no lookup draft was kept in this call"
    assert st["trimmed_calls"] > before["trimmed_calls"] and own >= 0
    assert st["batched_passes"] > before["batched_passes"]
    plain = trimpass.generate(model, ids, 48, speculate=False, **FAST)
    assert torch.equal(got, plain) and torch.equal(got, _decode(model, ids, 48))


def test_the_loop_records_each_proposal_a_self_draft_round_passed_over(monkeypatch):
    torch._dynamo.reset()
    torch.manual_seed(3)
    model = MODELS["llama"]().eval()
    ids = torch.randint(0, V, (1, 10)).repeat(1, 3)  # every round has a proposal
    monkeypatch.setattr(Chooser, "use_lookup", lambda self, match: False)
    got = trimpass.generate(model, ids, 30, gamma=4, learn_core=64, **FAST)
    st, record = trimpass.stats(model), model._trimpass_fused.chooser.lookup
    assert st["sources"]["lookup"]["rounds"] == 0 and st["sources"]["self"]["rounds"] > 0
    # every round but those with no proposal (nothing recurs yet; a budget of one token)
    assert 0 < sum(record.rounds.values()) <= st["sources"]["self"]["rounds"]
    assert sum(record.tokens.values()) >= sum(record.rounds.values())
    assert torch.equal(got, _decode(model, ids, 30))


def test_lookup_false_and_disable_switch_off_what_they_name(monkeypatch):
    torch._dynamo.reset()
    torch.manual_seed(3)
    model = MODELS["llama"]().eval()
    ids = torch.randint(0, V, (1, 10)).repeat(1, 3)
    want = _decode(model, ids, 30)
    got = trimpass.generate(model, ids, 30, lookup=False, gamma=4, learn_core=64, **FAST)
    st = trimpass.stats(model)
    assert st["sources"]["lookup"]["rounds"] == 0 and st["batched_passes"] == 0
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
