"""The fused loop's own static KV cache and the shapes it compiles, chosen so that no prompt length
compiles a new graph and no round records a new CUDA graph. Every layer writes its keys and values
at ``pos + arange(n)``, where ``pos`` is **one position tensor on the device shared by every
layer** (:class:`PositionLayer`); no layer advances it, the loop does (a drafting step adds one,
an accept sets it to the end of what it kept), so a rollback is a device-side update of ``pos`` and
no length state exists anywhere else; the attention mask and the positions are read from it. A
layer is full length (a sliding-window layer's mask applies the window from absolute positions).
The cache holds a request's positions in a capacity class (:func:`capacity_for`): on the CPU a
multiple of ``GRANULE`` (the length dimension is symbolic in every graph and nothing is recorded,
so the cache follows the request), on a GPU one of ``CUDA_CLASSES`` (each a CUDA-graph recording,
reused across calls), where a prompt's pass is also padded to a multiple of ``PREFILL_ROWS`` rows
(:func:`padded_rows`). ``slack`` rows past the capacity take a padded pass's padding rows. Why these
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
CUDA_CLASSES = (2048, 8192, 32768)
# where graphs are recorded (CUDA graphs: one recording per shape), a prompt's pass is padded to a
# multiple of PREFILL_ROWS rows, so a prompt of a new length replays a recording it has
PREFILL_ROWS = 64
PADDED = ("cuda",)


class PositionLayer(StaticLayer):
    """A full-length static layer that writes at the shared position ``pos`` and never moves it;
    its length dimension stays symbolic in a compiled graph (static addresses without a guard on
    them: a guarded one would specialize their shape)."""

    def __init__(self, capacity: int, pos: torch.Tensor):
        super().__init__(capacity)
        self.pos = pos

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        rows = (self.batch_size, self.num_heads, self.max_cache_len)
        self.keys = torch.zeros(*rows, self.k_head_dim, dtype=self.dtype, device=self.device)
        self.values = torch.zeros(*rows, self.v_head_dim, dtype=self.dtype, device=self.device)
        for t in (self.keys, self.values):
            torch._dynamo.maybe_mark_dynamic(t, 2)
            # static addresses, so a CUDA-graph tree neither copies nor refuses these mutated
            # buffers; guard=False keeps the length dimension symbolic
            torch._dynamo.mark_static_address(t, guard=False)
        self.cumulative_length = self.pos
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        at = self.pos + torch.arange(key_states.shape[-2], device=self.pos.device)
        self.keys.index_copy_(2, at, key_states)
        self.values.index_copy_(2, at, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> torch.Tensor:
        return self.pos

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class LoopCache(Cache):
    """Every layer of a model over ``capacity + slack`` rows at one shared position ``pos`` (a 0-d
    long tensor on the device, a static address)."""

    def __init__(self, model, capacity: int, slack: int = 0):
        cfg = model.config.get_text_config(decoder=True)
        p = next(model.parameters())
        self.pos = torch.zeros((), dtype=torch.long, device=p.device)
        torch._dynamo.mark_static_address(self.pos, guard=False)
        self.capacity = capacity
        super().__init__(layers=[PositionLayer(capacity + slack, self.pos)
                                 for _ in range(cfg.num_hidden_layers)])
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.early_initialization(1, heads, dim, p.dtype, p.device)

    def seek(self, length: int) -> None:
        """Set the position from the host (a prompt's chunk, a diagnostic replay): no read."""
        self.pos.fill_(length)


def padded_rows(n: int, device) -> int:
    """The rows a prompt's pass of ``n`` tokens runs on ``device``: ``n`` where nothing is
    recorded, else ``n`` rounded up to a multiple of ``PREFILL_ROWS``."""
    if torch.device(device).type not in PADDED:
        return n
    return -(-n // PREFILL_ROWS) * PREFILL_ROWS


def kept_classes(device) -> int:
    """How many capacity classes keep their cache allocated on ``device``: every class where
    graphs are recorded (their addresses are in the recordings), one on the CPU (a new class's
    cache replaces the last: a 32,768-position fp32 cache of Gemma-3-270M is 1.2 GB)."""
    return len(CUDA_CLASSES) if torch.device(device).type in PADDED else 1


def context_of(model) -> int | None:
    """The model's positions (``max_position_embeddings`` or GPT-2's ``n_positions``), or None
    where its config has none."""
    cfg = model.config.get_text_config(decoder=True)
    n = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    return int(n) if isinstance(n, int) and n > 0 else None


def largest(context: int | None, device) -> int | None:
    """The largest cache the loop allocates on ``device`` (None: no bound but the context)."""
    if torch.device(device).type != "cuda":
        return context
    return min(CUDA_CLASSES[-1], context) if context is not None else CUDA_CLASSES[-1]


def capacity_for(tokens: int, context: int | None, device="cpu") -> int:
    """The cache for a request of ``tokens`` positions: on the CPU rounded up to a multiple of
    ``GRANULE``, on a GPU the smallest of ``CUDA_CLASSES`` that holds it; at most the model's
    context (:func:`check_length` keeps a request within it)."""
    if torch.device(device).type == "cuda":
        cap = next((c for c in CUDA_CLASSES if c >= tokens), CUDA_CLASSES[-1])
    else:
        cap = -(-max(tokens, 1) // GRANULE) * GRANULE
    return max(tokens, min(cap, context)) if context is not None else cap


def check_length(prompt: int, max_new_tokens: int, context: int | None, device="cpu") -> None:
    """A clear error, before any compute, for a request that does not fit the model's positions
    or the loop's largest cache on ``device``."""
    most = largest(context, device)
    if most is None:
        return
    what = ("the model's context of", "max_position_embeddings") if most == context else \
        ("the loop's largest cache of", f"{torch.device(device).type} capacity classes")
    if prompt > most:
        raise ValueError(f"input_ids: a prompt of {prompt} tokens is longer than {what[0]} "
                         f"{most} positions ({what[1]}); shorten it")
    if prompt + max_new_tokens > most:
        raise ValueError(f"max_new_tokens: {prompt} prompt tokens + {max_new_tokens} new ones "
                         f"pass {what[0]} {most} positions ({what[1]}); ask for at most "
                         f"{most - prompt}")
