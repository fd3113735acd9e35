"""The graph pass on many drafters: rewritten where it should be, untouched where it should not."""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import trimpass
from trimpass import ops
from trimpass.config import TrimConfig
from trimpass.graph.rewrite import rewrite
from trimpass.testing.models import EagleDrafter, MedusaHeads, Transformer

V = 512


def _vocab(n=200, V=V):
    return torch.randperm(V)[:n]


def _masked(ref, vocab):
    out = torch.full_like(ref, float("-inf"))
    out[..., vocab] = ref[..., vocab]
    return out


def _assert_trimmed(out, ref, vocab, tol=1e-4):
    exp = _masked(ref, vocab)
    assert torch.equal(torch.isneginf(out), torch.isneginf(exp)), "active/-inf pattern differs"
    fin = torch.isfinite(exp)
    assert (out[fin] - exp[fin]).abs().max() <= tol * exp[fin].abs().max()


def _compile(model, vocab, inner="aot_eager", **kw):
    be = trimpass.backend(vocab=vocab, inner=inner, **kw)
    return torch.compile(model, backend=be), be


class TiedLM(nn.Module):
    def __init__(self, V=V, d=48):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.norm = nn.LayerNorm(d)
        self.odd_name_for_a_head = nn.Linear(d, V)
        self.odd_name_for_a_head.weight = self.emb.weight

    def forward(self, ids):
        logits = self.odd_name_for_a_head(self.norm(self.emb(ids)))
        return torch.tanh(logits / 2.0 / 30.0) * 30.0


def test_pass_is_a_pure_function_on_a_traced_graph():
    m = TiedLM().eval()
    gm = torch.fx.symbolic_trace(m)
    before = gm.code
    vocab = _vocab()
    with torch.no_grad():
        new = rewrite(gm, TrimConfig(vocab=vocab))
    assert gm.code == before, "the input graph was edited"
    assert new is not gm and new.meta["trimpass"].rewritten == ["odd_name_for_a_head"]
    ids = torch.randint(0, V, (2, 5))
    with torch.no_grad():
        _assert_trimmed(new(ids), m(ids), vocab)
        assert torch.isfinite(new(ids)).sum() == 2 * 5 * len(vocab)  # softcap did not leak


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_gpt_fast_transformer_with_kv_cache(inner):
    m = Transformer(V, tied=True).eval()
    m.setup_caches(2, 32)
    vocab = _vocab()
    cm, be = _compile(m, vocab, inner, keep=[0])
    ids = torch.randint(0, V, (2, 6))
    ref_m = Transformer(V, tied=True).eval()
    ref_m.load_state_dict(m.state_dict())
    ref_m.setup_caches(2, 32)
    with torch.no_grad():
        for pos in range(4):
            ip = torch.arange(pos * 6, pos * 6 + 6) if pos == 0 else torch.tensor([5 + pos])
            x = ids if pos == 0 else ids[:, -1:]
            _assert_trimmed(cm(x, ip), ref_m(x, ip), torch.cat([vocab, torch.tensor([0])]))
    assert be.reports[0].rewritten


def test_eagle_drafter_logits_and_tree_topk():
    m = EagleDrafter(V).eval()
    vocab = _vocab(300)
    ids, hidden = torch.randint(0, V, (3, 4)), torch.randn(3, 4, 64)
    cm, be = _compile(m, vocab)
    topk = torch.compile(m.forward_topk, backend=trimpass.backend(vocab=vocab, inner="aot_eager"))
    with torch.no_grad():
        logits, h = cm(ids, hidden)
        ref_logits, ref_h = m(ids, hidden)
        _assert_trimmed(logits, ref_logits, vocab)
        assert torch.allclose(h, ref_h)
        values, top, _ = topk(ids, hidden, 5)
        ref_v, ref_top = torch.log_softmax(_masked(ref_logits[:, -1], vocab), -1).topk(5, dim=-1)
    assert torch.equal(top, ref_top) and torch.allclose(values, ref_v, atol=1e-5)


def test_medusa_every_head_rewritten():
    m = MedusaHeads(V, n=3).eval()
    vocab = _vocab()
    cm, be = _compile(m, vocab)
    ids = torch.randint(0, V, (2, 5))
    with torch.no_grad():
        _assert_trimmed(cm(ids), m(ids), vocab)
    assert len(be.reports[0].rewritten) == 4


