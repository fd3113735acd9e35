"""Probes of a skipping batch bucket (trimpass.spec.control.schedule): priced by their expected
loss, backed off while skipping keeps paying, and re-armed when the acceptance record moves or the
batch comes back to a bucket it left."""
import math
import random

import pytest
import torch

from trimpass.spec.control.controller import Controller
from trimpass.spec.control.costmodel import CostTable
from trimpass.spec.control.costs import ChainCosts
from trimpass.spec.control.policies import check_settings
from trimpass.spec.control.schedule import (
    FLOOR,
    PLAIN_EVERY,
    PLAIN_MAX,
    PLAIN_SEEN,
    RECORD_STEP,
    REENTRY,
    Probes,
)


def _probe_times(p, n, *, k=4, loss=10.0, plain=1.0, record=0.5):
    return [i for i in range(n) if p.decide(k, True, loss=loss, plain_s=plain, record=record)]


@pytest.mark.parametrize("rate", [0, -0.5, 1.5, True, "1/16", None])
def test_a_probe_rate_outside_0_1_is_refused_by_name(rate):
    with pytest.raises(ValueError, match="budget probe"):
        Probes(rate)
    with pytest.raises(ValueError, match="budget probe"):
        check_settings({"policy": "dcut", "probe": rate}, 4)


def test_probes_are_due_when_the_skipped_seconds_pay_for_them_and_back_off_by_halves():
    p = Probes(0.5)
    p.decide(4, False, loss=None, plain_s=None, record=0.5)  # a drafted proposal: the start
    got = _probe_times(p, 400, loss=10.0, plain=1.0)
    # the m-th probe comes once the skipped seconds since the last reach loss / (0.5 / 2^m)
    want, at = [], -1
    for m in range(4):
        at += math.ceil(10.0 / (0.5 / 2 ** m)) + 1  # that many skips, then the probe
        want.append(at)
    assert got == want
    assert p.rates() == {4: 0.5 / 16}


def test_a_dearer_probe_comes_later_and_the_rate_stops_at_its_floor():
    cheap, dear = Probes(1.0), Probes(1.0)
    assert _probe_times(cheap, 50, loss=2.0)[0] < _probe_times(dear, 50, loss=20.0)[0]
    p = Probes(1.0)
    _probe_times(p, 20000, loss=1.0)
    assert p.rates() == {4: FLOOR}


def test_a_proposal_the_policy_drafts_resets_the_bucket():
    p = Probes(0.5)
    assert _probe_times(p, 45, loss=10.0) == [20]  # 20 s skipped, then 40 s: the next at 61
    p.decide(4, False, loss=10.0, plain_s=1.0, record=0.5)
    assert p.rates() == {4: 0.5}
    assert _probe_times(p, 25, loss=10.0) == [20]  # 20 s again, not 40


def test_a_moved_acceptance_record_probes_at_once_and_restarts_the_rate():
    p = Probes(0.5)
    _probe_times(p, 100, loss=10.0)
    assert p.rates()[4] < 0.5
    assert not p.decide(4, True, loss=10.0, plain_s=1.0, record=0.5 + RECORD_STEP / 2)
    assert p.decide(4, True, loss=10.0, plain_s=1.0, record=0.5 + RECORD_STEP)
    assert p.rates() == {4: 0.5}


def test_coming_back_to_a_bucket_probes_at_once_only_after_a_while_away():
    p = Probes(1 / 16)
    kw = dict(loss=100.0, plain_s=1.0, record=0.5)
    p.decide(8, True, **kw)
    for _ in range(REENTRY):  # a batch flapping between two buckets probes neither
        assert not p.decide(4, True, **kw) and not p.decide(8, True, **kw)
    for _ in range(REENTRY + 1):
        p.decide(4, True, **kw)
    assert p.decide(8, True, **kw)  # back in bucket 8 after more than REENTRY proposals away
    assert p.reentries == {8: 1}


