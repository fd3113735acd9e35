"""Each drafter's trimpass state, on a stand-in drafter (no vLLM needed): held in trimpass's own
registry and nothing set on vLLM's proposer; in the engine step the runner learns it, the row of
a request that left the batch (finished, aborted, not scheduled) is released, and a resuming
request's row is released and rebuilt from its own tokens at its next proposal; the check mode is
the subclass its setting selects. The real engine holds the same under load in
tests/serving/test_serve_load.py."""
import numpy as np
import torch

from trimpass.serving import vllm_compat as compat
from trimpass.serving import vllm_state
from trimpass.serving.vllm_check import CheckedTrimmer
from trimpass.serving.vllm_trim import Trimmer

V, D = 64, 8
KEEP = [0, 1]


class Proposer:
    """vLLM's proposer as trimpass sees it: an object it must leave alone."""


def _drafter(**settings):
    W = torch.randn(V, D, generator=torch.Generator().manual_seed(0))
    head = compat.Head(W, 0, 1, 0.0, 1.0, V, None, lambda h: h @ W.T, None, None)
    return compat.Drafter(model=torch.nn.Linear(D, V), target=torch.nn.Linear(D, 2),
                          checkpoint=None,
                          additional={"learn_core": 0, "keep": KEEP, "capacity": 16, **settings},
                          max_num_seqs=4, async_scheduling=False, gamma=3, model_key="m",
                          target_vocab=V, rank=0, head=head, d2t=None, refused=None,
                          first_pass_ok=True)


def _load(**settings):
    hooks, p = vllm_state.Hooks(startup=None), Proposer()
    hooks.loaded(p, _drafter(**settings))
    return hooks, p, hooks.state(p)


def _batch(tokens: dict):
    ids = list(tokens)
    array = np.zeros((len(ids), 32), dtype=np.int64)
    for i, rid in enumerate(ids):
        array[i, :len(tokens[rid])] = tokens[rid]
    return compat.Batch(ids, [len(tokens[r]) for r in ids], array)


def _propose(st, batch, emitted=None, gamma=3, tokens=None):
    """One proposal through the proposer; vLLM's own proposal (``run``) records its depth."""
    ran = []
    emitted = [[] for _ in batch.req_ids] if emitted is None else emitted
    got = st.draft(batch, lambda: emitted, lambda depth: ran.append(depth), gamma=gamma,
                   tokens=len(batch.req_ids) if tokens is None else tokens, greedy=True,
                   device="cpu")
    return got, ran


def _step(st, scheduled, resumed=()):
    st.step(compat.Step({r: 1 for r in scheduled}, set(resumed), {}, len(scheduled)),
            lambda: None, verify=None, device="cpu", max_tokens=8)


def _row(st, rid):
    s = st.trimmer.state
    return set(s.idx[s.requests[rid], :int(s.count[s.requests[rid]])].tolist())


def test_the_state_is_trimpass_own_and_nothing_is_set_on_the_proposer():
    hooks, p, st = _load()
    assert type(st.trimmer) is Trimmer and st.controller is None and vars(p) == {}
    assert hooks.state(object()) is None and hooks.state(1) is None  # another object: vLLM's own
    assert type(_load(check=True)[2].trimmer) is CheckedTrimmer


def test_an_aborted_requests_row_is_released_in_the_step_the_runner_learns_it():
    _, _, st = _load()
    toks = {"a": [10, 11, 12], "b": [20, 21]}
    _propose(st, _batch(toks))
    assert st.trimmer.rows.live == 2 and _row(st, "b") == set(KEEP) | {20, 21}
    _step(st, ["a"])  # b aborted (or finished): not scheduled this step, no proposal needed
    assert set(st.trimmer.state.requests) == {"a"} and st.trimmer.rows.live == 1
    _step(st, [])
    assert st.trimmer.rows.live == 0


def test_a_resumed_request_is_rebuilt_from_its_own_tokens():
    _, _, st = _load()
    _propose(st, _batch({"a": [10, 11, 12], "b": [20, 21]}))
    st.trimmer.state.admit(torch.tensor([[40, 41]]), None, learn=False,
                           rows=torch.tensor([st.trimmer.state.requests["a"]]))  # a stale row
    assert {40, 41} <= _row(st, "a")
    _step(st, ["a", "b"], resumed=["a"])  # a resumes after preemption: its row is released...
    assert "a" not in st.trimmer.state.requests
    _propose(st, _batch({"a": [10, 11, 12, 13], "b": [20, 21]}))
    assert _row(st, "a") == set(KEEP) | {10, 11, 12, 13}  # ...and rebuilt from its own tokens


def test_a_proposal_skipped_whole_runs_nothing_and_the_rows_catch_up_at_the_next_draft():
    from trimpass.spec.control import CostTable
    from trimpass.spec.control.controller import Controller
    from trimpass.spec.control.costs import ChainCosts
    _, _, plain = _load()
    table = CostTable([1, 4], [0, 12], [[1.0, 2.0], [1.0, 2.0]]).to_dict()
    c = Controller({"policy": "none", "table": table}, 3, ChainCosts(table, shares_cache=True))
    st = vllm_state.Proposer(plain.trimmer, c, True, plain=None)
    toks = {"a": [10, 11, 12], "b": [20, 21], "c": [30]}
    got, ran = _propose(st, _batch(toks), [[1]] * 3)
    assert got == [[], [], []] and not ran and st.trimmer.rows.live == 0  # nothing built or run
    for step in range(4):  # more skipped proposals; c leaves the batch after the first
        _step(st, ["a", "b"] if step else ["a", "b", "c"])
        toks = {"a": toks["a"] + [13 + step], "b": toks["b"] + [22 + step]}
        assert _propose(st, _batch(toks), [[1]] * 2) == ([[], []], [])
    assert st.trimmer.rows.live == 0 and c.counts["skipped"] == st.skipped_whole == 5
    c.set({"policy": "fixed", "gamma": 2})  # the next proposal drafts, as deep as planned
    assert _propose(st, _batch(toks), [[1]] * 2)[1] == [2]
    assert _row(st, "a") == set(KEEP) | set(toks["a"])  # every token of the skipped steps
    assert _row(st, "b") == set(KEEP) | set(toks["b"])  # and no other request's
    assert "c" not in st.trimmer.state.requests
    assert st.skipped_whole == 5