class FunctionalHead(nn.Module):
    def __init__(self, d=40):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.w = nn.Parameter(torch.randn(V, d) / 7)
        self.decoy = nn.Linear(d, V)  # [V, d] too, but its output never reaches the graph output

    def forward(self, ids):
        h = self.emb(ids)
        side = self.decoy(h).sum(-1, keepdim=True)  # reaches the output, but not as logits
        return (h + side) @ self.w.T / 0.7


def test_functional_head_and_decoy():
    m = FunctionalHead().eval()
    vocab = _vocab()
    cm, be = _compile(m, vocab, inner="inductor")
    ids = torch.randint(0, V, (2, 3))
    with torch.no_grad():
        _assert_trimmed(cm(ids), m(ids), vocab)
    rep = be.reports[0]
    assert len(rep.rewritten) == 1 and any("feed" in why for _, why in rep.skipped)


class NoHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(24, 24)

    def forward(self, x):
        return torch.tanh(self.a(x)).softmax(-1)


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_model_without_head_is_bitwise_unchanged(inner):
    m = NoHead().eval()
    x = torch.randn(5, 24)
    with torch.no_grad():
        plain = torch.compile(m, backend=inner)(x)
        torch._dynamo.reset()
        with pytest.warns(trimpass.TrimpassWarning, match="no LM head"):
            out = torch.compile(m, backend=trimpass.backend(vocab=[1, 2], inner=inner))(x)
    assert torch.equal(out, plain)


def test_grad_mode_graph_left_unchanged():
    m = TiedLM()
    ids = torch.randint(0, V, (1, 4))
    with pytest.warns(trimpass.TrimpassWarning, match="gradients"):
        out = torch.compile(m, backend=trimpass.backend(vocab=[1, 2], inner="aot_eager"))(ids)
    assert torch.isfinite(out).all()


class DequantHead(nn.Module):
    """A weight-only int8 head as quantized drafters ship it: int8 rows, a per-row scale (and a
    zero point), dequantized inside the graph at every step."""

    def __init__(self, form, d=32):
        super().__init__()
        self.form = form
        self.emb = nn.Embedding(V, d)
        self.register_buffer("wq", torch.randint(-127, 127, (V, d), dtype=torch.int8))
        self.register_buffer("scale", torch.rand(V, 1) / 100 + 1e-3)
        self.register_buffer("zero", torch.randint(-3, 4, (V, 1), dtype=torch.int8))

    def forward(self, ids):
        h = self.emb(ids)
        if self.form == "linear":  # F.linear(x, wq.float() * scale)
            return F.linear(h, self.wq.float() * self.scale)
        # x @ (scale * (wq - zero)).T, the scale on the left, a zero point and a .to() cast
        return h @ (self.scale * (self.wq.to(torch.float32) - self.zero)).T


@pytest.mark.parametrize("form", ["linear", "matmul"])
def test_quantized_head_left_unchanged(form):
    m = DequantHead(form).eval()
    ids = torch.randint(0, V, (2, 3))
    be = trimpass.backend(vocab=[1, 2], inner="aot_eager")
    with torch.no_grad(), pytest.warns(
            trimpass.TrimpassWarning, match=r"quantized head \(weight dtype torch\.int8\)"):
        out = torch.compile(m, backend=be)(ids)
    with torch.no_grad():
        ref = m(ids)
    rep = be.reports[0]
    assert rep.rewritten == [] and len(rep.skipped) == 1
    assert rep.skipped[0][1] == "quantized head (weight dtype torch.int8): left unchanged"
    assert torch.isfinite(out).all() and torch.allclose(out, ref)  # every id, not trimmed


def test_results_follow_weight_updates_after_compile():
    m = TiedLM().eval()
    vocab = _vocab()
    cm, _ = _compile(m, vocab)
    ids = torch.randint(0, V, (2, 5))
    with torch.no_grad():
        cm(ids)
        m.emb.weight.mul_(-2.0)  # e.g. fine-tuning or load_state_dict: in place
        _assert_trimmed(cm(ids), m(ids), vocab)
        m.load_state_dict(TiedLM().state_dict())
        _assert_trimmed(cm(ids), m(ids), vocab)


