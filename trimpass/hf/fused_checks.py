"""Checks of :func:`trimpass.generate`'s arguments that are not its settings (those are
:class:`~trimpass.spec.config.GenerateConfig`'s), each a clear error naming the argument and what
to pass instead, raised before any compute or compile: the model the fused loop can serve, the
call's ids, mask and length, and ``output_cache``."""
from __future__ import annotations

import torch

from trimpass.hf import selfdraft
from trimpass.spec.config import positive_int

# the families whose layers the fused loop's own cache serves (each tested in tests/hf):
# attention that writes through ``past_key_values.update`` and masks from its position
OWNED = {"gemma3": "Gemma-3", "gemma3_text": "Gemma-3", "llama": "Llama", "qwen2": "Qwen2",
         "gpt2": "GPT-2"}


def owned(model) -> bool:
    """Whether the fused loop runs ``model`` on its own cache and round graphs."""
    cfg = model.config.get_text_config(decoder=True)
    return getattr(cfg, "model_type", None) in OWNED


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


def check_call(input_ids, attention_mask, max_new_tokens) -> None:
    """A clear error for a bad argument of :func:`trimpass.generate`, before any compute (its
    settings are checked by :class:`~trimpass.spec.config.GenerateConfig`)."""
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
    positive_int("max_new_tokens", max_new_tokens, "tokens to generate")
