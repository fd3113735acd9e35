"""The controller (trimpass.spec.control.controller) driven through the compatibility module's own
wrappers of vLLM's ``propose_draft_token_ids`` and ``_sample_draft_tokens``, installed on stand-ins
for vLLM's runner and proposer (no vLLM needed): the depth planned before drafting and vLLM's chain
running it to its end, what the cut returns, the confidences it reads once, what it learns from
what the target emitted, and the requests' lifecycle."""
import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from trimpass.config import TrimpassError
from trimpass.serving import vllm_compat as compat
from trimpass.serving import vllm_state
from trimpass.spec.control import CostTable
from trimpass.spec.control.controller import Controller
from trimpass.spec.control.costs import TIMED_MIN, ChainCosts
from trimpass.spec.control.timings import WINDOW

GAMMA, B, V = 4, 3, 11


HOOKS = vllm_state.Hooks(startup=None)
WRAP = dict(zip(compat.PATCHES, compat.WRAPPERS, strict=True))


def _wrapped(name, original):
    place = next(p for p in compat.PATCHES if p.endswith("." + name))
    return WRAP[place](HOOKS, original)


class Proposer:
    """vLLM's drafting loop in miniature: ``propose`` samples one token per step through
    ``_sample_draft_tokens``; the "hidden states" of step k are ``steps[k]``, taken as logits.
    Its ``_sample_draft_tokens`` carries the compatibility module's wrapper."""

    use_local_argmax_reduction = use_heterogeneous_vocab = parallel_drafting = False

    def __init__(self, steps, probabilistic=False):
        self.steps, self.forwards, self.asked = steps, 0, None
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

    def propose(self, num_speculative_tokens, sampling_metadata=None):
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


Proposer._sample_draft_tokens = _wrapped("_sample_draft_tokens", Proposer._sample_draft_tokens)


@dataclasses.dataclass
class SchedulerOutput:
    num_spec_tokens_to_schedule: int = GAMMA
    total_num_scheduled_tokens: int = B


class Runner:
    """vLLM's runner in miniature: ``propose_draft_token_ids`` runs the drafter's ``propose``
    as deep as the scheduler output says; it carries the compatibility module's wrapper."""
    device = "cpu"

    def __init__(self, drafter, req_ids=("a", "b", "c")):
        self.drafter, self.proposals = drafter, 0
        self.input_batch = SimpleNamespace(req_ids=list(req_ids), num_reqs=len(req_ids),
                                           num_tokens_no_spec=[4] * len(req_ids),
                                           token_ids_cpu=torch.arange(40).view(-1, 4).numpy())

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata):
        self.proposals += 1
        return self.drafter.propose(scheduler_output.num_spec_tokens_to_schedule,
                                    sampling_metadata)


Runner.propose_draft_token_ids = _wrapped("propose_draft_token_ids",
                                          Runner.propose_draft_token_ids)


def _steps(seed=0, sharp=4.0):
    g = torch.Generator().manual_seed(seed)
    return [sharp * torch.randn(B, V, generator=g) for _ in range(GAMMA)]


def _table(per_token: float) -> dict:
    return CostTable([1, 8], [0, 64], [[1.0, 1.0 + 64 * per_token],
                                       [1.0, 1.0 + 64 * per_token]]).to_dict()


GREEDY = SimpleNamespace(all_greedy=True)
EMITTED = torch.tensor([[7], [7], [7]])  # each request emitted one token this step


def _budget(proposer, shares_cache=False, **settings) -> Controller:
    if settings.get("policy") in ("dcut", "all-or-nothing"):
        settings = {"lookup": False, **settings}  # the drafter's budget alone, unless asked
    c = Controller(settings, GAMMA, ChainCosts(settings.get("table"), shares_cache=shares_cache))
    vllm_state._drafters[proposer] = vllm_state.Proposer(None, c, shares_cache,
                                                         plain=lambda h: h)
    return c


def _propose(runner, md=GREEDY, tokens=B, sampled=EMITTED):
    return runner.propose_draft_token_ids(SchedulerOutput(total_num_scheduled_tokens=tokens),
                                          sampled, md)


def _timed(c, batch=B, first=0.05, step=0.05):
    for _ in range(TIMED_MIN):
        c.costs.drafted(batch, 1, first)
        c.costs.drafted(batch, GAMMA, first + (GAMMA - 1) * step)


def _drafter(proposer, asynchronous=False):
    """What the compatibility module takes out of a loaded drafter, for Hooks.loaded."""
    head = compat.Head(None, 0, 1, 0.0, 1.0, V, None, lambda h: h, None, None)
    return compat.Drafter(model=proposer.model, target=object(), checkpoint=None,
                          additional={"trim": False, "budget": {"policy": "fixed",
                                                                "gamma": GAMMA + 1}},
                          max_num_seqs=8, async_scheduling=asynchronous, gamma=GAMMA,
                          model_key="stand-in", target_vocab=V, rank=0, head=head, d2t=None,
                          refused=None, first_pass_ok=True)