def test_no_extra_recompiles_over_64_decode_steps():
    def run(backend):
        torch._dynamo.reset()
        torch.manual_seed(0)
        m = Transformer(V).eval()
        m.setup_caches(1, 80)
        cm = torch.compile(m, backend=backend, fullgraph=True)
        ids = torch.randint(0, V, (1, 8))
        with torch.no_grad():
            out = cm(ids, torch.arange(8))
            for pos in range(8, 72):
                out = cm(out[:, -1:].argmax(-1), torch.tensor([pos]))
        return torch._dynamo.utils.counters["stats"]["unique_graphs"]

    torch._dynamo.utils.counters.clear()
    plain = run("aot_eager")
    torch._dynamo.utils.counters.clear()
    trimmed = run(trimpass.backend(vocab=_vocab(), inner="aot_eager"))
    assert trimmed == plain


def test_kill_switch(monkeypatch):
    monkeypatch.setenv("TRIMPASS_DISABLE", "1")
    m = TiedLM().eval()
    ids = torch.randint(0, V, (1, 3))
    with torch.no_grad():
        out = torch.compile(m, backend=trimpass.backend(vocab=[1], inner="aot_eager"))(ids)
    assert torch.isfinite(out).all()


def test_mode_and_options_reach_inductor(monkeypatch):
    seen = {}
    real = torch._TorchCompileInductorWrapper

    class Spy(real):
        def __init__(self, mode, options, dynamic, name=None):
            seen.update(mode=mode, options=options)
            super().__init__(mode, options, dynamic)

    monkeypatch.setattr(torch, "_TorchCompileInductorWrapper", Spy)
    m = TiedLM().eval()
    with torch.no_grad():
        torch.compile(m, backend=trimpass.backend(vocab=[1]), mode="max-autotune-no-cudagraphs")(
            torch.randint(0, V, (1, 2)))
    assert seen["mode"] == "max-autotune-no-cudagraphs"


def test_compact_output_mode():
    m = TiedLM().eval()
    vocab = torch.tensor([3, 9, 100, 511])
    cm = trimpass.trim(TiedLM().eval(), vocab=vocab, output="compact", inner="aot_eager")
    cm.load_state_dict(m.state_dict())
    ids = torch.randint(0, V, (2, 3))
    with torch.no_grad():
        out = cm(ids)
        ids_map = trimpass.active_ids(cm)
        assert out.shape == (2, 3, 4) and torch.allclose(out, m(ids)[..., ids_map], atol=1e-5)


def test_op_counter_proves_the_trimmed_op_ran():
    m = TiedLM().eval()
    cm, _ = _compile(m, _vocab())
    before = ops.calls["head_compact"] + ops.calls["head_full"]
    with torch.no_grad():
        cm(torch.randint(0, V, (1, 2)))
        cm(torch.randint(0, V, (1, 2)))
    assert ops.calls["head_compact"] + ops.calls["head_full"] == before + 2


def test_warnings_are_not_raised_for_a_rewritten_graph():
    m = TiedLM().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", trimpass.TrimpassWarning)
        with torch.no_grad():
            _compile(m, _vocab())[0](torch.randint(0, V, (1, 2)))


W_GLOBAL = torch.randn(V, 40) / 6
LAST = torch.tensor([2])


class GlobalHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 40)

    def forward(self, ids):
        return self.emb(ids).index_select(1, LAST) @ W_GLOBAL.T


def test_anonymous_constants_as_head_weight_and_index():
    m = GlobalHead().eval()
    gm = torch.fx.symbolic_trace(m)
    consts = [n.target for n in gm.graph.nodes if n.op == "get_attr"]
    assert any(c.startswith("_tensor_constant") for c in consts)  # folded into anonymous constants
    vocab = _vocab()
    with torch.no_grad():
        new = rewrite(gm, TrimConfig(vocab=vocab))
        ids = torch.randint(0, V, (2, 4))
        _assert_trimmed(new(ids), m(ids), vocab)
    assert new.meta["trimpass"].rewritten == ["matmul"]
