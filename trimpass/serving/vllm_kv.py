"""The target drafting for itself on vLLM 0.32's ``draft_model`` route, with one KV cache. vLLM
loads the drafter as a second model with its own attention layers and cache, and runs the
drafter's first forward at every step, even when nothing will be drafted, to keep that cache in
step with the accepted tokens. When the drafter is the target (:func:`same_model`: the same class
and every parameter equal), its layers compute at each position exactly what the target's
layers compute, so :func:`share_cache` points each drafter attention layer at the target layer's
own cache tensor (they already share block tables and slots: vLLM puts them in one KV cache
group). The drafter then reads the target's cache and writes its drafted positions into slots
the target rewrites when it verifies them, and a step that drafts nothing needs no drafter
forward at all: nothing is left to catch up when drafting resumes. With the cache shared, the
drafter's first forward needs only each request's next token (:func:`next_token_first_pass`):
vLLM's route runs it over every token the target just verified too, whose keys and values the
target's own pass has already written. The drafter's own cache is still allocated by vLLM
(unused; :func:`unused_bytes` reports it)."""
from __future__ import annotations

import torch

DRAFT_PREFIX = "draft_model."  # vLLM's prefix for the drafter's layer names


def same_model(drafter, target) -> bool:
    """Whether ``drafter`` is a copy of ``target``: the same class, the same parameter names and
    shapes, and every parameter equal (one pass over the weights, once at load)."""
    if type(drafter) is not type(target):
        return False
    a, b = dict(drafter.named_parameters()), dict(target.named_parameters())
    if a.keys() != b.keys():
        return False
    with torch.no_grad():
        return all(a[k].shape == b[k].shape and a[k].dtype == b[k].dtype
                   and torch.equal(a[k], b[k]) for k in a)


def share_cache(layer_names, forward_context: dict) -> list[str]:
    """Point each drafter attention layer in ``layer_names`` at the cache of the target layer of
    the same name without :data:`DRAFT_PREFIX`; the names shared. Raises where a layer has no
    counterpart, or their caches differ in shape or dtype (nothing is changed then)."""
    pairs = []
    for name in sorted(layer_names):
        target = forward_context.get(name.removeprefix(DRAFT_PREFIX))
        if not name.startswith(DRAFT_PREFIX) or target is None:
            raise RuntimeError(f"trimpass: the drafter's layer {name} has no target layer of the "
                               "same name; its cache cannot be shared")
        mine, theirs = forward_context[name].kv_cache, target.kv_cache
        if not isinstance(mine, torch.Tensor) or not isinstance(theirs, torch.Tensor) or \
                mine.shape != theirs.shape or mine.dtype != theirs.dtype:
            raise RuntimeError(f"trimpass: the caches of {name} and its target layer differ; "
                               "they cannot be shared")
        pairs.append((forward_context[name], target))
    for layer, target in pairs:
        layer.trimpass_own_cache_bytes = layer.kv_cache.numel() * layer.kv_cache.element_size()
        layer.kv_cache = target.kv_cache
    return sorted(layer_names)


def unused_bytes(layer_names, forward_context: dict) -> int:
    """Bytes of the drafter's own caches that :func:`share_cache` left unused."""
    return sum(getattr(forward_context[n], "trimpass_own_cache_bytes", 0) for n in layer_names)


def next_token_first_pass(proposer, counts=None) -> None:
    """Make ``proposer``'s first forward (a drafter sharing the target's cache) a decode step over
    each request's next token alone, at its position, attending to the cache the target wrote.
    vLLM's ``set_inputs_first_pass`` still lays the batch out (the next token's position and slot
    past the accepted tokens); its output is cut to those rows, with seq_lens = position + 1. The
    rejected-token count the runner passes is applied here, so ``propose`` gets None and does not
    subtract it again when its later steps start. ``counts["first_pass_rows"]`` (a Counter)
    counts the rows such first forwards ran."""
    if proposer.uses_mrope or not proposer.needs_extra_input_slots or proposer.parallel_drafting:
        raise RuntimeError("trimpass: the next-token first pass needs vLLM's draft-model route "
                           "(no M-RoPE, no parallel drafting)")
    first_pass, propose = proposer.set_inputs_first_pass, proposer.propose
    rejected = [None]

    def propose_next_token_first(*args, num_rejected_tokens_gpu=None, **kwargs):
        rejected[0] = num_rejected_tokens_gpu
        try:
            return propose(*args, num_rejected_tokens_gpu=None, **kwargs)
        finally:
            rejected[0] = None

    def set_inputs_next_token(**kwargs):
        kwargs["num_rejected_tokens_gpu"] = rejected[0]
        n, rows, cad = first_pass(**kwargs)
        B = cad.batch_size()
        if rows.numel() != B or isinstance(cad.causal, torch.Tensor):
            raise RuntimeError("trimpass: the next-token first pass takes one sampled row per "
                               "request and a causal mask")
        rows = rows.long()
        ids, pos = proposer.input_ids[rows].clone(), proposer.positions[rows].clone()
        proposer.input_ids[:B], proposer.positions[:B] = ids, pos
        start = torch.arange(B + 1, dtype=cad.query_start_loc.dtype)
        decode = cad.replace(
            query_start_loc=start.to(cad.query_start_loc.device), query_start_loc_cpu=start,
            seq_lens=(pos + 1).to(cad.seq_lens.dtype), num_actual_tokens=B, max_query_len=1,
            slot_mapping=cad.slot_mapping[rows],
            positions=None if cad.positions is None else pos)
        if counts is not None:
            counts["first_pass_rows"] += B
        return B, torch.arange(B, dtype=torch.int32, device=rows.device), decode

    proposer.set_inputs_first_pass, proposer.propose = set_inputs_next_token, \
        propose_next_token_first