def test_a_hopeless_bucket_neither_probes_at_once_on_a_moved_record_nor_on_coming_back():
    """Where no acceptance makes drafting pay, a moved record or a re-entry cannot change the
    decision: only the schedule probes (an early probe at 64 requests costs about a second)."""
    kw = dict(loss=10.0, plain_s=1.0)
    p = Probes(0.5)
    p.decide(4, True, record=0.5, hopeless=True, **kw)
    assert not p.decide(4, True, record=0.5 + 2 * RECORD_STEP, hopeless=True, **kw)
    assert p.decide(4, True, record=0.5 + 2 * RECORD_STEP, hopeless=False, **kw)  # at once
    q = Probes(1 / 16)
    q.decide(8, True, record=0.5, hopeless=True, **kw)
    for _ in range(REENTRY + 1):
        q.decide(4, True, record=0.5, hopeless=True, **kw)
    assert not q.decide(8, True, record=0.5, hopeless=True, **kw)
    # the schedule still probes it: after loss / rate skipped seconds (20 at rate 0.5)
    h = Probes(0.5)
    got = [i for i in range(30) if h.decide(4, True, record=0.5 + (i % 2) * RECORD_STEP * 3,
                                            hopeless=True, **kw)]
    assert got == [20]


def test_a_bucket_is_hopeless_when_no_draft_length_pays_even_with_every_token_accepted():
    def cost(batch, tokens):  # 2 s a step, 0.5 s a verified drafted token
        return 2.0 + 0.5 * (tokens - batch)
    # 3 requests, every token accepted: 4 drafts pay (1.75 + 6 - 8 < 0), so it is not hopeless
    assert not Probes.hopeless(3, 4, cost, _drafting(1.0, 0.25))
    # a first drafting step of 3 s: 1 draft loses 3 + 1.5 - 2, 4 drafts 3.75 + 6 - 8
    assert Probes.hopeless(3, 4, cost, _drafting(3.0, 0.25))
    assert not Probes.hopeless(3, 1, cost, _drafting(0.4, 0.25))  # one draft: 0.4 + 1.5 - 2 < 0
    assert not Probes.hopeless(3, 4, None, _drafting(3.0, 0.25))  # nothing known: not hopeless
    assert not Probes.hopeless(3, 4, cost, lambda depth: None)


def _drafting(first, step):
    return lambda depth: first + (depth - 1) * step


def _controller(settings, table, first, step=None):
    costs = ChainCosts(table.to_dict(), shares_cache=True)
    step = first if step is None else step
    costs.draft_s = lambda batch, depth: first + (depth - 1) * step
    return Controller(settings, 4, costs)


def test_a_runner_at_a_hopeless_bucket_skips_through_a_moved_record():
    # 64 requests: a plain step 144 ms, each verified drafted token 0.5 ms more, drafting 200 ms
    # then 136 ms a step: even every token accepted loses (hopeless, as 64 requests measured on
    # the AVX-512 VM: first_s 146 ms, C(64, 64) 147 ms, C(64, 128) 268 ms)
    table = CostTable([1, 64], [0, 64, 256],
                      [[0.020, 0.052, 0.148], [0.144, 0.176, 0.272]])

    def probes(records):
        r = _controller({"policy": "dcut"}, table, 0.200, 0.136)
        assert Probes.hopeless(64, 4, r.costs.verify_cost(64), _drafting(0.200, 0.136))
        drafted = 0
        for x in records:  # the record now: the drafter's acceptance at every position
            r.prices["self"].row = lambda match=0, x=x: torch.full((4,), x, dtype=torch.float64)
            drafted += r.plan(64, 4).depth is not None
        return drafted, r.counts["probes"]

    # the record moving at every proposal, never above the steady one (so never a cheaper
    # probe by the schedule): no more probes than the schedule gives the steady record
    steady = probes([0.96] * 40)
    swinging = probes([0.9, 0.96] * 20)
    assert steady[0] == steady[1] <= 2 and swinging[0] == swinging[1] <= steady[1], \
        (steady, swinging)


def test_the_loss_is_drafting_and_extra_verification_less_what_accepted_tokens_save():
    def cost(batch, tokens):  # 2 s a step, 0.5 s a verified drafted token
        return 2.0 + 0.5 * (tokens - batch)
    # 3 requests x 4 tokens: drafting 1 + 3 * 0.25 s, 6 s more to verify; each accepted token
    # saves a plain step's share, 2 / 3 s, so 12 * 0.5 of them save 4 s
    assert Probes.loss(3, 4, cost, 1.75, 0.5) == pytest.approx(1.75 + 6.0 - 4.0)
    assert Probes.loss(3, 4, cost, 1.75, 1.0) == 0.0  # a probe that pays costs nothing
    assert Probes.loss(3, 4, None, 1.75, 0.5) is None
    assert Probes.loss(3, 4, cost, None, 0.5) is None


