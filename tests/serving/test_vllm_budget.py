"""The budget's policy runner (trimpass.budget.runner) driven through the compatibility module's
own wrappers of vLLM's ``propose`` and ``_sample_draft_tokens``, installed on a stand-in for vLLM's
proposer (no vLLM needed): where drafting stops, what the cut returns, the confidences it reads,
what it learns from acceptance."""
import math
from types import SimpleNamespace

import pytest
import torch

from trimpass.budget import CostTable
from trimpass.budget.runner import TIMED_MIN, PolicyRunner
from trimpass.budget.timings import WINDOW
from trimpass.serving import vllm_compat as compat
from trimpass.serving import vllm_state

GAMMA, B, V = 4, 3, 11


HOOKS = vllm_state.Hooks(startup=None)
WRAP = compat._wrappers(HOOKS)


def _patched(name):
    return next(p for p in compat.PATCHES if p.endswith("SpecDecodeBaseProposer." + name))


class Proposer:
    """vLLM's drafting loop in miniature: ``propose`` samples one token per step through
    ``_sample_draft_tokens``; the "hidden states" of step k are ``steps[k]``, taken as logits.
    Its ``propose`` and ``_sample_draft_tokens`` carry the compatibility module's wrappers."""

    use_local_argmax_reduction = use_heterogeneous_vocab = parallel_drafting = False

    def __init__(self, steps, probabilistic=False):
        self.steps, self.forwards = steps, 0
        self._enable_probabilistic_draft_probs = probabilistic
        self._last_draft_probs = None
        self.num_speculative_tokens = GAMMA
        self.model = SimpleNamespace(compute_logits=lambda h: h)
        self.vllm_config = SimpleNamespace(
            scheduler_config=SimpleNamespace(async_scheduling=False, max_num_seqs=8),
            model_config=SimpleNamespace(model="stand-in", dtype="float32"))

    def _sample_from_logits(self, logits, md):
        probs = torch.softmax(logits, dim=-1)
        return probs.argmin(dim=-1), probs  # "sampled": a token the argmax would not pick

    def _sample_draft_tokens(self, h, md):
        if self._enable_probabilistic_draft_probs and not md.all_greedy:
            return self._sample_from_logits(h, md)
        return h.argmax(dim=-1), None

    def propose(self, num_speculative_tokens, sampling_metadata=None, next_token_ids=None,
                target_token_ids=None):
        self.asked = num_speculative_tokens
        if num_speculative_tokens == 0:  # vLLM's K = 0 path: the first forward only
            self.forwards += 1
            return torch.empty(B, 0, dtype=torch.int64)
        ids, probs = [], []
        for k in range(num_speculative_tokens):
            self.forwards += 1
            t, p = self._sample_draft_tokens(self.steps[k], sampling_metadata)
            ids.append(t)
            probs.append(p)
        if probs[0] is not None:
            self._last_draft_probs = torch.stack(probs, dim=1)
        return torch.stack(ids, dim=1)


Proposer.propose = WRAP[_patched("propose")](Proposer.propose)
Proposer._sample_draft_tokens = WRAP[_patched("_sample_draft_tokens")](
    Proposer._sample_draft_tokens)


def _steps(seed=0, sharp=4.0):
    g = torch.Generator().manual_seed(seed)
    return [sharp * torch.randn(B, V, generator=g) for _ in range(GAMMA)]


def _table(per_token: float) -> dict:
    return CostTable([1, 8], [0, 64], [[1.0, 1.0 + 64 * per_token],
                                       [1.0, 1.0 + 64 * per_token]]).to_dict()


GREEDY = SimpleNamespace(all_greedy=True)


def _budget(proposer, shares_cache=False, **settings):
    b = PolicyRunner(settings, GAMMA, shares_cache=shares_cache)
    vllm_state._drafters[proposer] = vllm_state.DrafterState(None, b, shares_cache,
                                                             plain=lambda h: h)
    return b


def _drafter(proposer, asynchronous=False):
    """What the compatibility module takes out of a loaded drafter, for Hooks.loaded."""
    head = compat.Head(None, 0, 1, 0.0, 1.0, V, None, lambda h: h, None, None)
    return compat.Drafter(model=proposer.model, target=object(), checkpoint=None,
                          additional={"trim": False, "budget": {"policy": "fixed",
                                                                "gamma": GAMMA + 1}},
                          max_num_seqs=8, async_scheduling=asynchronous, gamma=GAMMA,
                          model_key="stand-in", target_vocab=V, rank=0, head=head, d2t=None,
                          refused=None, first_pass_ok=True)


