"""trimpass.hf.decode_attention: a one-token step's attention in fp32 products matches an fp64
reference (GQA, bool, additive and no masks, odd sizes), every other call is HF's ``sdpa`` bit for
bit, and a self-drafter runs it in its own layers while the model it copies keeps ``sdpa``."""
import pytest
import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import trimpass
from tests.graph.test_hf import V
from tests.hf.test_selfdraft import MODELS
from trimpass.hf import decode_attention as D

TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3}


class _Module(torch.nn.Module):
    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def _reference(q, k, v, visible, scale):
    g = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(g, dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q.double(), k, v, attn_mask=visible, scale=scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask", ["bool", "additive", None])
@pytest.mark.parametrize("heads", [(4, 1), (6, 2), (3, 3)])
def test_one_query_matches_a_float64_reference(dtype, mask, heads):
    g = torch.Generator().manual_seed(hash((str(dtype), mask, heads)) % 2**31)
    H, Hkv = heads
    B, N, Dh = 2, 37 + H, 24
    q = torch.randn(B, H, 1, Dh, generator=g).to(dtype)
    k, v = (torch.randn(B, Hkv, N, Dh, generator=g).to(dtype) for _ in range(2))
    visible = torch.rand(B, 1, 1, N, generator=g) > 0.4
    visible[..., -1] = True  # the query sees itself
    m = {"bool": visible, "additive": torch.zeros(B, 1, 1, N).masked_fill(~visible, -torch.inf),
         None: None}[mask]
    got, weights = D.attention(_Module(H // Hkv), q, k, v, m, scaling=0.3)
    want = _reference(q, k, v, visible if mask else None, 0.3)
    assert weights is None and got.dtype == dtype and got.shape == (B, 1, H, Dh)
    err = (got.double().transpose(1, 2) - want).abs().max().item()
    assert err < TOL[dtype] * want.abs().max().item(), err


@pytest.mark.parametrize("case", ["several queries", "fp32", "dropout"])
def test_every_other_call_is_hf_sdpa_bit_for_bit(case):
    torch.manual_seed(3)
    M, dtype = (5, torch.bfloat16) if case == "several queries" else (1, torch.float32
                                                                      if case == "fp32"
                                                                      else torch.bfloat16)
    q = torch.randn(1, 4, M, 16).to(dtype)
    k, v = (torch.randn(1, 2, 29, 16).to(dtype) for _ in range(2))
    mask = torch.ones(1, 1, M, 29, dtype=torch.bool).tril(29 - M)
    drop = 0.5 if case == "dropout" else 0.0
    torch.manual_seed(9)
    got, _ = D.attention(_Module(2), q, k, v, mask, dropout=drop, scaling=0.25)
    torch.manual_seed(9)
    want, _ = sdpa_attention_forward(_Module(2), q, k, v, mask, dropout=drop, scaling=0.25)
    assert torch.equal(got, want)


def test_a_self_drafter_runs_it_in_its_own_layers_and_the_model_keeps_sdpa(monkeypatch):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MODELS["gemma3"]().eval().to(torch.bfloat16)
    model.set_attn_implementation("sdpa")
    draft = trimpass.self_drafter(model, gamma=3, confidence=0.0, learn_core=64,
                                  inner="aot_eager")
    mine = [m for m in draft.modules() if hasattr(m, "q_proj")]
    theirs = [m for m in model.modules() if hasattr(m, "q_proj")]
    assert len(mine) == len(theirs) == model.config.num_hidden_layers
    assert all(a is not b and a.q_proj is b.q_proj for a, b in zip(mine, theirs, strict=True))
    assert {m.config._attn_implementation for m in mine} == {D.NAME}
    assert {m.config._attn_implementation for m in theirs} == {"sdpa"}

    calls, target_running = {"draft": 0, "target": 0}, [False]
    one_query = D._one_query

    def counted(*args):
        calls["target" if target_running[0] else "draft"] += 1
        return one_query(*args)

    monkeypatch.setattr(D, "_one_query", counted)
    model.register_forward_pre_hook(lambda *_: target_running.__setitem__(0, True))
    model.register_forward_hook(lambda *_: target_running.__setitem__(0, False))
    ids = torch.randint(0, V, (1, 11))
    with torch.no_grad():
        model.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=10,
                       pad_token_id=0)
    layers = model.config.num_hidden_layers  # each one-token drafting step, in every layer
    assert calls["draft"] >= 4 * layers and calls["draft"] % layers == 0, calls
    assert calls["target"] == 0, calls
