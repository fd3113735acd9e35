"""The models the project trains and ships, as plain Hugging Face causal-LM modules, and a writer
for checkpoints an engine can load. :func:`gemma3_270m` is the real Gemma-3-270M target (the GGUF
loader of ``trimpass.hf.gemma``, dequantized); :func:`gemma3_270m_drafter` is its self-speculative
drafter (the first N decoder layers, the final norm and the tied head, as ``truncated`` makes it)
deep-copied into an independent module, so training it never touches the target, optionally with
trained parameters loaded from a safetensors file (:func:`load_weights`); :func:`drafter_beside`
is the same drafter sharing the target's embedding and head, as it runs beside the target in one
process. All come back untrimmed, the first two in eval mode. :func:`save_hf` (from
:mod:`trimpass.hf.checkpoint`) writes a checkpoint vLLM and ``from_pretrained`` read.
"""
from __future__ import annotations

import copy
import os

import torch

from trimpass.hf.checkpoint import is_tied, save_hf
from trimpass.lowrank import add_pairs, is_lowrank_key, lowrank_pairs

__all__ = ["gemma3_270m", "gemma3_270m_drafter", "drafter_beside", "drafter_from", "load_weights",
           "save_hf", "is_tied"]


def gemma3_270m(dtype: torch.dtype = torch.float32):
    """The real Gemma-3-270M (Gemma3ForCausalLM, eval mode, full vocabulary). Shared (cached)."""
    from trimpass.hf.gemma import load_model
    return load_model(dtype).eval()


def drafter_from(target, layers: int = 2):
    """An independent copy of ``target``'s first ``layers`` decoder layers + final norm + head."""
    from trimpass.hf.gemma import truncated
    n = len(target.model.layers)
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= n:
        raise ValueError(f"layers must be an int in [1, {n}] (the target's decoder layers), "
                         f"got {layers!r}")
    draft = copy.deepcopy(truncated(target, layers))  # the memo keeps a tied head tied
    for p in draft.parameters():
        p.requires_grad_(False)
    return draft.eval()


SHIPPED = os.path.join(os.path.dirname(__file__), "weights", "gemma3_270m_drafter.safetensors")


def gemma3_270m_drafter(dtype: torch.dtype = torch.float32, layers: int = 2,
                        weights: str | None = "shipped"):
    """The Gemma-3-270M drafter: its first ``layers`` layers, independent of the target, with the
    trained weights that ship with trimpass (``weights="shipped"``, a low-rank delta written by
    ``python -m trimpass train``; see the README), another such file, or none (``None``: the
    untrained truncation)."""
    weights = _weights_file(weights, layers)
    draft = drafter_from(gemma3_270m(dtype), layers)
    if weights is not None:
        load_weights(draft, weights)
    return draft


def drafter_beside(target, layers: int = 2, weights: str | None = "shipped"):
    """The drafter as it runs beside ``target`` in one process: its own copies of ``target``'s
    first ``layers`` decoder layers and final norm, with ``weights`` loaded into them (as in
    :func:`gemma3_270m_drafter`), and the embedding and tied head *shared* with ``target``, not
    copied (168M parameters at Gemma-3-270M). With ``weights=None`` it is the plain truncation,
    sharing everything. Untrimmed; re-truncate or compile it as a drafter."""
    from trimpass.hf.gemma import truncated
    weights = _weights_file(weights, layers)
    draft = truncated(target, layers)
    if weights is not None:
        draft.model.layers = copy.deepcopy(draft.model.layers)
        draft.model.norm = copy.deepcopy(draft.model.norm)
        load_weights(draft, weights)
    return draft


def _weights_file(weights: str | None, layers: int) -> str | None:
    if weights != "shipped":
        return weights
    if layers != 2:
        raise ValueError("the shipped drafter has 2 layers; pass weights=None (untrained) or "
                         f"your own weights file for layers={layers}")
    return SHIPPED


def load_weights(module, path: str) -> None:
    """Load a safetensors file of (some of) ``module``'s parameters by state-dict name; unknown
    names or shapes raise ValueError naming the file before anything is copied."""
    from safetensors.torch import load_file
    try:
        sd = load_file(path)
    except Exception as e:  # safetensors raises its own error types
        raise ValueError(f"weights file {path} is unreadable or corrupt ({e})") from None
    own = module.state_dict()
    plain = {k: v for k, v in sd.items() if not is_lowrank_key(k)}
    bad = [k for k in plain if k not in own or own[k].shape != plain[k].shape]
    if bad:
        raise ValueError(f"weights file {path} does not fit this module: {bad[:4]} unknown or "
                         "misshapen (trained for another drafter or layer count?)")
    try:
        pairs = lowrank_pairs(own, {k: v for k, v in sd.items() if is_lowrank_key(k)})
    except ValueError as e:
        raise ValueError(f"weights file {path}: {e}") from None
    with torch.no_grad():
        for k, v in plain.items():
            own[k].copy_(v)
    add_pairs(pairs)