def test_fixed_gamma_stops_drafting_before_the_next_forward():
    p = Proposer(_steps())
    b = _budget(p, policy="fixed", gamma=2, table=_table(0.0))
    draft = p.propose(num_speculative_tokens=GAMMA, sampling_metadata=GREEDY)
    assert p.forwards == 2 and draft.shape == (B, 2)
    want = torch.stack([s.argmax(dim=-1) for s in p.steps[:2]], dim=1)
    assert b.cut(draft, ["a", "b", "c"]) == want.tolist()


def test_greedy_confidence_is_the_softmax_maximum():
    p = Proposer(_steps(1))
    b = _budget(p, policy="off", table=_table(0.0))
    p.propose(num_speculative_tokens=GAMMA, sampling_metadata=GREEDY)
    want = torch.stack([torch.softmax(s, dim=-1).max(dim=-1).values for s in p.steps], dim=1)
    torch.testing.assert_close(torch.stack(b.conf, dim=1), want)


@pytest.mark.parametrize("per_token,kept", [(10.0, 0), (0.0, B * GAMMA)])
def test_dcut_stops_drafting_and_cuts_to_nothing_when_tokens_cost_too_much(per_token, kept):
    p = Proposer(_steps(2, sharp=8.0))
    b = _budget(p, policy="dcut", table=_table(per_token))
    first = b.cut(p.propose(num_speculative_tokens=GAMMA, sampling_metadata=GREEDY))
    assert p.forwards == GAMMA  # the first proposal drafts to gamma_max: it times a step
    p.forwards = 0
    lists = b.cut(p.propose(num_speculative_tokens=GAMMA, sampling_metadata=GREEDY))
    assert sum(len(x) for x in first) == sum(len(x) for x in lists) == kept
    assert p.forwards == (1 if kept == 0 else GAMMA)
    assert b.counts["stopped_early"] == (1 if kept == 0 else 0)


def test_probabilistic_drafts_keep_their_probabilities_when_drafting_stops():
    p = Proposer(_steps(3), probabilistic=True)
    b = _budget(p, policy="fixed", gamma=3, table=_table(0.0))
    md = SimpleNamespace(all_greedy=False)
    draft = p.propose(num_speculative_tokens=GAMMA, sampling_metadata=md)
    probs = torch.stack([torch.softmax(s, dim=-1) for s in p.steps[:3]], dim=1)
    assert draft.shape == (B, 3) and p._last_draft_probs.shape == (B, 3, V)
    torch.testing.assert_close(p._last_draft_probs, probs)
    want = probs.gather(-1, draft[..., None])[..., 0]  # the sampled token's probability
    torch.testing.assert_close(torch.stack(b.conf, dim=1), want)


def test_acceptance_is_read_back_from_the_next_steps_sampled_tokens():
    p = Proposer(_steps(4))
    b = _budget(p, policy="off", table=_table(0.0))
    b.cut(p.propose(num_speculative_tokens=GAMMA, sampling_metadata=GREEDY), ["a", "b", "c"])
    scores = torch.cumprod(torch.stack(b.conf, dim=1).double(), dim=1)
    sampled = torch.full((B, GAMMA + 1), -1)
    sampled[0, :3] = 5  # a: 2 drafts accepted + the bonus/correction token
    sampled[2, :1] = 5  # c: none accepted
    b.accepted(["c", "b", "a"], compat.emitted(sampled[[2, 1, 0]]))  # the batch's order changed
    got = list(b.calibration.pairs)
    want = [(float(s), 0.0) for s in scores[2]]
    want += [(float(s), float(k < 2)) for k, s in enumerate(scores[0])]
    assert got == want  # b emitted nothing this step (e.g. preempted): no evidence
    assert b.counts["accepted"] == 2 and not b._sent


def test_a_budget_refuses_async_scheduling_and_bad_settings():
    p = Proposer(_steps())
    with pytest.raises(RuntimeError, match="async_scheduling=False"):
        HOOKS.loaded(p, _drafter(p, asynchronous=True))
    with pytest.raises(ValueError, match="budget gamma"):
        HOOKS.loaded(p, _drafter(p))
    assert HOOKS.state(p) is None  # nothing registered: vLLM's own methods run


