"""The shapes the fused loop compiles, chosen so that no prompt length compiles a new graph: a
prompt is prefilled in chunks of ``CHUNK`` tokens (its last chunk padded), drafting runs one token
at a time, and the static KV cache comes in power-of-two capacities from ``MIN_CAPACITY`` up to the
model's context, with its length dimension dynamic in every graph (:class:`BucketLayer`). So two
graphs serve every prompt from 1 token to the context: the chunk and the one-token step, each
compiled once. A step's attention covers the cache's capacity, the smallest bucket that holds the
prompt and its new tokens: its cost follows the tokens the cache holds, within a factor of two, not
the largest prompt seen. Why these sizes: ``docs/fused.md``.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, StaticLayer

# 64 rows keep a chunk's matmuls efficient (bf16 AMX tiles are 16 rows) while a short prompt pays
# little for its padding: about 73 ms a chunk against 35 ms a one-token step (real Gemma-3, bf16)
CHUNK = 64
MIN_CAPACITY = 256


class BucketLayer(StaticLayer):
    """A full-length static layer whose length dimension stays symbolic in a compiled graph: its
    buffers are not marked static (that would specialize their shape) and its mask sizes are read
    from the buffer, not from a Python int Dynamo would guard on."""

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


def padded(length: int) -> int:
    """Positions a chunked prefill of ``length`` tokens writes (its last chunk padded)."""
    return -(-length // CHUNK) * CHUNK


def capacity_for(tokens: int, context: int | None) -> int:
    """The bucket for a request of ``tokens`` positions: the next power of two from
    ``MIN_CAPACITY``, at most the model's context (but never less than what the request writes)."""
    cap = max(MIN_CAPACITY, 1 << (max(tokens, 1) - 1).bit_length())
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
