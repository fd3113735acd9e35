"""The zero-configuration entry points and the dynamic mode through the compiled drafter."""
import pytest
import torch

import trimpass
from trimpass import ops
from trimpass.config import Escape
from trimpass.testing.models import Transformer

V = 512


def _pair(seed=0, vocab=V):
    torch.manual_seed(seed)
    m = Transformer(vocab, tied=True).eval()
    ref = Transformer(vocab, tied=True).eval()
    ref.load_state_dict(m.state_dict())
    for t in (m, ref):
        t.setup_caches(1, 64)
    return m, ref


def _check_step(out, ref_out, active):
    fin = torch.isfinite(out[0, -1])
    assert set(fin.nonzero().flatten().tolist()) == active
    assert torch.allclose(out[0, -1, fin], ref_out[0, -1, fin], atol=1e-5)


@pytest.mark.parametrize("backend", ["module", "name"])
def test_zero_config_backends_trim_to_the_context(backend):
    torch._dynamo.reset()
    m, ref = _pair()
    cm = torch.compile(m, backend=trimpass if backend == "module" else "trimpass",
                       fullgraph=True)
    prompt = torch.randint(0, V, (1, 7))
    with torch.no_grad():
        out = cm(prompt, torch.arange(7))
        ref_out = ref(prompt, torch.arange(7))
        stats = trimpass.stats(cm)
        active = set(trimpass.active_ids(cm)[0, :stats["active"][0]].tolist())
        assert set(prompt[0].tolist()) <= active  # the first refresh adds the head's top ids
        _check_step(out, ref_out, active)
        tok = out[:, -1:].argmax(-1)
        out = cm(tok, torch.tensor([7]))
        ref_out = ref(tok, torch.tensor([7]))
    assert "dynamic vocabulary" in trimpass.explain(cm)
    n = trimpass.stats(cm)["active"][0]
    _check_step(out, ref_out, set(trimpass.active_ids(cm)[0, :n].tolist()))


def test_new_request_resets_and_two_drafters_do_not_share_state():
    torch._dynamo.reset()
    m1, _ = _pair(1)
    m2, _ = _pair(2)
    c1 = trimpass.trim(m1, refresh_every=0, learn_core=0)
    c2 = trimpass.trim(m2, refresh_every=0, learn_core=0)
    with torch.no_grad():
        c1(torch.tensor([[1, 2, 3]]), torch.arange(3))
        c2(torch.tensor([[4, 5]]), torch.arange(2))
        assert trimpass.stats(c1)["active"] == [3]
        assert trimpass.stats(c2)["active"] == [2]
        c1(torch.tensor([[9]]), torch.tensor([0]))  # position 0: a new request
        assert trimpass.stats(c1)["active"] == [1]
        trimpass.reset(c2)
        assert trimpass.stats(c2)["active"] == [0]


def test_observe_admits_the_targets_top_ids():
    torch._dynamo.reset()
    m, _ = _pair()
    c = trimpass.trim(m, refresh_every=0)
    with torch.no_grad():
        c(torch.tensor([[1, 2]]), torch.arange(2))
        target_logits = torch.full((1, 1, V), -5.0)
        target_logits[0, 0, [300, 301, 302]] = 5.0
        trimpass.observe(c, target_logits, k=3)
        n = trimpass.stats(c)["active"][0]
        assert {300, 301, 302} <= set(trimpass.active_ids(c)[0, :n].tolist())


def test_batch_of_two_rows_has_per_row_vocabularies():
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = Transformer(V).eval()
    c = trimpass.trim(m, refresh_every=0, learn_core=0, escape=None, inner="aot_eager")
    ids = torch.tensor([[1, 2, 3], [7, 8, 9]])
    with torch.no_grad():
        out = c(ids)
        ref = m.forward(ids)
    assert set(torch.isfinite(out[0, -1]).nonzero().flatten().tolist()) == {1, 2, 3}
    assert set(torch.isfinite(out[1, -1]).nonzero().flatten().tolist()) == {7, 8, 9}
    assert torch.allclose(out[1, -1, [7, 8, 9]], ref[1, -1, [7, 8, 9]], atol=1e-5)


