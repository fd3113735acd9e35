"""The controller (trimpass.spec.control.controller): the depth is planned before drafting from the
price records and the engine's costs; a proposal whose lookup drafts alone beat running the
drafter runs none; the cut reads the confidences once and sends each request the source worth more;
every draft offered, sent or not, is priced against what its own request emitted."""
import pytest
import torch

from trimpass.spec.control.controller import Controller, Plan
from trimpass.spec.control.costmodel import CostTable
from trimpass.spec.control.costs import TIMED_MIN, ChainCosts
from trimpass.spec.drafts import Drafts

G = 4
TABLE = CostTable([1, 8], [0, 32], [[1.0, 1.0 + 0.02 * 32], [1.6, 1.6 + 0.02 * 32]]).to_dict()


def _controller(first=0.05, step=0.05, shares_cache=True, **settings):
    costs = ChainCosts(TABLE, shares_cache=shares_cache)
    for _ in range(3):
        costs.drafted(4, 1, first)
        costs.drafted(4, G, first + (G - 1) * step)
    return Controller({"policy": "dcut", **settings}, G, costs)


def _accepted(c, source, p, match=0, n=200):
    """``source``'s record: each position accepted with probability about ``p``."""
    for i in range(n):
        kept = next((k for k in range(G) if (i * 7 + k * 13) % 100 >= p * 100), G)
        c.prices[source].observe(match, kept, min(kept + 1, G))


def _lookup(rows, match):
    return Drafts.of(rows, "lookup", match)


def test_an_unpriced_drafter_drafts_as_deep_as_asked_and_is_timed():
    c = Controller({"policy": "dcut"}, G, ChainCosts(TABLE, shares_cache=True))
    assert c.plan(4, G) == Plan(G, (False,) * 4)
    for _ in range(TIMED_MIN):  # whole proposals, synchronised
        assert c.costs.draft_s(4, G) is None
        c.costs.drafted(4, G, 0.2)
    assert c.costs.draft_s(4, G) == pytest.approx(0.2)
    assert c.costs.draft_s(4, 1) == pytest.approx(0.05)  # one depth timed: in proportion
    for _ in range(TIMED_MIN):
        c.costs.drafted(4, 1, 0.08)
    assert c.costs.draft_s(4, 2) == pytest.approx(0.12)  # two: the first forward and a step
    assert c.costs.draft_s(3, G) == pytest.approx(0.2)  # another batch, same bucket
    table = CostTable.from_dict(TABLE)
    scale = float(table(8, 8)) / float(table(4, 4))
    assert c.costs.draft_s(8, 1) == pytest.approx(0.08 * scale)  # scaled by C(B, B)


def test_the_depth_follows_the_drafters_price_before_drafting():
    good, poor = _controller(), _controller()
    _accepted(good, "self", 0.97)
    _accepted(poor, "self", 0.02)
    assert good.plan(4, G).depth == G  # every position pays for its step
    assert poor.plan(4, G).depth is None  # no depth pays: no drafter forward (shared cache)
    assert poor.counts["skipped"] == 1
    own = _controller(shares_cache=False)
    _accepted(own, "self", 0.02)
    assert own.plan(4, G).depth == 0  # its own cache: the first forward keeps it in step


def test_lookup_drafts_alone_skip_the_drafter_when_they_beat_running_it():
    c, B = _controller(), 4
    _accepted(c, "self", 0.05)
    _accepted(c, "lookup", 0.99, match=4)
    lookup = _lookup([[1, 2, 3, 4]] * 2 + [[]] * 2, [4, 4, 0, 0])
    plan = c.plan(B, G, lookup)
    assert plan.depth is None and plan.lookup == (True, True, False, False)
    assert c.counts["lookup_only"] == 1
    kept = c.cut(plan, list("abcd"), lookup=lookup)
    assert kept[:2] == [[1, 2, 3, 4]] * 2 and kept[2:] == [[], []]
    good = _controller()
    _accepted(good, "self", 0.97)
    _accepted(good, "lookup", 0.99, match=4)
    assert good.plan(B, G, lookup).depth == G  # a good drafter: worth its seconds for the others


def test_each_request_sends_the_source_worth_more_and_every_offer_is_priced():
    c = _controller()
    _accepted(c, "lookup", 0.99, match=4)
    lookup = _lookup([[5, 6, 7, 8], [9, 9], []], [4, 1, 0])
    draft = torch.tensor([[100, 101, 102, 103]] * 3)
    conf = torch.full((3, G), 0.3)
    kept = c.cut(Plan(G, (True, True, False)), ["a", "b", "c"], draft, conf, lookup=lookup)
    assert kept[0] == [5, 6, 7, 8][:len(kept[0])] and kept[0]  # the long match is worth more
    assert kept[2] == [100, 101, 102, 103][:len(kept[2])]  # no lookup draft: the drafter's
    assert c.counts["lookup_rows"] >= 1
    before = c.prices["self"].reached.sum(), c.prices["lookup"].reached[1].sum()
    # the target emitted: a's lookup draft and one more; b's first token differs from both drafts
    c.observe(["a", "b", "c", "x"], [[5, 6, 7, 8, 1], [3], [100, 7], [100, 101]])
    sent = sum(len(k) for k in kept[:2] if k and k[0] in (5, 9))  # the rows sending lookups
    assert c.counts["lookup_sent"] == sent and c.counts["accepted"] >= len(kept[0])
    assert c.prices["lookup"].reached[1].sum() == before[1] + 1  # b's unsent lookup draft too
    assert c.prices["self"].reached.sum() == before[0] + 1 + 1 + 2  # a, b (1 each), c (2)
    c.observe(["a"], [[5]])  # nothing offered since: nothing learned
    assert c.prices["self"].reached.sum() == before[0] + 4


def test_without_lookups_the_cut_is_the_drafters_alone():
    c = _controller(lookup=False)
    lookup = _lookup([[5, 6, 7, 8]], [4])
    plan = c.plan(1, G, lookup)
    assert not any(plan.lookup)
    kept = c.cut(plan, ["a"], torch.tensor([[100, 101, 102, 103]]), torch.full((1, G), 0.9),
                 lookup=lookup)
    assert all(t >= 100 for t in kept[0]) and not c.counts["lookup_rows"]
    c.observe(["a"], [[5, 6]])
    assert not c.prices["lookup"].reached.any()  # lookup off: nothing of it is priced


def test_the_cut_reads_confidences_once_and_keeps_a_prefix_by_dcut():
    c = _controller()
    conf = torch.tensor([[0.99, 0.99, 0.01, 0.01], [0.01, 0.01, 0.01, 0.01]])
    kept = c.cut(Plan(G), ["a", "b"], torch.arange(8).view(2, 4), conf, seconds=0.2)
    assert kept == [[0, 1], []]  # confident tokens pay for verification, unlikely ones do not


@pytest.mark.parametrize("bad", [{"probe": -0.1}, {"probe": float("nan")}, {"measure_s": -1},
                                 {"measure_s": float("inf")}, {"policy": "greedy"}])
def test_bad_settings_are_refused_by_name(bad):
    with pytest.raises(ValueError, match=f"budget {next(iter(bad))}"):
        Controller(bad, G, ChainCosts())
