"""Lookup drafts priced beside self-drafts under one budget (trimpass.budget.sources and the
runner's merge): a lookup draft's price is what the target accepted of earlier ones with the same
match length, each request sends the source worth more, and a proposal whose lookup drafts alone
beat running the drafter runs none."""
import pytest
import torch

from trimpass.budget.costmodel import CostTable
from trimpass.budget.policies import check_settings
from trimpass.budget.runner import PolicyRunner, StopDrafting
from trimpass.budget.sources import DraftProfile, LookupPrice

G = 4
TABLE = CostTable([1, 8], [0, 32], [[1.0, 1.0 + 0.02 * 32], [1.6, 1.6 + 0.02 * 32]]).to_dict()


def _runner(**settings):
    return PolicyRunner({"policy": "dcut", "table": TABLE, **settings}, G,
                        shares_cache=True)


def _propose(r, req, conf, lookup=None):
    """One proposal over requests ``req``: the drafter drafts ids 100, 101, ... with confidence
    ``conf`` where the runner runs it; the cut's kept lists."""
    B = len(req)
    run = r.begin(B, G, B, lookup)
    ids = []
    try:
        for k in range(run or 0):
            ids.append(torch.full((B,), 100 + k))
            r.drafted(ids[-1], torch.full((B,), conf), None)
    except StopDrafting:
        pass
    draft = torch.stack(ids, dim=1) if ids else torch.empty(B, 0, dtype=torch.long)
    return r.cut(draft, req)


def test_the_price_is_per_match_length_and_position_from_what_was_accepted():
    p = LookupPrice(G)
    assert p.confidences([([1, 2, 3], 2), None], G).tolist() == [[0.5, 0.5, 0.5, 0.0], [0] * G]
    for _ in range(8):
        p.observe(match=1, sent=4, accepted=0)  # short matches: rejected at once
        p.observe(match=4, sent=4, accepted=4)  # long matches: all accepted
    c = p.confidences([([7] * 4, 1), ([7] * 4, 9), ([7, 7], 4)], G)
    assert c[0, 0] == pytest.approx(1 / 10) and (c[0, 1:] == 0.5).all()  # never reached past 0
    assert (c[1] == 0.9).all() and c[1].tolist() == c[2].tolist()[:2] + [0.9, 0.9]  # 9 pools at 4
    assert c[2, 2:].tolist() == [0.0, 0.0]  # past its draft


def test_each_request_sends_the_source_worth_more_and_its_price_learns():
    r = _runner()
    lookup = [([5, 6, 7, 8], 4), ([9, 9], 1), None]
    kept = _propose(r, ["a", "b", "c"], 0.3, lookup)
    assert kept[0][:1] == [5] and kept[1][:1] in ([9], [100]) and kept[2][:1] in ([], [100])
    assert kept[0] == [5, 6, 7, 8][:len(kept[0])]  # a lookup row is a prefix of its lookup draft
    assert r.counts["lookup_rows"] >= 1 and r.counts["lookup_sent"] >= len(kept[0])
    r.accepted(["a", "b", "c"], [1 + len(kept[0]), 1, 1])
    assert r.counts["lookup_accepted"] == len(kept[0])
    assert r.lookup_price.table()[4, 0] > 0.5  # match 4: accepted, its price rises
    for _ in range(30):  # match-1 lookups keep failing: the drafter's draft wins for them
        got = _propose(r, ["b"], 0.3, [([9, 9, 9, 9], 1)])
        r.accepted(["b"], [1])
    # sent until its price (1 / (rejections + 2)) fell below the drafter's worth, then no more
    assert got[0][:1] == [100] and r.lookup_price.table()[1, 0] < 0.25
    assert r.lookup_price.reached[1, 0] < 10


def test_without_lookups_the_cut_is_the_drafters_alone():
    r = _runner(lookup=False)
    assert r.lookup_price is None
    kept = _propose(r, ["a"], 0.9, [([5, 6, 7, 8], 4)])
    assert all(t >= 100 for t in kept[0]) and "lookup_rows" not in r.counts


def _priced(r, B, profile):
    for _ in range(3):
        r.timings.record("first_s", B, 0.05)
        r.timings.record("step_s", B, 0.05)
    r.profile.mean = torch.full((G,), profile, dtype=torch.float64)
    for _ in range(40):  # the lookups of these requests were always accepted
        r.lookup_price.observe(match=4, sent=4, accepted=4)


def test_lookup_drafts_alone_skip_the_drafter_when_they_beat_running_it():
    r, B = _runner(), 4
    _priced(r, B, profile=0.05)  # a poor drafter of late
    lookup = [([1, 2, 3, 4], 4)] * 2 + [None] * 2
    assert r.begin(B, G, B, lookup) is None and r.counts["lookup_only"] == 1
    kept = r.cut(torch.empty(B, 0, dtype=torch.long), list("abcd"))
    assert kept[:2] == [[1, 2, 3, 4]] * 2 and kept[2:] == [[], []]
    r2 = _runner()
    _priced(r2, B, profile=0.95)  # a good drafter: worth its seconds for the other two
    assert r2.begin(B, G, B, lookup) == G and "lookup_only" not in r2.counts


def test_the_profile_follows_the_drafters_calibrated_confidence():
    p = DraftProfile(G, decay=0.5)
    assert p.mean is None
    p.observe(torch.tensor([[0.8, 0.4], [0.6, 0.2]]))
    assert p.mean.tolist() == pytest.approx([0.7, 0.3, 0.0, 0.0])
    p.observe(torch.tensor([[0.1, 0.1, 0.1, 0.1]]))
    assert p.mean.tolist() == pytest.approx([0.4, 0.2, 0.05, 0.05])


@pytest.mark.parametrize("lookup, match", [
    ({"ngram": 0}, "budget lookup ngram"), ({"ngram": 2.5}, "budget lookup ngram"),
    ({"ngram": True}, "budget lookup ngram"), ({"tokens": G + 1}, "num_speculative_tokens"),
    ({"tokens": 0}, "budget lookup tokens"), ({"size": 3}, "unknown setting 'size'"),
    ("yes", "budget lookup: true, false or a dict")])
def test_bad_lookup_settings_are_refused_by_name(lookup, match):
    with pytest.raises(ValueError, match=match):
        check_settings({"policy": "dcut", "lookup": lookup}, G)


def test_lookup_is_on_by_default_where_the_policy_prices_drafts_and_refused_where_not():
    assert check_settings({"policy": "dcut"}, G)["lookup"] == {"ngram": 4, "tokens": G}
    assert check_settings({"policy": "fixed", "gamma": 2}, G)["lookup"] is None
    with pytest.raises(ValueError, match="does not price drafts"):
        check_settings({"policy": "fixed", "gamma": 2, "lookup": True}, G)