def test_zero_config_learns_its_core_from_earlier_requests():
    from trimpass.dynamic.state import LEARN_EVERY
    torch._dynamo.reset()
    m, ref = _pair()
    c = trimpass.trim(m, learn_core=4, capacity=64, inner="aot_eager")
    with torch.no_grad():
        for r in range(LEARN_EVERY):  # one call per request: each starts at position 0
            c(torch.tensor([[100, 101, 102, 103, 200 + r % 7]]), torch.arange(5))
        out = c(torch.tensor([[300]]), torch.tensor([0]))
        ref_out = ref(torch.tensor([[300]]), torch.tensor([0]))
    n = trimpass.stats(c)["active"][0]
    active = set(trimpass.active_ids(c)[0, :n].tolist())
    assert active == {100, 101, 102, 103, 300}
    _check_step(out, ref_out, active)
    assert "learned core 4" in trimpass.explain(c)


class _Lookup(torch.nn.Module):
    def __init__(me):  # a receiver not called ``self``: the drafter is still found
        super().__init__()
        me.emb, me.mid = torch.nn.Embedding(V, 16), torch.nn.Linear(16, 16)

    def forward(me, ids):
        return torch.nn.functional.linear(me.mid(me.emb(ids)), me.emb.weight)


def test_rows_follow_requests_when_the_batch_size_changes():
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = _Lookup().eval()
    c = torch.compile(m, backend=trimpass.backend(learn_core=0, escape=None, inner="aot_eager"))
    seen = {}
    with torch.no_grad():
        for B in (2, 1, 3, 4):  # 1 is specialized by Dynamo, then 3 and 4 would share a
            ids = torch.arange(2 * B).view(B, 2) + 100 * B  # symbolic batch: the pass pins it
            out = c(ids)  # no position input: every batch position goes on with its request
            for r in range(B):
                seen[r] = seen.get(r, set()) | set(ids[r].tolist())
                fin = torch.isfinite(out[r, -1])
                assert set(fin.nonzero().flatten().tolist()) == seen[r]
                assert torch.allclose(out[r, -1, fin], m(ids)[r, -1, fin], atol=1e-5)
    assert trimpass.stats(c)["active"] == [len(seen[r]) for r in range(4)]
    trimpass.reset(c)  # a new request in every row
    with torch.no_grad():
        out = c(torch.tensor([[7, 8]]))
    assert set(torch.isfinite(out[0, -1]).nonzero().flatten().tolist()) == {7, 8}


