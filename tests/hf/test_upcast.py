"""The several-row head product upcast in chunks: within one rounding of an fp64 reference at odd
sizes, its greedy decisions through the near-tie rule equal the one-row native products, the
choice is measured (and never made for a full-precision weight), and one row always takes the
native product."""
import time
import types

import pytest
import torch
import torch.nn.functional as F

from trimpass.hf import upcast
from trimpass.hf.full_head import FullHead
from trimpass.spec.verify import greedy


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk", [1, 7, 2048])
def test_the_upcast_product_is_the_exact_product_rounded_once(dtype, chunk):
    g = torch.Generator().manual_seed(chunk)
    W = torch.randn(1001, 37, generator=g).to(dtype)  # 1001 rows: no chunk divides them
    b = torch.randn(1001, generator=g).to(dtype)
    h = torch.randn(5, 37, generator=g).to(dtype)
    exact = F.linear(h.double(), W.double(), b.double())
    got = upcast.upcast_linear(h, W, b, chunk=chunk)
    assert got.dtype == dtype and got.shape == (5, 1001)
    # fp32 accumulation over 37 terms, then one rounding to the half type: half an ulp and a hair
    ulp = torch.finfo(dtype).eps * exact.abs().clamp(min=torch.finfo(dtype).tiny)
    assert ((got.double() - exact).abs() <= 0.5 * ulp + 1e-5 * exact.abs().clamp(min=1)).all()


def test_a_bad_chunk_is_refused_by_name():
    with pytest.raises(ValueError, match="chunk"):
        upcast.upcast_linear(torch.ones(2, 3), torch.ones(4, 3), chunk=0)


class _Model(torch.nn.Module):
    def __init__(self, W):
        super().__init__()
        self.lm = torch.nn.Linear(W.shape[1], W.shape[0], bias=False, dtype=W.dtype)
        self.lm.weight.data.copy_(W)
        self.config = type("C", (), {"final_logit_softcapping": None})()

    def get_output_embeddings(self):
        return self.lm


def test_upcast_greedy_decisions_are_the_native_one_row_products(monkeypatch):
    torch.manual_seed(3)
    W = torch.randn(3001, 48).bfloat16()
    H = torch.randn(9, 48).bfloat16()
    H[4] = H[0]
    W[17] = W[2900] = H[0] * 2  # rows 0 and 4: ids 17 and 2900 tie at the top
    head = FullHead(_Model(W))
    head.product.upcast = True
    calls = []
    real = upcast.upcast_linear
    monkeypatch.setattr(upcast, "upcast_linear", lambda *a, **k: calls.append(a[0].shape[0])
                        or real(*a, **k))
    ids, again = greedy(head, H)
    want = torch.stack([F.linear(H[j:j + 1], W).argmax(-1)[0] for j in range(9)])
    assert torch.equal(ids, want)
    assert calls == [9] and again >= 2  # the batch upcast; the ties again alone, natively


def _never_timed(*a, **k):
    raise AssertionError("timed a choice that needs no timing")


def test_the_choice_is_measured_and_kept(monkeypatch):
    W = torch.randn(515, 24).bfloat16()
    lin = upcast.Linear(W)
    assert lin.upcast is None
    slow = upcast.upcast_linear

    def slower(*a, **k):
        time.sleep(0.02)
        return slow(*a, **k)
    monkeypatch.setattr(upcast, "upcast_linear", slower)
    assert lin.calibrate() is False
    monkeypatch.setattr(upcast, "upcast_linear", slow)  # now the native product is the slow one

    def slower_native(*a):
        time.sleep(0.02)
        return F.linear(*a)
    monkeypatch.setattr(upcast, "F", types.SimpleNamespace(linear=slower_native))
    assert upcast.Linear(W).calibrate() is True and lin.calibrate() is False  # lin kept its choice
    monkeypatch.undo()
    h = torch.randn(3, 24).bfloat16()
    assert torch.equal(lin(h), F.linear(h, W))
    lin2 = upcast.Linear(W)
    lin2.upcast = True
    assert lin2(h[:1]).dtype == torch.bfloat16
    assert torch.equal(lin2(h[:1]), F.linear(h[:1], W))  # one row: the native product


