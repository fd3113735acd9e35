"""Attention for a one-token step in bf16 on the CPU, for the modules trimpass compiles and runs
itself (a :func:`trimpass.self_drafter`, the fused loop's body); never for the user's own model.

PyTorch 2.13's CPU ``scaled_dot_product_attention`` (its flash kernel) is slow for a single query
in reduced precision: on Gemma-3-270M's shapes (4 query heads on 1 KV head of 256) it takes
0.90 ms over 1,024 keys in bf16, against 0.16 ms for the same products and softmax in fp32, 0.09
ms for the flash kernel in fp32, and 0.29 ms for 4 queries in bf16 (``bench/results/
decode_attention.md``). A decoding step pays it in every layer, and it grows with the context: at
1,024 tokens it is about half of a compiled drafting step. :func:`attention` computes a single
query's attention as two products and a softmax in fp32 (each query head against its KV head, no
repeated keys) and leaves every other call (several queries, fp32, another device, dropout,
softcapping, a position bias) to Hugging Face's ``sdpa``, masks included. :func:`rebind` gives a
module tree its own config, so that setting it (:data:`NAME`) leaves the model it copies alone.
"""
from __future__ import annotations

import copy

import torch

NAME = "trimpass_decode"
REDUCED = (torch.bfloat16, torch.float16)


def _one_query(query, key, value, attention_mask, scaling):
    B, H, _, D = query.shape
    Hkv, N = key.shape[1], key.shape[2]
    q = query.reshape(B, Hkv, H // Hkv, D).float()  # the heads that share a KV head, as rows
    scores = (q @ key.float().transpose(-1, -2)) * (D ** -0.5 if scaling is None else scaling)
    if attention_mask is not None:
        m = attention_mask[:, :, -1:, -N:]  # [B or 1, 1, 1, N]: broadcast over the group's rows
        scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores + m
    out = torch.softmax(scores, dim=-1) @ value.float()
    return out.to(query.dtype).reshape(B, 1, H, D)  # HF's layout: [B, M, H, D]


def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """HF attention-interface function: ``query`` [B, H, M, D], ``key``/``value`` [B, Hkv, N, D],
    ``attention_mask`` boolean (True = visible) or additive [B, 1, M, N], or None (every key
    visible). One query in bf16/fp16 on the CPU: fp32 products; otherwise HF's ``sdpa``.
    Returns ([B, M, H, D], None), as HF's attention functions do."""
    if (query.shape[2] == 1 and query.dtype in REDUCED and query.device.type == "cpu"
            and not dropout and kwargs.get("softcap") is None
            and kwargs.get("position_bias") is None and query.shape[1] % key.shape[1] == 0):
        return _one_query(query, key, value, attention_mask, scaling), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, **kwargs)


def register() -> None:
    """Make :data:`NAME` known to Hugging Face, with ``sdpa``'s masks (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def applies(config) -> bool:
    """Whether a copy of a model with ``config`` should run :func:`attention`: where the model runs
    ``sdpa`` (or trimpass's row-invariant attention, which a copy does not need)."""
    from trimpass.hf import exact
    return getattr(config, "_attn_implementation", None) in ("sdpa", exact.NAME)


def copy_config(config):
    """A deep copy of ``config`` for a copy of the model that trimpass runs itself, set to
    :data:`NAME` where it :func:`applies` (the text config too)."""
    out = copy.deepcopy(config)
    if applies(out):
        register()
        for c in {id(c): c for c in (out, out.get_text_config(decoder=True))}.values():
            c._attn_implementation = NAME
    return out


def configs(old, new) -> dict:
    """id(a config of the model) -> the copy's: the model's config and its text config."""
    return {id(old): new, id(old.get_text_config(decoder=True)): new.get_text_config(decoder=True)}


def rebind(module: torch.nn.Module, to: dict) -> torch.nn.Module:
    """``module`` again, every submodule whose ``config`` is a key of ``to`` (by id) shallow-copied
    to read the config it maps to, and the containers above them copied too; parameters, buffers,
    hooks and every other submodule stay shared. ``module`` itself where nothing reads them."""
    children = {name: rebind(child, to) if child is not None else None
                for name, child in module._modules.items()}
    mine = id(getattr(module, "config", None)) in to
    if not mine and all(children[k] is module._modules[k] for k in children):
        return module
    out = copy.copy(module)
    out._modules = children  # copy.copy shares the dict: never edit the original's
    if mine:
        out.config = to[id(module.config)]
    return out
