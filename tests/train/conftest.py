"""Shared by the trainer tests: a tiny random Gemma-3 target (V=300, d=32), its target cache and
fresh drafters."""
import pytest
import torch

V, S, N = 300, 16, 8
KW = dict(tokens=20 * 2 * S, batch=2, lr=3e-4, gamma=3, ckpt_every=100)


def tiny(layers=3, vocab=V):
    import transformers
    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
        sliding_window=8, tie_word_embeddings=True)
    m = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        m.model.norm.weight.fill_(30.0)  # a peaky target: random init is near uniform
    return m


def fresh(target):
    from trimpass.models import drafter_from
    return drafter_from(target, 2)


@pytest.fixture(scope="module")
def target():
    pytest.importorskip("transformers")
    return tiny()


@pytest.fixture(scope="module")
def cache(target, tmp_path_factory):
    from trimpass.train.cache import build_cache
    ids = torch.randint(0, V, (N, S), generator=torch.Generator().manual_seed(1))
    return build_cache(target, ids, model_key="tiny", k=8,
                       directory=str(tmp_path_factory.mktemp("cache")))