class _BrokenLookup(_Lookup):
    def forward(me, ids):
        h = me.emb(ids)
        torch._dynamo.graph_break()  # the lookup and the head land in two graph pieces
        return torch.nn.functional.linear(me.mid(h), me.emb.weight)


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_a_graph_piece_without_the_head_still_admits(inner):
    """The piece holding only the lookup admits with no op reading the token it returns: the
    admission must survive dead-code elimination."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = _BrokenLookup().eval()
    c = torch.compile(m, backend=trimpass.backend(learn_core=0, escape=None, inner=inner))
    with torch.no_grad(), pytest.warns(trimpass.TrimpassWarning, match="lookups still admit"):
        c(torch.tensor([[1]]))  # compiles both pieces; the first says it admits, not "unchanged"
    trimpass.reset(c)
    with torch.no_grad():
        for ids, want in (([5, 9, 7], {5, 7, 9}), ([11, 5, 2], {2, 5, 7, 9, 11})):
            out = c(torch.tensor([ids]))
            fin = torch.isfinite(out[0, -1])
            assert set(fin.nonzero().flatten().tolist()) == want
            assert torch.allclose(out[0, -1, fin], m(torch.tensor([ids]))[0, -1, fin], atol=1e-5)


def _finite(out):
    return set(torch.isfinite(out[0, -1]).nonzero().flatten().tolist())


@pytest.mark.parametrize("shared_backend", [False, True])
def test_two_instances_of_one_class_have_their_own_state(shared_backend):
    torch._dynamo.reset()
    a, _ = _pair(1, vocab=2048)  # above the zero-config learned core (the lowest 1,024 ids)
    b, _ = _pair(2, vocab=2048)
    be = trimpass.backend(learn_core=0) if shared_backend else trimpass
    ca, cb = torch.compile(a, backend=be), torch.compile(b, backend=be)
    calls = ops.calls["head_full"]
    with torch.no_grad():
        oa = ca(torch.tensor([[1101, 1102, 1103]]), torch.arange(3))
        ob = cb(torch.tensor([[1107, 1108]]), torch.arange(2))  # same shapes: Dynamo would share
        assert ops.calls["head_full"] - calls == 2, "a trimmed head did not run"
        oa = ca(torch.tensor([[1300]]), torch.tensor([3]))
        ob = cb(torch.tensor([[1400]]), torch.tensor([2]))
    high_a, high_b = {i for i in _finite(oa) if i >= 1024}, {i for i in _finite(ob) if i >= 1024}
    assert high_a == {1101, 1102, 1103, 1300} and high_b == {1107, 1108, 1400}
    assert trimpass.stats(ca)["calls"] == trimpass.stats(cb)["calls"] == 2

    def active(c):
        return set(trimpass.active_ids(c)[0, :trimpass.stats(c)["active"][0]].tolist())

    trimpass.observe(cb, torch.tensor([[1450]]))
    assert 1450 in active(cb) and 1450 not in active(ca)
    trimpass.reset(ca)  # zero-config re-ranks a's learned core: from a's traffic only
    assert not active(ca) & {1107, 1108, 1400, 1450} and not active(cb) & {1101, 1300}
    assert 1400 in active(cb)


@pytest.mark.parametrize("escape_a", [False, True])
def test_two_truncated_drafters_sharing_weights_have_their_own_state(escape_a):
    torch._dynamo.reset()
    torch.manual_seed(0)
    a = _Lookup().eval()
    b = _Lookup().eval()
    b.emb = a.emb  # one embedding and tied head, as two truncations of one model share
    esc = dict(escape=Escape(rank=8, topk=16, gate=0.999) if escape_a else None)
    ca = trimpass.trim(a, learn_core=0, inner="aot_eager", **esc)
    cb = trimpass.trim(b, learn_core=0, escape=None, inner="aot_eager")
    with torch.no_grad():
        oa, ob = ca(torch.tensor([[11, 12]])), cb(torch.tensor([[21, 22]]))
        oa2 = ca(torch.tensor([[13, 11]]))
        ob2 = cb(torch.tensor([[23]]))
    assert _finite(ob) == {21, 22} and _finite(ob2) == {21, 22, 23}  # a's escapes never reach b
    assert trimpass.stats(cb)["active"] == [3]
    if escape_a:  # a's own rows hold its context and the ids its escape path added
        assert trimpass.stats(ca)["escapes"] == 2 and {11, 12, 13} < _finite(oa2)
        assert len(_finite(oa)) == 2 + 16 and len(_finite(oa2)) >= 3 + 16
    else:
        assert _finite(oa) == {11, 12} and _finite(oa2) == {11, 12, 13}
        assert trimpass.stats(ca)["active"] == [3]


def test_reset_before_the_first_call_is_a_no_op():
    torch._dynamo.reset()
    m, _ = _pair()
    c = trimpass.trim(m)
    trimpass.reset(c)  # a loop that resets at the start of every request, first request
    with torch.no_grad():
        c(torch.tensor([[5]]), torch.tensor([0]))
    trimpass.reset(c)
    assert trimpass.stats(c)["calls"] == 1


def test_successors_of_a_received_id_are_active_and_exact():
    torch._dynamo.reset()
    m, ref = _pair()
    c = trimpass.trim(m, learn_core=0, successors=3, inner="aot_eager")
    with torch.no_grad():
        c(torch.tensor([[40, 41, 42, 40, 43]]), torch.arange(5))  # 40 was followed by 41 and 43
        out = c(torch.tensor([[40]]), torch.tensor([0]))  # a new request sends 40 alone
        ref_out = ref(torch.tensor([[40]]), torch.tensor([0]))
    n = trimpass.stats(c)["active"][0]
    active = set(trimpass.active_ids(c)[0, :n].tolist())
    assert active == {40, 41, 43}
    _check_step(out, ref_out, active)
    assert "successors 3" in trimpass.explain(c)


def test_out_of_range_ids_fail_with_our_message_before_the_lookup():
    torch._dynamo.reset()
    m, _ = _pair()
    c = trimpass.trim(m, inner="aot_eager")
    with torch.no_grad(), pytest.raises(ValueError, match=rf"ids: token ids must be in \[0, {V}\)"):
        c(torch.tensor([[3, V + 2]]), torch.arange(2))


def test_active_state_is_the_drafters_own_and_none_before_the_first_call():
    torch._dynamo.reset()
    a, _ = _pair(1)
    b, _ = _pair(2)
    ca, cb = trimpass.trim(a, learn_core=0), trimpass.trim(b, learn_core=0)
    assert trimpass.active_state(ca) is None
    with torch.no_grad():
        ca(torch.tensor([[3, 4]]), torch.arange(2))
        cb(torch.tensor([[5]]), torch.arange(1))
    sa, sb = trimpass.active_state(ca), trimpass.active_state(cb)
    assert sa is not None and sb is not None and sa is not sb
    assert set(sa.active(1)[0][0, :int(sa.active(1)[1][0])].tolist()) == {3, 4}


def test_escape_path_through_the_compiled_drafter_is_exact_and_its_ids_stay_active():
    torch._dynamo.reset()
    m, ref = _pair(seed=3)
    with torch.no_grad():  # a flatter head, so the trimmed distribution is unsure and escapes fire
        for t in (m, ref):
            t.output.weight.mul_(0.02)
    cm = torch.compile(m, backend=trimpass.backend(inner="aot_eager", learn_core=0, capacity=64,
                                                   escape=Escape(16, 4, 0.999)), fullgraph=True)
    prompt = torch.randint(0, V, (1, 5))
    with torch.no_grad():
        out, ref_out = cm(prompt, torch.arange(5)), ref(prompt, torch.arange(5))
        before = ops.calls["head_full"]
        for t in range(3):
            fired = trimpass.stats(cm)["escapes"]
            active = set(trimpass.active_ids(cm)[0, :trimpass.stats(cm)["active"][0]].tolist())
            _check_step(out, ref_out, active)  # exact on the set, escaped ids included
            nxt = out[:, -1:].argmax(-1)
            out, ref_out = cm(nxt, torch.tensor([5 + t])), ref(nxt, torch.tensor([5 + t]))
        assert ops.calls["head_full"] - before == 3  # the trimmed head ran on every step
        assert trimpass.stats(cm)["escapes"] > fired >= 1


def test_the_escape_proxy_is_allocated_when_the_graph_is_built_and_filled_in_place(monkeypatch):
    # A CUDA-graph tree's warm-up run refuses tensors it allocated that outlive it (gpu_check's
    # e2e section on an H200: "2 tensors in the cudagraph pool not tracked as outputs").
    from trimpass.dynamic.escape import Proxy
    torch._dynamo.reset()
    seen, build = [], Proxy.build

    def recording_build(self, weight):
        before = None if self.basis is None else (self.basis.data_ptr(), self.proj.data_ptr())
        build(self, weight)
        seen.append((before, (self.basis.data_ptr(), self.proj.data_ptr())))

    monkeypatch.setattr(Proxy, "build", recording_build)
    m, _ = _pair(seed=5)
    cm = torch.compile(m, backend=trimpass.backend(inner="aot_eager", learn_core=0, capacity=64,
                                                   escape=Escape(16, 4, 0.999)), fullgraph=True)
    with torch.no_grad():
        cm(torch.randint(0, V, (1, 5)), torch.arange(5))
    assert len(seen) == 1, "the proxy is built by the first step"
    before, after = seen[0]
    assert before is not None, "the proxy's tensors were not allocated when the graph was built"
    assert before == after, "the first step allocated new proxy tensors"