def test_the_planned_depth_runs_to_its_end_in_vllms_own_chain():
    p = Proposer(_steps())
    _budget(p, policy="fixed", gamma=2, table=_table(0.0))
    lists = _propose(Runner(p))
    assert p.asked == 2 and p.forwards == 2  # planned before drafting: no stop inside the loop
    want = torch.stack([s.argmax(dim=-1) for s in p.steps[:2]], dim=1)
    assert lists == want.tolist()


def test_greedy_confidence_is_the_softmax_maximum_read_once_at_the_cut(monkeypatch):
    p = Proposer(_steps(1))
    c = _budget(p, policy="off", table=_table(0.0))
    seen = []
    monkeypatch.setattr(c, "cut", lambda plan, req, draft, conf, **kw: seen.append(conf) or [])
    _propose(Runner(p))
    want = torch.stack([torch.softmax(s, dim=-1).max(dim=-1).values for s in p.steps], dim=1)
    torch.testing.assert_close(seen[0], want)


@pytest.mark.parametrize("per_token,kept", [(10.0, 0), (0.0, B * GAMMA)])
def test_dcut_cuts_to_nothing_when_tokens_cost_too_much(per_token, kept):
    p = Proposer(_steps(2, sharp=8.0))
    _budget(p, policy="dcut", table=_table(per_token))
    lists = _propose(Runner(p))
    assert p.forwards == GAMMA  # not timed yet: drafts to gamma_max, and is timed
    assert sum(len(x) for x in lists) == kept


def test_probabilistic_drafts_keep_vllms_own_probabilities():
    p = Proposer(_steps(3), probabilistic=True)
    c = _budget(p, policy="fixed", gamma=3, table=_table(0.0))
    seen = []
    cut = c.cut
    c.cut = lambda plan, req, draft, conf, **kw: seen.append(conf) or cut(plan, req, draft, conf,
                                                                          **kw)
    lists = _propose(Runner(p), md=SimpleNamespace(all_greedy=False))
    probs = torch.stack([torch.softmax(s, dim=-1) for s in p.steps[:3]], dim=1)
    assert p._last_draft_probs.shape == (B, 3, V) and [len(x) for x in lists] == [3] * B
    torch.testing.assert_close(p._last_draft_probs, probs)
    draft = torch.tensor(lists)
    torch.testing.assert_close(seen[0], probs.gather(-1, draft[..., None])[..., 0])


def test_acceptance_is_read_back_from_the_next_steps_sampled_tokens():
    p = Proposer(_steps(4))
    c = _budget(p, policy="off", table=_table(0.0))
    r = Runner(p)
    lists = _propose(r)
    sampled = torch.full((B, GAMMA + 1), -1)
    sampled[0, :3] = torch.tensor(lists[0][:2] + [(lists[0][2] + 1) % V])  # a: 2 kept, 1 more
    sampled[2, :1] = lists[2][0] + 1  # c: none accepted
    r.input_batch.req_ids = ["c", "b", "a"]  # the batch's order changed
    _propose(r, sampled=sampled[[2, 1, 0]])
    assert c.counts["accepted"] == 2  # b emitted nothing this step (preempted): no evidence
    assert c.prices["self"].reached[0].tolist()[:3] == [2, 1, 1]  # a rejected its third
    assert c.prices["self"].kept[0].tolist()[:3] == [1, 1, 0]
    assert len(c.calibration.pairs) == 3 + 1


def test_a_budget_refuses_async_scheduling_and_bad_settings():
    p = Proposer(_steps())
    with pytest.raises(RuntimeError, match="async_scheduling=False"):
        HOOKS.loaded(p, _drafter(p, asynchronous=True))
    with pytest.raises(ValueError, match="budget gamma"):
        HOOKS.loaded(p, _drafter(p))
    assert HOOKS.state(p) is None  # nothing registered: vLLM's own methods run


def test_a_cost_table_from_another_deployment_is_refused_at_load():
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


def test_a_drafting_step_that_costs_more_than_it_wins_is_not_planned():
    p = Proposer(_steps(5, sharp=8.0))
    c = _budget(p, True, policy="dcut", table=_table(0.0))  # verified tokens are free...
    _timed(c, step=100.0)  # ...but a drafting step after the first costs 100 s
    for _ in range(50):
        c.prices["self"].observe(0, kept=GAMMA, reached=GAMMA)
    lists = _propose(Runner(p))
    assert p.asked == 1 and [len(x) for x in lists] == [1] * B


