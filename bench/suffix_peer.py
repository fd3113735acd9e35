"""ArcticInference's suffix decoding as a peer of the fused loop in a plain Hugging Face loop: its
``SuffixDecodingCache`` (the request's prompt and output in a suffix tree, earlier responses in a
global one, ``arctic-inference`` 0.3.0 from PyPI, an sdist whose suffix-tree extension builds on
CPU: ``pip wheel --no-deps arctic-inference==0.3.0``) drafts with vLLM's ``suffix`` defaults (tree
depth 24, ``max_spec_factor`` 1.0, ``min_token_prob`` 0.1, at most 16 tokens), and the target
verifies each draft greedily in one eager forward over a ``DynamicCache`` cropped back to the kept
prefix, as Hugging Face prompt lookup does. Greedy only.
"""
from __future__ import annotations

import itertools

import torch

DEPTH, MOST = 24, 16


def cache_or_reason():
    """A fresh ``SuffixDecodingCache``, or the reason it cannot be built here (a string)."""
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError as e:
        return f"arctic-inference is not installed ({e}); pip wheel --no-deps arctic-inference"
    return SuffixDecodingCache(max_tree_depth=DEPTH)


_ids = itertools.count()


@torch.no_grad()
def generate(model, ids: torch.Tensor, n: int, cache, eos: set[int]) -> torch.Tensor:
    """Greedy decoding of up to ``n`` tokens after ``ids[1, P]`` with suffix drafts from ``cache``
    (which keeps this response for later requests, as ArcticInference does)."""
    from transformers import DynamicCache

    from trimpass.hf.fused import through_eos
    req = next(_ids)
    seq = ids[0].tolist()
    cache.start_request(req, seq)
    past = DynamicCache(config=model.config)
    new = [int(model(ids, past_key_values=past, use_cache=True).logits[0, -1].argmax())]
    past.activate_past_recording()  # sliding layers keep what a crop may need, as HF's loop does
    cache.add_active_response(req, new)
    seq.append(new[0])
    while len(new) < n and new[-1] not in eos:
        most = min(MOST, n - len(new) - 1)
        draft = list(cache.speculate(req, seq[-DEPTH:], max_spec_tokens=most, max_spec_factor=1.0,
                                     min_token_prob=0.1).token_ids) if most else []
        logits = model(torch.tensor([seq[-1:] + draft]), past_key_values=past,
                       use_cache=True).logits[0]
        target = logits.argmax(-1).tolist()
        k = next((i for i, (d, t) in enumerate(zip(draft, target[:-1], strict=True)) if d != t),
                 len(draft))
        kept = draft[:k] + [target[k]]
        past.crop(-(len(draft) - k))  # the rejected draft's rows (0: back to the window)
        cache.add_active_response(req, kept)
        seq += kept
        new += kept
    cache.stop_request(req)
    new = through_eos(new, eos)
    return torch.cat([ids, torch.tensor([new[:n]])], dim=1)
