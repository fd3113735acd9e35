"""The low-rank weights file a drafter ships as, read without ``peft`` or the training package:
each adapted ``<name>.weight`` is stored as ``<name>.weight.lora_A`` ``[r, in]`` and
``<name>.weight.lora_B`` ``[out, r]`` (the LoRA scaling folded into B); :func:`merge_lowrank` adds
``B @ A`` to the named weights of any module, all checked first. Written by
:mod:`trimpass.train.lowrank`; loaded by :mod:`trimpass.models`."""
from __future__ import annotations

import torch

LORA_A, LORA_B = ".lora_A", ".lora_B"


def is_lowrank_key(key: str) -> bool:
    """Whether a state-dict key is a low-rank entry (an A or a B)."""
    return key.endswith(LORA_A) or key.endswith(LORA_B)


def lowrank_pairs(state: dict, tensors: dict[str, torch.Tensor]) -> list:
    """Check ``tensors`` (the format :func:`trimpass.train.lowrank.lowrank_tensors` writes)
    against a module's state dict: ``[(weight, A, B), ...]``, or ValueError for a missing partner
    or a shape that does not fit."""
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
    """Add each ``B @ A`` of ``[(weight, A, B), ...]`` to its weight in place."""
    with torch.no_grad():
        for w, a, b in pairs:
            w.add_((b.float() @ a.float()).to(w.dtype))