@pytest.mark.parametrize("shares_cache", [True, False])
def test_a_step_where_no_draft_can_pay_skips_the_drafter(shares_cache):
    p = Proposer(_steps(6))
    c = _budget(p, shares_cache, policy="dcut", table=_table(10.0))  # a verified token: 10 s
    r = Runner(p)
    assert sum(map(len, _propose(r))) == 0 and p.forwards == GAMMA  # untimed: drafts, cut to 0
    _timed(c)
    p.forwards = 0
    assert _propose(r) == [[], [], []]
    if shares_cache:  # the target's pass wrote the cache: no drafter forward, no vLLM call
        assert p.forwards == 0 and r.proposals == 1 and c.counts["skipped"] == 1
    else:  # vLLM's own K = 0 path keeps the drafter's cache in step
        assert p.forwards == 1 and p.asked == 0 and c.counts["skipped"] == 1
    # a batch of 5 falls in another bucket, not timed yet: its timings are bucket 4's, scaled by
    # the cost model (flat here), so it skips without drafting first
    assert c.costs.draft_s(5, 1) == c.costs.draft_s(3, 1) == pytest.approx(0.05)
    fresh = _budget(Proposer(_steps(6)), shares_cache, policy="dcut", table=_table(10.0))
    assert fresh.costs.draft_s(5, 1) is None  # no timed bucket: it drafts, and is timed


def test_a_prefill_is_not_timed_and_skipping_probes_when_a_probe_is_priced_worth_it():
    p = Proposer(_steps(9))
    c = _budget(p, True, policy="dcut", table=_table(10.0), probe=1.0)
    r = Runner(p)
    _propose(r, tokens=B * 50)
    assert c.costs.as_dict()["draft_s"] == {}  # prompts: not drafting time
    _timed(c)
    # a probe verifies 12 drafted tokens at 10 s each for at most 4 s saved: it is due once the
    # skipped plain steps (1 s each) add up to its loss (probe=1.0), then at twice that
    loss = c.schedule.loss(B, GAMMA, c.costs.verify_cost(B), c.costs.price(B, GAMMA)[1], 0.5)
    assert 110 < loss < 125
    p.forwards = 0
    for _ in range(3 * math.ceil(loss) + 2):  # the target emits nothing: the record holds still
        _propose(r, sampled=torch.full((B, 1), -1))
    assert c.counts["probes"] == 2 and p.forwards == 2 * GAMMA
    assert c.stats()["probe_rates"] == {4: 0.25}


def test_free_verification_never_skips_and_paused_speculation_always_does():
    p = Proposer(_steps(7))
    c = _budget(p, True, policy="dcut", table=_table(0.0))
    r = Runner(p)
    _timed(c)
    for _ in range(3):
        _propose(r)
    assert c.counts["skipped"] == 0 and p.forwards >= 3  # every proposal drafts
    c.set({"policy": "none"})
    p.forwards = 0
    assert _propose(r) == [[], [], []]
    assert p.forwards == 0 and c.counts["skipped"] == 1


def test_a_live_request_id_sent_again_is_refused_and_a_finished_one_is_released():
    p = Proposer(_steps(8))
    _budget(p, True, policy="dcut", table=_table(0.0))
    st = HOOKS.state(p)

    def step(new=(), finished=(), scheduled=("a",)):
        return compat.Step({r: 1 for r in scheduled}, set(), {}, len(scheduled), tuple(new),
                           tuple(finished))
    st.follow(step(new=("a",)))
    assert list(st.requests) == ["a"]
    with pytest.raises(TrimpassError, match="request id 'a' is live"):
        st.follow(step(new=("a",)))
    st.follow(step(finished=("a",), scheduled=()))
    st.follow(step(new=("a",)))  # released: the id may come again
    assert st.stats()["requests_live"] == 1


def test_the_overhead_is_the_median_gap_between_forwards_less_drafting_by_kind():
    c = _budget(Proposer(_steps(10)), policy="dcut", table=_table(0.0))
    b = c.costs
    cost = b.verify_cost(3)
    assert cost(3, 3) == pytest.approx(1.0)  # nothing measured yet: the forward alone
    clock = 0.0
    for i in range(WINDOW):
        b.timings.forward_ended(clock, 3, drafted=True)
        b.timings.drafting(0.5)  # what the drafter's propose() took in that gap
        clock += 0.5 + (0.2 if i % 2 else 0.4) + (100.0 if i == 3 else 0.0)  # one idle gap
        b.timings.forward_began(clock)
    assert b.timings.overhead_s == {4: pytest.approx(0.4)}  # 7 of 0.2, 7 of 0.4 and one idle: 0.4
    assert c.stats()["overhead_s"] == b.timings.overhead_s and b.timings.overhead_plain_s == {}
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
