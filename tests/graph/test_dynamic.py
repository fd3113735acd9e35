"""The zero-configuration entry points and the dynamic mode through the compiled drafter."""
import pytest
import torch

import trimpass
from trimpass.spec.models import Transformer

V = 512


def _pair(seed=0):
    torch.manual_seed(seed)
    m = Transformer(V, tied=True).eval()
    ref = Transformer(V, tied=True).eval()
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
        active = set(trimpass.active_ids(cm)[0, :stats["batch1"]["active"][0]].tolist())
        assert set(prompt[0].tolist()) <= active  # the first refresh adds the head's top ids
        _check_step(out, ref_out, active)
        tok = out[:, -1:].argmax(-1)
        out = cm(tok, torch.tensor([7]))
        ref_out = ref(tok, torch.tensor([7]))
    assert "dynamic vocabulary" in trimpass.explain(cm)
    n = trimpass.stats(cm)["batch1"]["active"][0]
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
        assert trimpass.stats(c1)["batch1"]["active"] == [3]
        assert trimpass.stats(c2)["batch1"]["active"] == [2]
        c1(torch.tensor([[9]]), torch.tensor([0]))  # position 0: a new request
        assert trimpass.stats(c1)["batch1"]["active"] == [1]
        trimpass.reset(c2)
        assert trimpass.stats(c2)["batch1"]["active"] == [0]


def test_observe_admits_the_targets_top_ids():
    torch._dynamo.reset()
    m, _ = _pair()
    c = trimpass.trim(m, refresh_every=0)
    with torch.no_grad():
        c(torch.tensor([[1, 2]]), torch.arange(2))
        target_logits = torch.full((1, 1, V), -5.0)
        target_logits[0, 0, [300, 301, 302]] = 5.0
        trimpass.observe(c, target_logits, k=3)
        n = trimpass.stats(c)["batch1"]["active"][0]
        assert {300, 301, 302} <= set(trimpass.active_ids(c)[0, :n].tolist())


def test_batch_of_two_rows_has_per_row_vocabularies():
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = Transformer(V).eval()
    c = trimpass.trim(m, refresh_every=0, learn_core=0, inner="aot_eager")
    ids = torch.tensor([[1, 2, 3], [7, 8, 9]])
    with torch.no_grad():
        out = c(ids)
        ref = m.forward(ids)
    assert set(torch.isfinite(out[0, -1]).nonzero().flatten().tolist()) == {1, 2, 3}
    assert set(torch.isfinite(out[1, -1]).nonzero().flatten().tolist()) == {7, 8, 9}
    assert torch.allclose(out[1, -1, [7, 8, 9]], ref[1, -1, [7, 8, 9]], atol=1e-5)


def test_zero_config_learns_its_core_from_earlier_requests():
    from trimpass.graph.dynamic import LEARN_EVERY
    torch._dynamo.reset()
    m, ref = _pair()
    c = trimpass.trim(m, learn_core=4, capacity=64, inner="aot_eager")
    with torch.no_grad():
        for r in range(LEARN_EVERY):  # one call per request: each starts at position 0
            c(torch.tensor([[100, 101, 102, 103, 200 + r % 7]]), torch.arange(5))
        out = c(torch.tensor([[300]]), torch.tensor([0]))
        ref_out = ref(torch.tensor([[300]]), torch.tensor([0]))
    n = trimpass.stats(c)["batch1"]["active"][0]
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


def test_each_batch_size_gets_its_own_rows():
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = _Lookup().eval()
    c = torch.compile(m, backend=trimpass.backend(learn_core=0, inner="aot_eager"))
    with torch.no_grad():
        for B in (2, 1, 3, 4):  # 1 is specialized by Dynamo, then 3 and 4 would share a
            ids = torch.arange(2 * B).view(B, 2) + 100 * B  # symbolic batch: the pass pins it
            out = c(ids)
            for r in range(B):
                fin = torch.isfinite(out[r, -1])
                assert set(fin.nonzero().flatten().tolist()) == set(ids[r].tolist())
                assert torch.allclose(out[r, -1, fin], m(ids)[r, -1, fin], atol=1e-5)
    st = trimpass.stats(c)
    assert [st[f"batch{B}"]["active"] for B in (1, 2, 3, 4)] == [[2], [2] * 2, [2] * 3, [2] * 4]


def test_successors_of_a_received_id_are_active_and_exact():
    torch._dynamo.reset()
    m, ref = _pair()
    c = trimpass.trim(m, learn_core=0, successors=3, inner="aot_eager")
    with torch.no_grad():
        c(torch.tensor([[40, 41, 42, 40, 43]]), torch.arange(5))  # 40 was followed by 41 and 43
        out = c(torch.tensor([[40]]), torch.tensor([0]))  # a new request sends 40 alone
        ref_out = ref(torch.tensor([[40]]), torch.tensor([0]))
    n = trimpass.stats(c)["batch1"]["active"][0]
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
