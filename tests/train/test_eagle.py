"""trimpass.train.eagle on a tiny random Gemma-3 target (V=300, d=32): the untrained drafter passes
the target's feature through (so its first guesses are the target's own logits at that position),
training raises its agreement with the target, the checkpoint has vLLM's EAGLE names, bad
settings fail before compute."""
import json
import os

import pytest
import torch

pytest.importorskip("transformers")

from tests.train.conftest import S, V  # noqa: E402
from trimpass.train import eagle  # noqa: E402


@pytest.fixture(scope="module")
def feats(target, cache):
    return eagle.target_features(target, cache.ids)


def test_one_pass_gives_the_target_cache_and_its_features(target, cache, feats):
    """target_outputs runs the body once; its cache equals build_cache's (the full forward)."""
    got, f = eagle.target_outputs(target, cache.ids, k=cache.k)
    torch.testing.assert_close(f, feats)
    torch.testing.assert_close(got.topk_logits, cache.topk_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.lse, cache.lse, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.greedy, cache.greedy) and got.vocab_size == cache.vocab_size


def _drafter(target):
    torch.manual_seed(0)
    return eagle.EagleDrafter(target, heads=2, kv_heads=1, ffn=64)


def test_features_are_what_the_target_head_reads(target, cache, feats):
    """The cached features are the target's final hidden states after its final norm: the
    target's head over them gives its own logits, so its greedy tokens."""
    d = _drafter(target)
    assert feats.shape == (*cache.ids.shape, 32) and feats.dtype == torch.bfloat16
    h = d(cache.ids[:, 1:], feats[:, :-1].float())
    torch.testing.assert_close(h, feats[:, :-1].float())  # fc picks the feature, the layer adds 0
    top = d.logits(h).argmax(-1)
    assert (top == cache.greedy[:, :-1]).float().mean() > 0.95  # bf16 features: rare near-ties


def test_the_checkpoint_gives_vllms_unscaled_embedding_the_same_mix(target, cache, feats,
                                                                       tmp_path):
    """vLLM's EAGLE drafter reads the target's embedding table unscaled (Gemma scales its
    embeddings in its model's forward, which the drafter does not run): the saved fc applied to
    the table's rows mixes exactly what the drafter's fc mixes from Gemma's scaled embedding."""
    from safetensors.torch import load_file
    d = _drafter(target)
    with torch.no_grad():
        d.fc.weight.normal_()
    path = eagle.save_eagle(d, str(tmp_path / "eagle"))
    fc = load_file(os.path.join(path, "model.safetensors"))["fc.weight"]
    ids, f = cache.ids[:, 1:], feats[:, :-1].float()
    raw = target.get_input_embeddings().weight[ids]
    assert not torch.allclose(raw, target.get_input_embeddings()(ids))  # Gemma's are scaled
    with torch.no_grad():
        want = d.fc(torch.cat([target.get_input_embeddings()(ids), f], -1))
    torch.testing.assert_close(torch.cat([raw, f], -1) @ fc.T, want, atol=1e-4, rtol=1e-4)


def test_training_raises_agreement_with_the_target(target, cache, feats):
    d = _drafter(target)
    before = eagle.agreement(d, cache, feats)
    out = eagle.train_eagle(d, cache, feats, tokens=120 * 4 * (S - 1), batch=4, lr=3e-3,
                            core=0)
    after = eagle.agreement(d, cache, feats)
    assert out["steps"] == 120 and len(before) == len(after) == 2
    assert after[0] > before[0] + 0.2, (before, after)
    assert 0.0 <= after[1] <= 1.0


@pytest.mark.parametrize("loss, core", [("eal", 0), ("wtv", 64), ("eal", 64)])
def test_each_loss_trains_over_the_full_head_or_a_core(target, cache, feats, loss, core):
    d = _drafter(target)
    before = d.fc.weight.detach().clone()
    out = eagle.train_eagle(d, cache, feats, tokens=3 * 2 * (S - 1), batch=2, core=core,
                            loss=loss)
    assert out["steps"] == 3 and all(torch.isfinite(torch.tensor(out["losses"])))
    assert not torch.equal(d.fc.weight, before)


def test_the_checkpoint_has_vllms_eagle_names(target, tmp_path):
    d = _drafter(target)
    path = eagle.save_eagle(d, str(tmp_path / "eagle"))
    from safetensors import safe_open
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        names = set(f.keys())  # noqa: SIM118
    layer = {f"self_attn.{p}_proj.weight" for p in "qkvo"} | {"post_attention_layernorm.weight"} \
        | {f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    assert names == {"fc.weight"} | {"layers.0." + k for k in layer}
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_hidden_layers"] == 1
    assert cfg["hidden_size"] == 32 and cfg["vocab_size"] == V


@pytest.mark.parametrize("kw, match", [({"loss": "ce"}, "loss: 'ce'"), ({"ttt": 0}, "ttt: 0")])
def test_bad_settings_fail_before_compute(target, cache, feats, kw, match):
    with pytest.raises(ValueError, match=match):
        eagle.train_eagle(_drafter(target), cache, feats, tokens=100, **kw)
    with pytest.raises(ValueError, match="heads: 3 does not divide the target's hidden size 32"):
        eagle.EagleDrafter(target, heads=3)
