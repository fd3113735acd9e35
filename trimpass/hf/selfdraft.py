"""A Hugging Face causal LM as its own drafter: :func:`shared_copy` returns a second module over the
very same parameters and buffers (no copy of any tensor), with its own forward hooks, config and
generation config, so that it keeps its own trimpass state and KV cache when it serves as
``model.generate(..., assistant_model=...)``'s assistant; :func:`trimpass.self_drafter` compiles it
through trimpass. Any causal LM with a ``[V, d]`` output embedding works, tied or not, with all of
its layers: the copy is made through Hugging Face's own ``base_model_prefix`` (``model`` for Gemma,
Llama and Qwen2, ``transformer`` for GPT-2), never by layer names, and every module under it that
reads the config reads the copy's. Where the model runs ``sdpa`` (or verifies row-invariantly,
:mod:`trimpass.hf.exact`, which only the target needs), the copy runs
:mod:`trimpass.hf.decode_attention`: a one-token step's attention in fp32 products, 5x faster in
bf16 on the CPU at 1,024 tokens.
"""
from __future__ import annotations

import copy

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from trimpass.hf import decode_attention
from trimpass.spec.config import SelfDraftConfig

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


def _shallow(module, config):
    """``module`` again over the same submodules, parameters and buffers, with its own hooks and
    ``config``."""
    out = copy.copy(module)
    out._modules = dict(module._modules)  # copy.copy shares the dict: never edit the original's
    for name in HOOKS:
        setattr(out, name, type(getattr(module, name))())  # the model's hooks stay its own
    out.config = config
    return out


class FullLayer(DynamicLayer):
    """The drafter's cache layer: every position so far (a sliding-window layer's window is applied
    by the model's mask, from absolute positions), and standard strides after a rollback, so that a
    compiled drafter sees one layout whatever was cropped."""

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if self.is_initialized:  # a cropped view keeps the old length's strides
            self.keys = self.keys.clone(memory_format=torch.contiguous_format)
            self.values = self.values.clone(memory_format=torch.contiguous_format)


def _full_length_layers(prepare):
    """``prepare`` (a model's ``_prepare_cache_for_generation``), then every layer of the cache it
    made replaced by a :class:`FullLayer`. A sliding-window layer keeps its length as a Python int
    and branches on it, so a compiled drafter recompiles as a request crosses the window; and with
    its past recorded for rollback (as assisted generation does) Hugging Face 5.17's returns more
    keys than its mask covers once a request passes the window, a crash inside attention."""
    def wrapped(generation_config, model_kwargs, *args, **kwargs):
        out = prepare(generation_config, model_kwargs, *args, **kwargs)
        cache = model_kwargs.get("past_key_values")
        # a cache carried over from the last round is already ours, and holds the request so far
        if isinstance(cache, DynamicCache) and not all(isinstance(x, FullLayer)
                                                       for x in cache.layers):
            cache.layers = [FullLayer() for _ in cache.layers]
        return out
    return wrapped


def shared_copy(model, settings: SelfDraftConfig):
    """The assistant: ``model`` over its own parameters, drafting up to ``settings.gamma`` tokens
    per round and stopping early where its trimmed confidence drops below ``settings.confidence``
    (0: always ``gamma``)."""
    check(model)
    gamma, confidence = settings.gamma, settings.confidence
    config = decode_attention.copy_config(model.config)
    draft = _shallow(model, config)
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    to = decode_attention.configs(model.config, config)
    if isinstance(base, torch.nn.Module) and base is not model:
        base = _shallow(base, config)  # its masks follow the copy's config, and its layers
        base._modules = {k: decode_attention.rebind(m, to) if m is not None else None
                         for k, m in base._modules.items()}
        setattr(draft, prefix, base)
    draft.generation_config = copy.deepcopy(model.generation_config)
    draft._prepare_cache_for_generation = _full_length_layers(draft._prepare_cache_for_generation)
    g = draft.generation_config
    g.num_assistant_tokens, g.num_assistant_tokens_schedule = gamma, "constant"
    g.assistant_confidence_threshold = float(confidence)
    return draft


def warm_up(model, draft) -> float:
    """Compile every graph Hugging Face's assisted generation runs in ``draft`` (a
    :func:`trimpass.self_drafter` of ``model``), on scratch prompts of 16 tokens and of one,
    decoded until drafts were both kept whole and cut short (the drafter's prefill, its one-token
    step and its catch-up over several tokens; a one-token prompt's own, as Dynamo specializes
    sizes of 1); returns the seconds it took, 0 if done already.
    The drafter's rows are reset after, so no scratch id stays in its active set."""
    import time

    from trimpass.measure import compiled_graphs
    if getattr(draft, "_trimpass_warm", None) is not None:
        return 0.0
    t0, graphs = time.perf_counter(), compiled_graphs()
    device = next(model.parameters()).device
    V = model.get_output_embeddings().weight.shape[0]
    scratch = torch.Generator().manual_seed(0)  # ordinary ids, none of the special ones up front
    with torch.no_grad():
        for length in (16, 1):
            ids = torch.randint(V // 4, V // 2, (1, length), generator=scratch).to(device)
            model.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=24,
                           pad_token_id=0)
    reset_rows(draft)
    draft._trimpass_warm = (time.perf_counter() - t0, compiled_graphs() - graphs)
    return draft._trimpass_warm[0]


def reset_rows(draft) -> None:
    """Start a new request in every row of a self-drafter's dynamic vocabulary (a no-op in the
    static mode and before its first call): what ``trimpass.reset`` does, read through the backend
    :func:`trimpass.self_drafter` left on it."""
    be = getattr(draft, "_trimpass_backend", None)
    st = be.state_for(draft) if be is not None else None
    if st is not None and st.V is not None:
        st.reset()
