"""The fused loop's rounds priced by the speculation core's controller (trimpass.hf.costs): a
lookup round is one batched pass, a self-draft round its body steps and one full-head product; the
round of more expected tokens per second is chosen, by match length, before anything runs."""
import pytest
import torch

from trimpass.hf.costs import RoundCosts
from trimpass.spec.config import BudgetConfig
from trimpass.spec.control.controller import Controller
from trimpass.spec.drafts import Drafts

G, L = 8, 15


def _controller(step_s=0.010, verify_s=0.012, head_s=0.002):
    costs = RoundCosts(G, (16,))
    for name, s in (("step_s", step_s), ("head_s", head_s)):
        costs.time(name, s)
    costs.time_pass(16, verify_s)
    return Controller(BudgetConfig(lookup={"tokens": L}).for_engine(L), L, costs)


def _choice(c, match: int) -> str:
    look = Drafts.of([list(range(L))], "lookup", [match])
    plan = c.plan(1, G, look, depths=(0, G))
    return "self" if plan.depth else "lookup"


def test_an_unpriced_round_is_a_self_draft_and_no_lookup_draft_means_one():
    c = Controller(BudgetConfig().for_engine(L), L, RoundCosts(G))
    assert _choice(c, 4) == "self"  # nothing timed yet
    assert _controller().plan(1, G, None, depths=(G,)).depth == G


def test_the_choice_follows_tokens_per_second_by_match_length():
    c = _controller(verify_s=0.020)
    for _ in range(40):  # self-drafts keep nearly all 8: about 8 tokens in 8 steps (82 ms)
        c.prices["self"].observe(0, kept=8, reached=8)
        c.costs.self_round(8, 0.082)
        # one-token matches keep nothing (about 1.5 tokens a 20 ms pass: the rare pass of their
        # first token priced as four-token matches do after it); four-token matches keep all
        c.prices["lookup"].observe(1, kept=0, reached=1)
        c.prices["lookup"].observe(4, kept=L, reached=L)
    assert _choice(c, 1) == "self" and _choice(c, 4) == "lookup"
    assert _choice(c, 9) == "lookup"  # longer matches pool with the longest priced


def test_a_costly_batched_pass_loses_to_self_drafts_and_probes_come_by_the_schedule():
    c = _controller(verify_s=0.5)
    for _ in range(40):
        c.prices["self"].observe(0, kept=8, reached=8)
        c.prices["lookup"].observe(4, kept=L, reached=L)
    picks = [_choice(c, 4) for _ in range(400)]
    probes = [i for i, p in enumerate(picks) if p == "lookup"]
    assert picks[0] == "self" and len(probes) == c.counts["lookup_probes"] >= 2
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]  # each probe that still loses waits longer
    assert c.counts["plain_probes"] == 0  # no cost model to observe plain steps here


@pytest.mark.parametrize("name", ["step_s", "head_s"])
def test_each_cost_is_a_running_mean_of_the_rounds(name):
    costs = RoundCosts(G)
    costs.time(name, 1.0)
    costs.time(name, 2.0)
    assert getattr(costs, name) == pytest.approx(1.1)


def test_a_free_pass_is_timed_by_its_row_class_and_priced_by_tokens():
    costs = RoundCosts(G, (4, 8, 16))
    for rows, s in ((3, 1.0), (8, 2.0), (9, 4.0), (16, 8.0)):
        costs.time_pass(rows, s)
    assert costs.pass_s == {4: 1.0, 8: 2.0, 16: pytest.approx(0.9 * 4.0 + 0.1 * 8.0)}
    assert costs.price(1, 0) is None  # the self-draft rounds not timed yet
    costs.time("step_s", 0.01)
    costs.time("head_s", 0.01)
    cost, draft_s = costs.price(1, 0)
    assert draft_s == 0.0
    assert cost(1, torch.tensor([1, 4, 5, 8, 9, 16])).tolist() == pytest.approx(
        [1.0, 1.0, 2.0, 2.0, costs.pass_s[16], costs.pass_s[16]])


def test_a_forgotten_lookup_record_probes_at_its_first_match_once():
    c = _controller(verify_s=0.5)  # lookup loses on its price...
    for _ in range(40):
        c.prices["self"].observe(0, kept=8, reached=8)
    assert _choice(c, 4) == "self"
    c.forget("lookup")  # ...a new request: its text's repeats are its own
    assert c.prices["lookup"].reached.sum() == 0 and c.prices["self"].reached.sum() > 0
    assert c.plan(1, G, None, depths=(G,)).depth == G  # no match yet: the probe waits for one
    assert [_choice(c, 4) for _ in range(3)] == ["lookup", "self", "self"]


def test_a_rounds_depth_is_the_deepest_recent_stop_within_gamma():
    c = RoundCosts(G)
    assert c.depth(G, 0.4) == G and c.depth(G, 0.0) == G  # nothing seen yet; no confidence stop
    for stop in (2, 3, 1):
        c.stopped(stop)
    assert c.depth(G, 0.4) == 3
    c.stopped(G + 1)  # a round whose confidence never dropped
    assert c.depth(G, 0.4) == G
    for _ in range(4):
        c.stopped(1)
    assert c.depth(G, 0.4) == 1 and c.depth(G, 0.0) == G  # the last 4 rounds only
