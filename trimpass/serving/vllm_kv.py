"""The target drafting for itself on vLLM's ``draft_model`` route, with one KV cache. vLLM
loads the drafter as a second model with its own attention layers and cache, and runs the
drafter's first forward at every step, even when nothing will be drafted, to keep that cache in
step with the accepted tokens. When the drafter is the target (:func:`same_model`: the same class
and every parameter equal), its layers compute at each position exactly what the target's
layers compute, so each drafter attention layer can use the target layer's own cache tensor
(they already share block tables and slots: vLLM puts them in one KV cache group);
:func:`check_pairs` checks each pair before :mod:`trimpass.serving.vllm_compat` points the layer
there. The drafter then reads the target's cache and writes its drafted positions into slots the
target rewrites when it verifies them, and a step that drafts nothing needs no drafter forward at
all: nothing is left to catch up when drafting resumes. With the cache shared, the drafter's first
forward needs only each request's next token (the compatibility module's next-token first pass):
vLLM's route runs it over every token the target just verified too, whose keys and values the
target's own pass has already written. The drafter's own cache is still allocated by vLLM
(unused: :func:`check_pairs` returns its bytes)."""
from __future__ import annotations

import torch


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


def check_pairs(pairs: dict) -> int:
    """``pairs``: each drafter layer's name -> (its own cache, the cache of the target layer of
    the same name, or None where there is none). Raises where a layer has no counterpart or the
    two caches differ in shape or dtype; returns the bytes of the drafter's own caches left
    unused once shared."""
    unused = 0
    for name, (mine, theirs) in sorted(pairs.items()):
        if theirs is None:
            raise RuntimeError(f"trimpass: the drafter's layer {name} has no target layer of the "
                               "same name; its cache cannot be shared")
        if not isinstance(mine, torch.Tensor) or not isinstance(theirs, torch.Tensor) or \
                mine.shape != theirs.shape or mine.dtype != theirs.dtype:
            raise RuntimeError(f"trimpass: the caches of {name} and its target layer differ; "
                               "they cannot be shared")
        unused += mine.numel() * mine.element_size()
    return unused
