"""Row-invariant verification: a target whose logits at a position do not depend on how many
positions its pass computes, so k tokens verified in one pass give, bit for bit, what k one-token
decoding steps give, and speculative decoding in bf16 stays lossless.

On this CPU in bf16 that does not hold by itself: with several queries the attention's softmax and
weighted sum run over the padded, masked key range (one query: over its visible keys only), and a
linear layer multiplies one row with another kernel than several rows (Gemma-3's ``down_proj``,
K = 2,048, rounds a few rows in 32 differently). Measured on the real Gemma-3-270M: one pass over
5 tokens and 5 one-token steps differ from layer 3 with ``sdpa`` and from layer 8 with ``eager``,
and near-ties in the greedy output flip. :func:`use` makes a model row-invariant while *it* runs:
each query row attends alone over exactly its visible keys (what a one-token step computes for
it), and a linear layer given one row multiplies it as the first of two, the kernel multi-row
calls use. bf16 only: in fp32 this CPU's kernels give a row a result that depends on its place in
the batch (a fifth row differs from the first four), which no padding of a one-row call matches.
Checked bit for bit by ``tests/hf/test_exact.py``; the cost is a loop over query rows. Modules the
model shares with a drafter (a truncated drafter's layers, a tied head) change only while the model
itself runs: the drafter's own calls see plain ``F.linear`` and ``sdpa``.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from trimpass.ops import threads

NAME = "trimpass_exact"


class _Running:
    """Set while a model made row-invariant runs its forward (and only then), with the visible
    key ranges of the masks seen in that forward."""
    on = False
    ranges: dict = {}


def _visible(mask: torch.Tensor | None, M: int, N: int) -> list[tuple[int, int]]:
    """[start, end) of the keys each of ``M`` query rows may see under an additive (0 = visible)
    or boolean (True = visible) mask [M, N], or all ``N`` keys without one; each row's visible
    keys must form one range (causal, sliding window, left padding)."""
    if mask is None:
        return [(0, N)] * M
    seen = mask if mask.dtype == torch.bool else mask == 0
    count = seen.sum(-1)
    start = seen.int().argmax(-1)
    last = seen.flip(-1).int().argmax(-1)
    ranges = []
    for s, n, t in zip(start.tolist(), count.tolist(), last.tolist(), strict=True):
        if n and N - t - s != n:
            raise ValueError("trimpass_exact attention: a query row's visible keys are not one "
                             "contiguous range; use another attn_implementation for this mask")
        ranges.append((s, s + n))
    return ranges


def _ranges(attention_mask, b: int, M: int, N: int) -> list[tuple[int, int]]:
    """:func:`_visible` for batch row ``b``, computed once per mask and forward: every layer of a
    kind receives the same mask tensor, held here so its identity cannot be reused."""
    if attention_mask is None:
        return [(0, N)] * M
    memo = _Running.ranges
    key = (id(attention_mask), b, M, N)
    if key not in memo or memo[key][0] is not attention_mask:
        memo[key] = (attention_mask, _visible(attention_mask[b, 0, :, :N], M, N))
    return memo[key][1]


def _rowwise_attention(query, key, value, attention_mask, scaling):
    B, H, M, D = query.shape
    Hkv, N = key.shape[1], key.shape[2]
    scale = D ** -0.5 if scaling is None else scaling
    out = query.new_zeros(B, M, H, D)  # a padded query row (no visible key) stays 0, never read
    with threads(1):  # these ops are tiny: waking a second thread costs more than each op
        for b in range(B):
            for i, (s, e) in enumerate(_ranges(attention_mask, b, M, N)):
                if e > s:  # the heads sharing a KV head are this row's queries, all see [s, e)
                    q = query[b:b + 1, :, i].reshape(1, Hkv, H // Hkv, D)
                    o = F.scaled_dot_product_attention(q, key[b:b + 1, :, s:e],
                                                       value[b:b + 1, :, s:e], scale=scale)
                    out[b, i] = o.reshape(H, D)
    return out


def exact_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                    softcap=None, **kwargs):
    """HF attention-interface function: ``query`` [B, H, M, D], ``key``/``value`` [B, Hkv, N, D],
    ``attention_mask`` additive [B, 1, M, N] or None (every key visible). While a row-invariant
    model runs, each row attends alone over its own keys (one ``sdpa`` call per row, its heads
    as queries; 3x faster here than eager's four ops a row); otherwise (a drafter that copied the
    model's config) HF's ``sdpa``.
    Returns ([B, M, H, D], None), as HF's attention functions do."""
    if not _Running.on:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if softcap is not None or (dropout and module.training):
        raise ValueError("trimpass_exact attention: softcapping and dropout are not supported; "
                         "use another attn_implementation")
    return _rowwise_attention(query, key, value, attention_mask, scaling), None


def _row_invariant_linear(self, x):
    """``nn.Linear.forward`` that, while a row-invariant model runs, never multiplies one row
    alone: it runs as the first of two (the same row twice), the kernel multi-row calls use."""
    if not _Running.on or x.numel() != x.shape[-1]:
        return torch.nn.functional.linear(x, self.weight, self.bias)
    pair = x.reshape(1, -1).repeat(2, 1)
    out = torch.nn.functional.linear(pair, self.weight, self.bias)[:1]
    return out.reshape(*x.shape[:-1], self.weight.shape[0])


def _enter(module, args, kwargs):
    module._trimpass_outer = _Running.on
    _Running.on = True
    _Running.ranges = {}


def _leave(module, args, kwargs, output):
    _Running.on = module._trimpass_outer
    _Running.ranges = {}  # the masks are the forward's own: let them go


def use(model) -> None:
    """Make ``model`` (an HF model, bf16) row-invariant while it runs, in place (idempotent)."""
    dtype = next(model.parameters()).dtype
    if dtype != torch.bfloat16:
        raise ValueError(f"model: row-invariant verification is bf16 only, got {dtype}; convert "
                         "it with model.to(torch.bfloat16) (fp32 kernels are not row-invariant "
                         "here: see trimpass.hf.exact)")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    AttentionInterface.register(NAME, exact_attention)
    AttentionMaskInterface.register(NAME, eager_mask)
    model.set_attn_implementation(NAME)
    for mod in model.modules():
        if type(mod) is torch.nn.Linear:
            mod.forward = types.MethodType(_row_invariant_linear, mod)
    if not getattr(model, "_trimpass_exact", False):
        model.register_forward_pre_hook(_enter, with_kwargs=True)
        model.register_forward_hook(_leave, with_kwargs=True, always_call=True)
        model._trimpass_exact = True
