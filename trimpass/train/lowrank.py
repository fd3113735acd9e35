"""Low-rank (LoRA) training of a drafter's decoder layers, and the small weights file it ships as.
:func:`add_lora` injects ``peft`` LoRA adapters in place into every linear layer of the drafter's
last ``layers`` decoder layers (the module stays the same Hugging Face class, so the trainer's code
paths do not change); :func:`lowrank_tensors` reads them back as a plain dict, each adapted
``<name>.weight`` stored as ``<name>.weight.lora_A`` ``[r, in]`` and ``<name>.weight.lora_B``
``[out, r]`` with the LoRA scaling folded into B; :func:`merge_lowrank` adds ``B @ A`` to the named
weights of any module (no ``peft`` needed to load a shipped drafter); :func:`unload` folds the
adapters into the base weights and removes them, leaving the plain module an engine loads.
"""
from __future__ import annotations

import torch

__all__ = ["add_lora", "lowrank_tensors", "merge_lowrank", "unload", "LORA_A", "LORA_B",
           "is_lowrank_key", "lowrank_pairs", "add_pairs"]

LORA_A, LORA_B = ".lora_A", ".lora_B"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_lowrank_key(key: str) -> bool:
    return key.endswith(LORA_A) or key.endswith(LORA_B)


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


def lowrank_pairs(state: dict, tensors: dict[str, torch.Tensor]) -> list:
    """Check ``tensors`` (the format of :func:`lowrank_tensors`) against a module's state dict:
    ``[(weight, A, B), ...]``, or ValueError for a missing partner or a shape that does not fit."""
    pairs = []
    for key in (k for k in tensors if k.endswith(LORA_A)):
        base, b_key = key[:-len(LORA_A)], key[:-len(LORA_A)] + LORA_B
        if b_key not in tensors or base not in state:
            raise ValueError(f"low-rank entry {key!r} has no {b_key!r} or no weight {base!r} "
                             "in this module (trained for another drafter?)")
        a, b, w = tensors[key], tensors[b_key], state[base]
        if a.dim() != 2 or b.dim() != 2 or (b.shape[0], a.shape[1]) != tuple(w.shape) \
                or a.shape[0] != b.shape[1]:
            raise ValueError(f"low-rank entry {key!r} does not fit {base!r} {tuple(w.shape)}")
        pairs.append((w, a, b))
    if sum(k.endswith(LORA_B) for k in tensors) != len(pairs):
        raise ValueError("a low-rank B entry has no A partner")
    return pairs


def merge_lowrank(module, tensors: dict[str, torch.Tensor]) -> None:
    """Add ``B @ A`` from ``tensors`` to ``module``'s weights in place, all checked first."""
    add_pairs(lowrank_pairs(module.state_dict(), tensors))


def add_pairs(pairs) -> None:
    with torch.no_grad():
        for w, a, b in pairs:
            w.add_((b.float() @ a.float()).to(w.dtype))


def unload(module) -> None:
    """Fold the injected adapters into the base weights and put the plain linear layers back."""
    for name, m in list(_adapted(module)):
        m.merge()
        parent = module.get_submodule(name.rsplit(".", 1)[0])
        setattr(parent, name.rsplit(".", 1)[1], m.get_base_layer())
