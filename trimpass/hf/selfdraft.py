"""A Hugging Face causal LM as its own drafter: :func:`shared_copy` returns a second module over the
very same parameters and buffers (no copy of any tensor), with its own forward hooks, config and
generation config, so that it keeps its own trimpass state and KV cache when it serves as
``model.generate(..., assistant_model=...)``'s assistant; :func:`trimpass.self_drafter` compiles it
through trimpass. Any causal LM with a ``[V, d]`` output embedding works, tied or not, with all of
its layers: the copy is made through Hugging Face's own ``base_model_prefix`` (``model`` for Gemma,
Llama and Qwen2, ``transformer`` for GPT-2), never by layer names. Where the model verifies
row-invariantly (:mod:`trimpass.hf.exact`), the copy runs plain ``sdpa``: only the target needs it.
"""
from __future__ import annotations

import copy

import torch

from trimpass.hf import exact

HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
         "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")


def check(model) -> None:
    """A clear error, before anything is built, for a model this cannot serve."""
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "get_output_embeddings"):
        raise TypeError(f"model: expected a Hugging Face causal LM (a PreTrainedModel with "
                        f"generate), got {type(model).__name__}")
    head = model.get_output_embeddings()
    W = getattr(head, "weight", None)
    if not isinstance(W, torch.Tensor) or W.dim() != 2:
        raise ValueError(f"model: {type(model).__name__} has no [V, d] LM head "
                         "(get_output_embeddings() has no 2-D weight); a self-drafter trims it")
    emb = model.get_input_embeddings()
    E = getattr(emb, "weight", None)
    if isinstance(E, torch.Tensor) and E.dim() == 2 and E.shape[0] != W.shape[0]:
        raise ValueError(f"model: its head has {W.shape[0]} rows but its input embedding "
                         f"{E.shape[0]} ids; a self-drafter needs one vocabulary for both")


def check_schedule(gamma, confidence) -> None:
    """A clear error for a draft length or confidence stop of a self-drafter (HF's loop or the
    fused one)."""
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
        raise ValueError(f"gamma: tokens drafted per verification, an int >= 1, got {gamma!r}")
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) \
            or not 0 <= confidence < 1:
        raise ValueError(f"confidence: the drafter's probability below which a draft stops, in "
                         f"[0, 1) (0: always gamma tokens), got {confidence!r}")


def _shallow(module, config):
    """``module`` again over the same submodules, parameters and buffers, with its own hooks and
    ``config``."""
    out = copy.copy(module)
    out._modules = dict(module._modules)  # copy.copy shares the dict: never edit the original's
    for name in HOOKS:
        setattr(out, name, type(getattr(module, name))())  # the model's hooks stay its own
    out.config = config
    return out


def shared_copy(model, gamma: int, confidence: float):
    """The assistant: ``model`` over its own parameters, drafting up to ``gamma`` tokens per round
    and stopping early where its trimmed confidence drops below ``confidence`` (0: always
    ``gamma``)."""
    check(model)
    check_schedule(gamma, confidence)
    config = copy.deepcopy(model.config)
    if getattr(config, "_attn_implementation", None) == exact.NAME:
        config._attn_implementation = "sdpa"
    draft = _shallow(model, config)
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    if isinstance(base, torch.nn.Module) and base is not model:
        setattr(draft, prefix, _shallow(base, config))  # its masks follow the copy's config
    draft.generation_config = copy.deepcopy(model.generation_config)
    g = draft.generation_config
    g.num_assistant_tokens, g.num_assistant_tokens_schedule = gamma, "constant"
    g.assistant_confidence_threshold = float(confidence)
    return draft
