"""Probes of a skipping batch bucket (trimpass.budget.probes): priced by their expected loss,
backed off while skipping keeps paying, and re-armed when the acceptance record moves or the batch
comes back to a bucket it left."""
import math
import random

import pytest

from trimpass.budget.policies import check_settings
from trimpass.budget.probes import FLOOR, RECORD_STEP, REENTRY, Probes


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


def test_the_loss_is_drafting_and_extra_verification_less_what_accepted_tokens_save():
    def cost(batch, tokens):  # 2 s a step, 0.5 s a verified drafted token
        return 2.0 + 0.5 * (tokens - batch)
    # 3 requests x 4 tokens: drafting 1 + 3 * 0.25 s, 6 s more to verify; each accepted token
    # saves a plain step's share, 2 / 3 s, so 12 * 0.5 of them save 4 s
    assert Probes.loss(3, 4, cost, 1.0, 0.25, 0.5) == pytest.approx(1.75 + 6.0 - 4.0)
    assert Probes.loss(3, 4, cost, 1.0, 0.25, 1.0) == 0.0  # a probe that pays costs nothing
    assert Probes.loss(3, 4, None, 1.0, 0.25, 0.5) is None
    assert Probes.loss(3, 4, cost, None, 0.25, 0.5) is None


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