def test_a_cost_table_from_another_deployment_is_refused_at_load():
    import dataclasses
    p = Proposer(_steps())
    table = {**_table(1.0), "model": "/models/other:torch.bfloat16"}
    other = dataclasses.replace(_drafter(p), additional={"trim": False, "budget": {
        "policy": "dcut", "table": table}})
    with pytest.raises(RuntimeError, match="measured for /models/other:torch.bfloat16.*stand-in"):
        HOOKS.loaded(p, other)
    assert HOOKS.state(p) is None
    mine = dataclasses.replace(other, additional={"trim": False, "budget": {
        "policy": "dcut", "table": {**table, "model": "stand-in"}}})
    HOOKS.loaded(p, mine)  # the table stats(llm) gives back names its deployment
    assert HOOKS.worker_stats(HOOKS.state(p))["budget"]["table"]["model"] == "stand-in"


def test_dcut_stops_drafting_where_a_step_costs_more_than_it_can_win():
    p = Proposer(_steps(5, sharp=8.0))
    b = _budget(p, policy="dcut", table=_table(0.0))  # verified tokens are free...
    b.cut(p.propose(num_speculative_tokens=GAMMA, sampling_metadata=GREEDY))
    # ...but a drafting step costs 100 s, against 1 s for a verification
    b.timings.step_s.update({k: 100.0 for k in b.timings.step_s})
    p.forwards = 0
    lists = b.cut(p.propose(num_speculative_tokens=GAMMA, sampling_metadata=GREEDY))
    assert p.forwards == 1 and [len(x) for x in lists] == [1] * B


NEXT = torch.zeros(B, dtype=torch.int64)  # the runner's next tokens: the batch size, for a skip
DECODE = torch.zeros(2 * B, dtype=torch.int64)  # the target's tokens this step: no prefill
STEP = dict(num_speculative_tokens=GAMMA, sampling_metadata=GREEDY, next_token_ids=NEXT,
            target_token_ids=DECODE)


@pytest.mark.parametrize("shares_cache", [True, False])
def test_a_step_where_no_draft_can_pay_skips_the_drafter(shares_cache):
    p = Proposer(_steps(6))
    b = _budget(p, shares_cache, policy="dcut", table=_table(10.0))  # a verified token: 10 s
    ids = ["a", "b", "c"]
    for _ in range(TIMED_MIN):  # drafted until timed (the first may run cold), cut to nothing
        first = b.cut(p.propose(**STEP), ids)
        assert p.forwards >= 1 and sum(map(len, first)) == 0
    p.forwards = 0
    lists = b.cut(p.propose(**STEP), ids)
    assert lists == [[], [], []] and p._last_draft_probs is None
    if shares_cache:  # the target's pass wrote the cache: no drafter forward at all
        assert p.forwards == 0 and b.counts["skipped"] == 1
    else:  # vLLM's own K = 0 path keeps the drafter's cache in step
        assert p.forwards == 1 and p.asked == 0 and b.counts["skipped_first_forward_ran"] == 1
    # a batch of 5 falls in another bucket, not timed yet: its timings are bucket 4's, scaled by
    # the cost model (flat here), so it skips without drafting first
    p.forwards = 0
    five = {**STEP, "next_token_ids": torch.zeros(5, dtype=torch.int64)}
    assert sum(map(len, b.cut(p.propose(**five), ids))) == 0
    assert p.forwards == 0 if shares_cache else p.asked == 0
    assert b.counts["proposals"] == TIMED_MIN and b.timing("first_s", 5) == \
        b.timing("first_s", 3) == b.timings.first_s[4]
    # with no timed bucket at all, a bucket drafts and is timed
    fresh = _budget(Proposer(_steps(6)), shares_cache, policy="dcut", table=_table(10.0))
    assert fresh.timing("first_s", 5) is None


def test_a_prefill_is_not_timed_and_skipping_probes_when_a_probe_is_priced_worth_it():
    p = Proposer(_steps(9))
    b = _budget(p, True, policy="dcut", table=_table(10.0), probe=1.0)
    prefill = {**STEP, "target_token_ids": torch.zeros(B * 50, dtype=torch.int64)}
    b.cut(p.propose(**prefill), ["a", "b", "c"])
    assert b.timings.first_s == {} and b.counts["proposals"] == 1  # prompts: not drafting time
    for _ in range(TIMED_MIN):  # still untimed: drafts, and is timed now
        b.cut(p.propose(**STEP), ["a", "b", "c"])
    assert list(b.timings.first_s) == [4] and b.counts["proposals"] == 1 + TIMED_MIN
    # a probe verifies 12 drafted tokens at 10 s each for at most 4 s saved: it is due once the
    # skipped plain steps (1 s each) add up to its loss (probe=1.0), then at twice that
    loss = b.probes.loss(B, GAMMA, b.cost.step_cost, b.timing("first_s", B),
                         b.timing("step_s", B), 1.0)
    assert 110 < loss < 121
    n = math.ceil(loss)
    for _ in range(3 * n + 2):  # n skips, a probe, about 2n skips, a probe
        b.cut(p.propose(**STEP), ["a", "b", "c"])
    assert b.counts["probes"] == 2 and b.counts["proposals"] == 3 + TIMED_MIN
    assert b.counts["skipped"] == 3 * n and b.stats()["probe_rates"] == {4: 0.25}