def test_probes_spend_at_most_the_rate_of_the_skipped_seconds_on_random_loads():
    rng = random.Random(5)
    for _ in range(40):
        rate = rng.choice([1.0, 0.25, 1 / 16])
        p, spent, saved = Probes(rate), {}, {}
        for _ in range(rng.randrange(200, 2000)):
            k = rng.choice([1, 2, 4, 8])
            loss, plain = rng.uniform(0.1, 20.0), rng.uniform(0.05, 2.0)
            if p.decide(k, True, loss=loss, plain_s=plain, record=0.5):
                spent[k] = spent.get(k, 0.0) + loss
            else:
                saved[k] = saved.get(k, 0.0) + plain
        for k, s in spent.items():  # a probe at a re-entry is not paid for by skipped seconds
            assert s <= rate * saved.get(k, 0.0) + 20.0 * p.reentries[k], (rate, k)


def _plain_probe_times(p, n, *, k=4):
    got = []
    for i in range(n):
        if not p.decide(k, False, loss=1.0, plain_s=1.0, record=0.5) and p.plain_probe(k):
            got.append(i)
            p.plain_observed(k)  # the skipped proposal's step is a plain step
    return got


def test_a_bucket_that_drafts_skips_now_and_then_to_observe_its_plain_step_then_backs_off():
    assert (PLAIN_EVERY, PLAIN_SEEN, PLAIN_MAX) == (4, 5, 256)  # the schedule written out below
    got = _plain_probe_times(Probes(1 / 16), 1100)
    # every 4th proposal until 5 plain steps are seen, then 8, 16, ... drafted proposals apart
    gaps = [4, 4, 4, 4, 4, 8, 16, 32, 64, 128, 256, 256, 256]
    assert got == [sum(gaps[:i + 1]) - 1 for i in range(len(gaps))]


def test_a_plain_step_the_bucket_observes_restarts_its_count_and_other_buckets_keep_theirs():
    p = Probes(1 / 16)
    assert _plain_probe_times(p, 3) == []
    p.plain_observed(4)  # a plain step the policy chose (or a neighbouring probe's)
    assert _plain_probe_times(p, 3) == [] and _plain_probe_times(p, 1) == [0]
    assert _plain_probe_times(p, 4, k=8) == [3]


def test_a_runner_whose_table_overprices_the_plain_step_finds_out_and_skips():
    # the start-up table prices a plain step of 4 requests at 30 ms; the engine's take 18 ms, and
    # verifying 4 drafts each (20 tokens) 45 ms, as the table says; drafting costs 21 ms a step.
    # By the table drafting pays (20 tokens in 129 ms against 4 in 30); in truth plain steps do
    # (4 in 18 ms), and only a plain step the engine runs can show it
    table = CostTable([1, 4, 8], [0, 4, 16, 32],
                      [[0.020, 0.024, 0.034, 0.050], [0.030, 0.034, 0.045, 0.060],
                       [0.040, 0.046, 0.058, 0.075]])
    r = _controller({"policy": "dcut"}, table, 0.021)
    for _ in range(200):  # the drafter's tokens are accepted
        r.prices["self"].observe(0, kept=4, reached=4)
    plain = {str(i): 1 for i in range(4)}
    skips = []
    for _ in range(40):
        skip = r.plan(4, 4).depth is None  # a decode step of 4 tokens; None: no drafter forward
        skips.append(skip)
        if skip:
            r.observe_step(plain, {}, 4, 0.018)
        else:
            r.observe_step({x: 5 for x in plain}, {x: 4 for x in plain}, 20, 0.045)
    assert not skips[0] and r.counts["plain_probes"] >= 1
    seen = "".join("s" if s else "d" for s in skips)
    assert sum(not s for s in skips[8:]) <= r.counts["probes"] <= 2, seen  # drafts: probes only
    assert r.counts["plain_probes"] <= 2, seen  # the rest is the policy's own decision


@pytest.mark.parametrize("policy", [{"policy": "fixed", "gamma": 4}, {"policy": "off"}])
def test_a_policy_that_does_not_price_steps_never_skips_for_a_plain_probe(policy):
    table = CostTable([1, 4], [0, 16], [[0.010, 0.020], [0.030, 0.045]])
    r = _controller(policy, table, 0.001)
    want = policy.get("gamma", 4)
    assert all(r.plan(4, 4).depth == want for _ in range(4 * PLAIN_EVERY))  # every one drafts
    assert r.counts["plain_probes"] == 0
