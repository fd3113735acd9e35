"""Small hand-written drafters used by the tests, the benchmarks and the reference loops.

``Transformer`` is a gpt-fast-style decoder with a static KV cache (``forward(ids, input_pos)``);
``EagleDrafter`` is an EAGLE-style drafter: one decoder layer over ``[token embedding ; target
hidden state]`` with its own LM head; ``MedusaHeads`` puts several LM heads on one hidden state.
None of them knows about trimpass. Weights are random (shapes and timing only, or as a stand-in
target).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Block(nn.Module):
    """Pre-norm attention + MLP with an optional static KV cache ``[B, H, S_max, hd]``."""

    def __init__(self, d: int, n_heads: int, ffn: int):
        super().__init__()
        self.n_heads, self.hd = n_heads, d // n_heads
        self.attn_norm, self.mlp_norm = RMSNorm(d), RMSNorm(d)
        self.wqkv = nn.Linear(d, 3 * d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)
        self.w1 = nn.Linear(d, ffn, bias=False)
        self.w2 = nn.Linear(ffn, d, bias=False)
        self.register_buffer("k_cache", None, False)
        self.register_buffer("v_cache", None, False)

    def setup_cache(self, batch: int, max_len: int, dtype, device):
        shape = (batch, self.n_heads, max_len, self.hd)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), False)

    def forward(self, x, input_pos=None):
        B, S, _ = x.shape
        q, k, v = self.wqkv(self.attn_norm(x)).split(self.n_heads * self.hd, dim=-1)
        q, k, v = (t.view(B, S, self.n_heads, self.hd).transpose(1, 2) for t in (q, k, v))
        if self.k_cache is not None and input_pos is not None:
            self.k_cache.index_copy_(2, input_pos, k)
            self.v_cache.index_copy_(2, input_pos, v)
            k, v = self.k_cache, self.v_cache
            mask = torch.arange(k.shape[2], device=x.device)[None, :] <= input_pos[:, None]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None])
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # no SymBool: S may vary
        x = x + self.wo(y.transpose(1, 2).reshape(B, S, -1))
        return x + self.w2(F.silu(self.w1(self.mlp_norm(x))))


class Transformer(nn.Module):
    """gpt-fast-style causal LM: ``forward(ids[B, S], input_pos[S]) -> logits[B, S, V]``."""

    def __init__(self, vocab: int = 512, d: int = 64, layers: int = 2, n_heads: int = 4,
                 ffn: int = 128, tied: bool = False):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, n_heads, ffn) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.output = nn.Linear(d, vocab, bias=False)
        if tied:
            self.output.weight = self.tok_embeddings.weight

    def setup_caches(self, batch: int, max_len: int):
        p = self.tok_embeddings.weight
        for layer in self.layers:
            layer.setup_cache(batch, max_len, p.dtype, p.device)

    def forward(self, ids, input_pos=None):
        x = self.tok_embeddings(ids)
        for layer in self.layers:
            x = layer(x, input_pos)
        return self.output(self.norm(x))


class EagleDrafter(nn.Module):
    """EAGLE-style: ``fc([embed(ids) ; hidden]) -> one block -> norm -> own head``.

    ``forward(ids, hidden)`` returns ``(logits, new_hidden)``; ``forward_topk`` returns the tree
    expansion's top-``k`` log-probabilities and ids (what an EAGLE-2 tree step consumes).
    """

    def __init__(self, vocab: int = 512, d: int = 64, n_heads: int = 4, ffn: int = 128):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.block = Block(d, n_heads, ffn)
        self.norm = RMSNorm(d)
        self.lm = nn.Linear(d, vocab, bias=False)

    def forward(self, ids, hidden):
        h = self.block(self.fc(torch.cat([self.embed(ids), hidden], dim=-1)))
        return self.lm(self.norm(h)), h

    def forward_topk(self, ids, hidden, k: int = 4):
        logits, h = self(ids, hidden)
        values, top = torch.topk(torch.log_softmax(logits[:, -1], dim=-1), k, dim=-1)
        return values, top, h


class MedusaHeads(nn.Module):
    """A base LM plus ``n`` extra heads predicting further tokens (Medusa-style), stacked."""

    def __init__(self, vocab: int = 512, d: int = 64, n: int = 3):
        super().__init__()
        self.base = Transformer(vocab, d, layers=1)
        self.extra = nn.ModuleList(nn.Linear(d, vocab) for _ in range(n))

    def forward(self, ids):
        h = self.base.norm(self.base.layers[0](self.base.tok_embeddings(ids)))
        heads = [self.base.output(h)] + [lin(F.silu(h)) for lin in self.extra]
        return torch.stack(heads, dim=0)
