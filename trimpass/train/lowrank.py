"""Low-rank (LoRA) training of a drafter's decoder layers; the weights file it ships as, and its
loading, are :mod:`trimpass.lowrank`'s. :func:`add_lora` injects ``peft`` LoRA adapters in place
into every linear layer of the drafter's last ``layers`` decoder layers (the module stays the same
Hugging Face class, so the trainer's code paths do not change); :func:`lowrank_tensors` reads them
back as a plain dict in that file's format; :func:`unload` folds the adapters into the base
weights and removes them, leaving the plain module an engine loads.
"""
from __future__ import annotations

import torch

from trimpass.lowrank import LORA_A, LORA_B, merge_lowrank

__all__ = ["add_lora", "lowrank_tensors", "merge_lowrank", "unload", "LORA_A", "LORA_B"]

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def add_lora(drafter, rank: int, layers: int, alpha: float | None = None):
    """Inject rank-``rank`` LoRA adapters into the linear layers of the last ``layers`` decoder
    layers of ``drafter`` (in place); returns the adapter parameters (B starts at zero, so the
    drafter's outputs are unchanged until it trains)."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        raise ImportError("lora_rank needs peft: pip install 'trimpass[hf]'") from None
    n = len(drafter.model.layers)
    cfg = LoraConfig(r=rank, lora_alpha=alpha or rank, lora_dropout=0.0, target_modules=[
        f"model.layers.{i}.{part}.{t}" for i in range(n - layers, n)
        for part in ("self_attn", "mlp") for t in TARGETS
        if hasattr(getattr(drafter.model.layers[i], part), t)])
    inject_adapter_in_model(cfg, drafter)
    return [p for name, p in drafter.named_parameters() if "lora_" in name]


def _adapted(module):
    from peft.tuners.lora import Linear
    for name, m in module.named_modules():
        if isinstance(m, Linear):
            yield name, m


def lowrank_tensors(module) -> dict[str, torch.Tensor]:
    """The injected adapters as ``{<base weight name>.lora_A: [r, in], ....lora_B: [out, r]}``
    with the scaling folded into B, ready for :func:`merge_lowrank`."""
    out = {}
    for name, m in _adapted(module):
        a, b = m.lora_A["default"].weight, m.lora_B["default"].weight
        out[f"{name}.weight{LORA_A}"] = a.detach().clone().contiguous()
        out[f"{name}.weight{LORA_B}"] = (b.detach() * m.scaling["default"]).contiguous()
    return out


def unload(module) -> None:
    """Fold the injected adapters into the base weights and put the plain linear layers back."""
    for name, m in list(_adapted(module)):
        m.merge()
        parent = module.get_submodule(name.rsplit(".", 1)[0])
        setattr(parent, name.rsplit(".", 1)[1], m.get_base_layer())
