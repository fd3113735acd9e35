"""Checks of :func:`trimpass.generate`'s arguments, each a clear error naming the argument and
what to pass instead, raised before any compute or compile: the model the fused loop can serve,
the call's ids, mask, length and sampling settings, ``lookup`` and ``output_cache``."""
from __future__ import annotations

import torch

from trimpass.hf import selfdraft
from trimpass.hf.fused import LOOKUP_TOKENS


def check_model(model) -> None:
    """A clear error for a model the loop cannot serve, naming what is missing."""
    selfdraft.check(model)
    prefix = getattr(model, "base_model_prefix", "")
    if not isinstance(getattr(model, prefix, None) if prefix else None, torch.nn.Module):
        raise ValueError(f"model: {type(model).__name__} has no base model under its "
                         f"base_model_prefix ({prefix!r}); the fused loop runs the body alone")
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError("model: an encoder-decoder model; the fused loop serves decoder-only "
                         "causal LMs")


def _int(name, value, lo, what):
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name}: {what}, an int >= {lo}, got {value!r}")


def lookup_tokens(lookup) -> int:
    """``generate``'s ``lookup`` as the most tokens a lookup draft proposes (0: off)."""
    if lookup is True:
        return LOOKUP_TOKENS
    if lookup is False:
        return 0
    if isinstance(lookup, int) and 1 <= lookup <= LOOKUP_TOKENS:
        return lookup
    raise ValueError(f"lookup: True (drafts of up to {LOOKUP_TOKENS} tokens from the text "
                     f"repeating itself), False (off), or the most tokens a draft proposes, an "
                     f"int in [1, {LOOKUP_TOKENS}]; got {lookup!r}")


def check_output_cache(cache, lookup_tokens: int, model) -> None:
    """A clear error for an ``output_cache`` the call cannot use, before any compute; binds it to
    ``model``'s vocabulary."""
    if cache is None:
        return
    from trimpass.hf.output_cache import OutputCache
    if not isinstance(cache, OutputCache):
        raise ValueError(f"output_cache: a trimpass.OutputCache or None, got "
                         f"{type(cache).__name__}")
    if not lookup_tokens:
        raise ValueError("output_cache: earlier outputs are lookup drafts; it needs lookup on "
                         "(lookup=True), not lookup=False")
    cache.bind(model.get_output_embeddings().weight.shape[0])


def check_call(input_ids, attention_mask, max_new_tokens, do_sample, temperature, top_k,
               top_p) -> None:
    """A clear error for a bad argument of :func:`trimpass.generate`, before any compute."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] < 1 \
            or input_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"input_ids: expected integer ids [batch, length >= 1], got "
                         f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
    if input_ids.shape[0] != 1:
        raise ValueError(f"input_ids: the fused loop decodes one sequence at a time, got a batch "
                         f"of {input_ids.shape[0]}; call it per prompt (prompts of different "
                         "lengths need no padding that way)")
    if attention_mask is not None and (attention_mask.shape != input_ids.shape
                                       or not bool(attention_mask.bool().all())):
        raise ValueError("attention_mask: the fused loop takes an unpadded prompt (all ones, the "
                         "shape of input_ids); drop the padding")
    _int("max_new_tokens", max_new_tokens, 1, "tokens to generate")
    if not isinstance(do_sample, bool):
        raise ValueError(f"do_sample: True or False, got {do_sample!r}")
    if do_sample and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                      or not temperature > 0):
        raise ValueError(f"temperature: must be > 0 when sampling (do_sample=False decodes "
                         f"greedily), got {temperature!r}")
    if top_k is not None:
        _int("top_k", top_k, 1, "ids kept for sampling (None: all)")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                              or not 0 < top_p <= 1):
        raise ValueError(f"top_p: a probability in (0, 1] (None: no nucleus), got {top_p!r}")
