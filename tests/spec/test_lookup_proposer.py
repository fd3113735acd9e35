"""Per-request lookup indexes of a continuously batched engine (trimpass.spec.lookup): each
request drafts from its own text alone, follows the engine's tokens step by step, is rebuilt
where the engine's text is not the one it expects, and leaves with its request."""
import numpy as np

from trimpass.spec.lookup import Lookup, RequestLookups


class Engine:
    """Requests' tokens as the engine holds them (this step's emitted ones not yet among them)."""

    def __init__(self, texts: dict):
        self.texts = {r: list(t) for r, t in texts.items()}

    def step(self, look, emitted: dict, limit=4):
        ids = list(emitted)
        lengths = [len(self.texts[r]) for r in ids]
        out = look.drafts(ids, lengths, lambda i, a, b: np.array(self.texts[ids[i]][a:b]),
                          [emitted[r] for r in ids], limit)
        for r, new in emitted.items():
            self.texts[r] += new
        return dict(zip(ids, out, strict=True))


def test_each_request_drafts_from_its_own_text_only():
    rng = np.random.default_rng(3)
    a = rng.integers(0, 50, 37).tolist()
    b = rng.integers(1000, 1050, 23).tolist()
    eng, look = Engine({"a": a, "b": b}), RequestLookups(tokens=4, ngram=3)
    for _ in range(12):  # each emits a token it had emitted before: its own text repeats
        got = eng.step(look, {"a": [a[5]], "b": [b[7]]})
        assert all(t < 50 for t in got["a"][0]) and all(t >= 1000 for t in got["b"][0])
    ref = Lookup(4, 3)
    ref.extend(eng.texts["a"])
    assert look.live["a"].seq == eng.texts["a"] and got["a"] == ref.propose(4)


def test_a_request_whose_engine_text_changed_is_rebuilt_and_leavers_are_dropped():
    eng, look = Engine({"a": [1, 2, 3, 1, 2], "b": [7, 8, 9]}), RequestLookups(4, 2)
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