def test_a_full_precision_weight_is_never_upcast_nor_timed(monkeypatch):
    monkeypatch.setattr(upcast.measure, "faster", _never_timed)
    lin = upcast.Linear(torch.randn(64, 8))
    assert lin.upcast is False and lin.calibrate() is False


class _Two(torch.nn.Module):
    """A body linear over every row, and a head over the last two (left alone by its shape)."""

    def __init__(self, dtype):
        super().__init__()
        self.body = torch.nn.Linear(24, 40, dtype=dtype)
        self.head = torch.nn.Linear(40, 77, bias=False, dtype=dtype)

    def forward(self, x):
        h = self.body(x)
        return h, self.head(h[-2:])


def _compiled(dtype, monkeypatch, faster):
    torch._dynamo.reset()
    monkeypatch.setitem(upcast._faster, torch.bfloat16, faster)
    backend = upcast.RowsBackend(lambda gm, example_inputs, **kw: gm.forward, head=(77, 40))
    model = _Two(dtype)
    return model, backend, torch.compile(model, backend=backend, dynamic=False)


def test_several_rows_of_the_body_run_upcast_and_one_row_natively(monkeypatch):
    model, backend, fast = _compiled(torch.bfloat16, monkeypatch, True)
    calls = []
    real = upcast.upcast_linear
    monkeypatch.setattr(upcast, "upcast_linear", lambda *a, **k: calls.append(a[0].shape[0])
                        or real(*a, **k))
    x = torch.randn(13, 24).bfloat16()
    with torch.no_grad():
        h, z = fast(x)
        assert backend.rewritten == 1 and calls == [13]  # the body, not the head
        assert torch.equal(h, real(x, model.body.weight, model.body.bias))
        assert torch.equal(z, F.linear(h[-2:], model.head.weight))
        one, _ = fast(x[:1])  # a graph of one row: nothing changed
    assert backend.rewritten == 1 and calls == [13]
    assert torch.equal(one, F.linear(x[:1], model.body.weight, model.body.bias))


def test_nothing_is_rewritten_where_upcast_is_not_faster_or_the_weight_is_fp32(monkeypatch):
    for dtype, faster in ((torch.bfloat16, False), (torch.float32, True)):
        model, backend, fast = _compiled(dtype, monkeypatch, faster)
        x = torch.randn(13, 24, dtype=dtype)
        with torch.no_grad():
            h, _ = fast(x)
        assert backend.rewritten == 0
        assert torch.equal(h, F.linear(x, model.body.weight, model.body.bias))


def test_a_bf16_self_drafter_keeps_its_trimmed_head_in_every_graph(monkeypatch):
    import trimpass
    from tests.graph.test_hf import V
    from tests.hf.test_fused import WINDOW
    torch._dynamo.reset()
    monkeypatch.setitem(upcast._faster, torch.bfloat16, True)
    calls = []
    real = upcast.upcast_linear
    monkeypatch.setattr(upcast, "upcast_linear", lambda *a, **k: calls.append(a[0].shape)
                        or real(*a, **k))
    torch.manual_seed(0)
    model = WINDOW["gemma3"]().eval().to(torch.bfloat16)
    draft = trimpass.self_drafter(model, inner="aot_eager")
    with torch.no_grad():
        model.generate(torch.randint(0, V, (1, 9)), assistant_model=draft, do_sample=False,
                       max_new_tokens=30, pad_token_id=0)
    reports = draft._trimpass_backend.reports
    assert len(reports) >= 2 and all(r.rewritten for r in reports), trimpass.explain(draft)
    assert calls  # the drafter's passes over several tokens ran upcast


def test_the_switch_forces_either_way_and_refuses_anything_else(monkeypatch):
    W = torch.randn(64, 8).bfloat16()
    monkeypatch.setenv("TRIMPASS_UPCAST", "0")
    assert upcast.Linear(W).calibrate() is False and upcast.faster(torch.float16) is False
    monkeypatch.setenv("TRIMPASS_UPCAST", "1")
    monkeypatch.setattr(upcast.measure, "faster", _never_timed)
    assert upcast.Linear(W).calibrate() is True
    monkeypatch.setenv("TRIMPASS_UPCAST", "yes")
    with pytest.raises(ValueError, match="TRIMPASS_UPCAST"):
        upcast.Linear(W).calibrate()
