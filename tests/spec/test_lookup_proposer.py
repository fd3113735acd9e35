"""The lookup proposer (trimpass.spec.proposers.lookup): the longest recurring suffix proposes what
followed its latest occurrence (a loop closer than the proposal repeated to its length); per
request of a continuously batched engine, each request drafts from its own text alone, follows the
engine's tokens step by step, is rebuilt where the engine's text is not the one it expects, and
leaves with its request; the step's drafts come as one ragged record."""
import numpy as np

from trimpass.spec.config import LookupConfig
from trimpass.spec.drafts import Drafts
from trimpass.spec.proposers.lookup import Lookup, LookupProposer


class Engine:
    """Requests' tokens as the engine holds them (this step's emitted ones not yet among them)."""

    def __init__(self, texts: dict):
        self.texts = {r: list(t) for r, t in texts.items()}

    def step(self, look, emitted: dict, limit=4):
        ids = list(emitted)
        lengths = [len(self.texts[r]) for r in ids]
        drafts = look.draft(ids, lengths, lambda i, a, b: np.array(self.texts[ids[i]][a:b]),
                              [emitted[r] for r in ids], limit)
        assert isinstance(drafts, Drafts) and len(drafts) == len(ids)
        out = drafts.per_request()
        for r, new in emitted.items():
            self.texts[r] += new
        return dict(zip(ids, out, strict=True))


def test_the_longest_recurring_suffix_proposes_what_followed_it_last():
    text = Lookup(LookupConfig(tokens=3, ngram=4))
    text.extend([5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7])
    assert text.propose(10) == ([9, 2, 6], 2)  # "6 7" last ended before 9; "1 6 7" never recurs
    text.extend([9])
    assert text.propose(10) == ([2, 6, 7], 3)  # "6 7 9" now recurs
    assert text.propose(1) == ([2], 3)  # the budget caps the proposal
    fresh = Lookup(LookupConfig(tokens=3, ngram=4))
    fresh.extend([1, 2, 3])
    assert fresh.propose(10) == ([], 0)


def test_a_loop_closer_than_the_proposal_is_repeated_to_its_length():
    text = Lookup(LookupConfig(tokens=8, ngram=3))
    text.extend([4, 1, 2, 3, 1, 2, 3])  # "2 3" last ended 3 tokens back: a loop of 3
    assert text.propose(10) == ([1, 2, 3, 1, 2, 3, 1, 2], 3)
    assert text.propose(5) == ([1, 2, 3, 1, 2], 3)
    text.extend([7])  # "3 7" never occurred: "7" alone neither; nothing recurs
    assert text.propose(10) == ([], 0)


def test_each_request_drafts_from_its_own_text_only():
    rng = np.random.default_rng(3)
    a = rng.integers(0, 50, 37).tolist()
    b = rng.integers(1000, 1050, 23).tolist()
    eng, look = Engine({"a": a, "b": b}), LookupProposer(LookupConfig(tokens=4, ngram=3))
    for _ in range(12):  # each emits a token it had emitted before: its own text repeats
        got = eng.step(look, {"a": [a[5]], "b": [b[7]]})
        assert all(t < 50 for t in got["a"][0]) and all(t >= 1000 for t in got["b"][0])
    ref = Lookup(LookupConfig(tokens=4, ngram=3))
    ref.extend(eng.texts["a"])
    assert look.live["a"].seq == eng.texts["a"] and got["a"] == ref.propose(4)


def test_a_request_whose_engine_text_changed_is_rebuilt_and_leavers_are_dropped():
    eng = Engine({"a": [1, 2, 3, 1, 2], "b": [7, 8, 9]})
    look = LookupProposer(LookupConfig(tokens=4, ngram=2))
    assert eng.step(look, {"a": [3], "b": []})["b"] is None  # b emitted nothing: no draft
    assert eng.step(look, {"a": [1]})["a"] == ([2, 3, 1, 2], 2)
    eng.texts["a"] = [5, 6, 5, 6, 5]  # recomputed after preemption: another text
    assert eng.step(look, {"a": [6]})["a"] == ([5, 6, 5, 6], 2)
    assert look.live["a"].seq == [5, 6, 5, 6, 5, 6]
    eng.texts["a"] += [9, 9]  # a prefill chunk the index did not see
    eng.step(look, {"a": [5]})
    assert look.live["a"].seq == eng.texts["a"]
    look.keep_only(["b"])
    assert len(look) == 0 and look.expected == {}
