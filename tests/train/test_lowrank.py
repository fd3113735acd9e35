"""trimpass.train.lowrank and the trainer's ``lora_rank``: LoRA training lowers the loss and moves
only the adapted layers and norms; the shipped low-rank file, loaded into a fresh drafter without
peft, gives the trained drafter's logits; the file is small; a low-rank file that does not fit
fails before any weight changes."""
import pytest
import torch

pytest.importorskip("peft")
from tests.train.conftest import KW, fresh  # noqa: E402
from trimpass.models import load_weights  # noqa: E402
from trimpass.train.lowrank import LORA_A, LORA_B  # noqa: E402
from trimpass.train.trainer import evaluate, train  # noqa: E402


def _logits(d, ids):
    with torch.no_grad():
        return d(input_ids=ids).logits


def test_lora_training_lowers_the_loss_and_ships_as_a_small_delta(target, cache, tmp_path):
    d = fresh(target)
    before = evaluate(d, cache, loss="kl")
    frozen = {n: p.clone() for n, p in d.named_parameters()
              if not n.startswith("model.layers.1.") and not n.startswith("model.norm")}
    train(d, cache, loss="kl", out_dir=str(tmp_path), lora_rank=4, train_layers=1,
          **dict(KW, lr=3e-3))
    assert evaluate(d, cache, loss="kl") < before
    names = [n for n, _ in d.named_parameters()]
    assert not any("lora_" in n for n in names)  # folded back: the plain HF class again
    for n, p in d.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
    from safetensors.torch import load_file
    sd = load_file(str(tmp_path / "drafter.safetensors"))
    a_keys = [k for k in sd if k.endswith(LORA_A)]
    assert len(a_keys) == 7 and all(sd[k].shape[0] == 4 for k in a_keys)
    assert not any(k.startswith("model.layers.0.") for k in sd)
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(5))
    shipped = fresh(target)
    assert not torch.allclose(_logits(shipped, ids), _logits(d, ids), atol=1e-4)
    load_weights(shipped, str(tmp_path / "drafter.safetensors"))
    torch.testing.assert_close(_logits(shipped, ids), _logits(d, ids), rtol=1e-4, atol=1e-4)


def test_a_lowrank_file_that_does_not_fit_changes_nothing(target, tmp_path):
    from safetensors.torch import save_file
    d = fresh(target)
    key = "model.layers.1.mlp.up_proj.weight"
    good = {"model.norm.weight": torch.zeros(32), key + LORA_A: torch.ones(2, 32),
            key + LORA_B: torch.ones(64, 2)}
    for bad in ({**good, key + LORA_A: torch.ones(2, 31)}, {k: v for k, v in good.items()
                                                          if not k.endswith(LORA_B)}):
        save_file(bad, str(tmp_path / "w.safetensors"))
        before = {n: p.clone() for n, p in d.state_dict().items()}
        with pytest.raises(ValueError, match="w.safetensors"):
            load_weights(d, str(tmp_path / "w.safetensors"))
        for n, p in d.state_dict().items():
            assert torch.equal(p, before[n]), n
    save_file(good, str(tmp_path / "w.safetensors"))
    w = d.state_dict()[key].clone()
    load_weights(d, str(tmp_path / "w.safetensors"))
    torch.testing.assert_close(d.state_dict()[key], w + 2.0)
