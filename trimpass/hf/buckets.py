"""The shapes the fused loop compiles, chosen so that no prompt length compiles a new graph:
drafting runs one token at a time (a static shape), every pass over more tokens (a prompt's chunk
of up to ``CHUNK`` tokens, a batched verification) has a dynamic row count, and the static KV cache
holds the request's positions rounded up to a multiple of ``GRANULE``, with its length dimension
dynamic in every graph (:class:`BucketLayer`). So two graphs serve every prompt from 1 token to the
context, each compiled once. A step's attention covers the cache's capacity, so its cost follows
the tokens the request holds (within ``GRANULE`` positions), not the largest prompt seen. Why these
sizes: ``docs/fused.md``.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, StaticLayer

# a prompt longer than CHUNK is prefilled in passes of CHUNK tokens: the attention scores of one
# pass (heads x CHUNK x capacity, fp32) stay small however long the context
CHUNK = 512
GRANULE = 256
MIN_CAPACITY = GRANULE


class BucketLayer(StaticLayer):
    """A full-length static layer whose length dimension stays symbolic in a compiled graph: its
    buffers have static addresses without a guard on them (a guarded one would specialize their
    shape) and its mask sizes are read from the buffer, not from a Python int Dynamo would guard
    on."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        rows = (self.batch_size, self.num_heads, self.max_cache_len)
        self.keys = torch.zeros(*rows, self.k_head_dim, dtype=self.dtype, device=self.device)
        self.values = torch.zeros(*rows, self.v_head_dim, dtype=self.dtype, device=self.device)
        torch._dynamo.maybe_mark_dynamic(self.keys, 2)
        torch._dynamo.maybe_mark_dynamic(self.values, 2)
        self.cumulative_length = self.cumulative_length.to(self.device)
        for t in (self.keys, self.values, self.cumulative_length):
            # static addresses, so a CUDA-graph tree neither copies nor refuses these mutated
            # buffers; guard=False keeps the length dimension symbolic (no shape specialization)
            torch._dynamo.mark_static_address(t, guard=False)
        self.is_initialized = True

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_max_length(self) -> int:
        return self.keys.shape[2]


def context_of(model) -> int | None:
    """The model's positions (``max_position_embeddings``), or None where its config has none."""
    cfg = model.config.get_text_config(decoder=True)
    n = getattr(cfg, "max_position_embeddings", None)
    return int(n) if isinstance(n, int) and n > 0 else None


def capacity_for(tokens: int, context: int | None) -> int:
    """The cache for a request of ``tokens`` positions: rounded up to a multiple of ``GRANULE``,
    at most the model's context (``check_length`` keeps a request within it)."""
    cap = -(-max(tokens, 1) // GRANULE) * GRANULE
    return max(tokens, min(cap, context)) if context is not None else cap


def check_length(prompt: int, max_new_tokens: int, context: int | None) -> None:
    """A clear error, before any compute, for a request that does not fit the model's positions."""
    if context is None:
        return
    if prompt > context:
        raise ValueError(f"input_ids: a prompt of {prompt} tokens is longer than the model's "
                         f"context of {context} positions (max_position_embeddings); shorten it")
    if prompt + max_new_tokens > context:
        raise ValueError(f"max_new_tokens: {prompt} prompt tokens + {max_new_tokens} new ones "
                         f"pass the model's {context} positions (max_position_embeddings); ask "
                         f"for at most {context - prompt}")


def new_cache(model, capacity: int) -> Cache:
    """An empty static cache of ``capacity`` positions for every layer of ``model`` (batch 1)."""
    cfg = model.config.get_text_config(decoder=True)
    p = next(model.parameters())
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cache = Cache(layers=[BucketLayer(capacity) for _ in range(cfg.num_hidden_layers)])
    cache.early_initialization(1, heads, dim, p.dtype, p.device)
    return cache