def test_free_verification_never_skips_and_paused_speculation_always_does():
    p = Proposer(_steps(7))
    b = _budget(p, True, policy="dcut", table=_table(0.0))
    for _ in range(3):
        b.cut(p.propose(**STEP), ["a", "b", "c"])
    assert b.counts["skipped"] == 0 and b.counts["proposals"] == 3
    b.set({"policy": "none"})
    p.forwards = 0
    assert b.cut(p.propose(**STEP), ["a", "b", "c"]) == [[], [], []]
    assert p.forwards == 0 and b.counts["skipped"] == 1


def test_drafts_sent_after_a_skip_are_counted_as_resumed():
    p = Proposer(_steps(8))
    b = _budget(p, True, policy="fixed", gamma=2, table=_table(0.0))
    b.set({"policy": "none"})
    b.cut(p.propose(**STEP), ["a", "b", "c"])
    b.set({"policy": "fixed", "gamma": 2})
    b.cut(p.propose(**STEP), ["a", "b", "z"])  # z joined after the skip: not a resume
    sampled = torch.full((B, GAMMA + 1), -1)
    sampled[:, :2] = 5  # every request: 1 draft accepted
    b.accepted(["a", "b", "z"], compat.emitted(sampled))
    assert b.counts["resumed_sent"] == 4 and b.counts["resumed_accepted"] == 2
    assert b.counts["accepted"] == 3


def test_the_overhead_is_the_median_gap_between_forwards_less_drafting_by_kind():
    b = _budget(Proposer(_steps(10)), policy="dcut", table=_table(0.0))
    cost = b.cost.step_cost
    assert cost(3, 3) == pytest.approx(1.0)  # nothing measured yet: the forward alone
    clock = 0.0
    for i in range(WINDOW):
        b.timings.forward_ended(clock, 3, drafted=True)
        b.timings.drafting(0.5)  # what the drafter's propose() took in that gap
        clock += 0.5 + (0.2 if i % 2 else 0.4) + (100.0 if i == 3 else 0.0)  # one idle gap
        b.timings.forward_began(clock)
    assert b.timings.overhead_s == {4: pytest.approx(0.4)}  # 7 of 0.2, 7 of 0.4 and one idle: 0.4
    assert b.stats()["overhead_s"] == b.timings.overhead_s and b.timings.overhead_plain_s == {}
    # no step without drafts measured yet: both kinds priced at the drafted steps' overhead
    assert cost(3, 3) == pytest.approx(1.4) and cost(3, 5) == pytest.approx(1.4)
    assert cost(60, 60) == pytest.approx(1.4)  # the nearest bucket measured
    b.timings.forward_ended(clock, 3, drafted=False)
    b.timings.forward_began(clock + 0.1)
    assert b.timings.overhead_plain_s == {4: pytest.approx(0.1)}
    # a step verifying no draft pays 0.1 s; one verifying drafts 0.4 s
    assert cost(3, 3) == pytest.approx(1.1) and cost(3, 4) == pytest.approx(1.4)
    assert torch.allclose(cost(3, torch.tensor([3, 4, 9])),
                          torch.tensor([1.1, 1.4, 1.4], dtype=torch.float64))
    b.timings.forward_began(clock + 5.0)  # no forward ended since: nothing measured
    assert b.timings.overhead_plain_s == {4: pytest.approx(0.1)}


def test_a_step_that_skips_on_the_forward_alone_drafts_once_the_overhead_is_counted():
    p = Proposer(_steps(11))
    b = _budget(p, True, policy="dcut", table=_table(10.0))  # a verified token costs 10 s...
    ids = ["a", "b", "c"]
    for _ in range(TIMED_MIN + 1):
        b.cut(p.propose(**STEP), ids)
    assert b.counts["skipped"] == 1
    for drafted in (True, False):  # ...but every step spends 1e6 s outside its forward
        b.timings.forward_ended(0.0, B, drafted)
        b.timings.forward_began(1e6)
    p.forwards = 0
    kept = b.cut(p.propose(**STEP), ids)
    assert p.asked == GAMMA and p.forwards >= 1 and b.counts["skipped"] == 1
    assert sum(map(len, kept)) > 0
