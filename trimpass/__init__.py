"""trimpass: trim a speculative-decoding drafter's LM head to an active vocabulary by compiler pass.

``torch.compile(draft, backend=trimpass)`` — the module itself is a Dynamo backend (zero
configuration: the dynamic, context-aware vocabulary); ``backend="trimpass"`` works by name;
``trimpass.backend(vocab=..., ...)`` returns a configured one; ``trimpass.trim(...)`` decorates a
module, a module class or a function, and compiles a module in place so that code calling it —
Hugging Face ``generate`` included — runs the trimmed head.
"""
from __future__ import annotations

import sys
import types

import torch

from trimpass import ops  # noqa: F401  (registers the torch.library ops)
from trimpass.backend import (
    TrimBackend,
    TrimpassWarning,
    backend_for,
    compile_inner,
    dynamo_entry,
    make_backend,
)
from trimpass.config import Escape, TrimConfig, TrimpassError
from trimpass.dynamic import ops as _dynamic_ops  # noqa: F401  (and the dynamic vocabulary's)
from trimpass.hf.output_cache import OutputCache

__all__ = ["backend", "trim", "self_drafter", "generate", "warm_up", "TrimConfig", "Escape",
           "TrimpassError", "TrimpassWarning", "explain", "reset", "stats", "observe", "pair",
           "active_ids", "active_state", "ops", "OutputCache", "forget"]


def backend(**config) -> TrimBackend:
    """A configured backend: ``torch.compile(draft, backend=trimpass.backend(vocab=ids))``.

    Takes the fields of :class:`TrimConfig` (``vocab``, ``keep``, ``output``, ``inner``, ``mode``,
    ``options``, ...), checked here. Use one backend per drafter.
    """
    return make_backend(**config)


def _compile_module(module: torch.nn.Module, be: TrimBackend, **compile_kw) -> torch.nn.Module:
    module._trimpass_backend = be
    # in place: module(...) and module.generate(...) run the rewrite
    module.compile(backend=be, **compile_kw)
    return module


def trim(target=None, **config):
    """Trim a drafter: ``trim(module)``, ``@trim`` / ``@trim(vocab=...)`` on a module class or a
    forward function. A module is compiled in place and returned (its ``__call__`` runs the
    trimmed graph, so loops that call it, such as HF assisted generation, need no change)."""
    if target is None:
        return lambda t: trim(t, **config)
    if isinstance(target, torch.nn.Module):
        return _compile_module(target, make_backend(**config))
    if isinstance(target, type) and issubclass(target, torch.nn.Module):
        init = target.__init__

        def __init__(self, *args, **kwargs):
            init(self, *args, **kwargs)
            if type(self) is target:
                _compile_module(self, make_backend(**config))

        target.__init__ = __init__
        return target
    if callable(target) and not isinstance(target, type):
        be = make_backend(**config)
        compiled = torch.compile(target, backend=be)
        compiled._trimpass_backend = be
        return compiled
    raise TrimpassError(f"trim: expected an nn.Module, an nn.Module subclass or a function, got "
                        f"{type(target).__name__}")


def _backend_of(draft) -> TrimBackend:
    be = getattr(draft, "_trimpass_backend", None)
    if be is None:
        orig = getattr(draft, "_orig_mod", draft)
        be = getattr(orig, "_trimpass_backend", None) or backend_for(orig)
    return be


def _module_of(draft):
    orig = getattr(draft, "_orig_mod", draft)
    return orig if isinstance(orig, torch.nn.Module) else None


def explain(draft) -> str:
    """What trimpass rewrote and skipped in each graph compiled for ``draft``."""
    return _backend_of(draft).explain()


def _state(draft, what: str, required: bool = True):
    be = _backend_of(draft)
    module = _module_of(draft)
    st = be.state_for(module) if module is not None else be.state_for(None)
    if st is None and be.config.dynamic:
        st = be.state  # a compiled function: the backend's only state
    if st is None or st.V is None:
        if not required:
            return None
        raise TrimpassError(f"{what}: {type(draft).__name__} has no dynamic-vocabulary state yet "
                            "(not compiled with trimpass in the dynamic mode, or not run yet)")
    return st


def active_state(draft):
    """``draft``'s dynamic-vocabulary :class:`~trimpass.dynamic.state.ActiveState` (its
    request rows, ``admit``, ``active``, ``bind``/``release`` for engines), or ``None`` before the
    first call or in the static mode."""
    return _state(draft, "active_state", required=False)


def reset(draft=None) -> None:
    """Start a new request in every row of ``draft``'s dynamic vocabulary (the core set stays).

    A no-op before the drafter's first call, and for a static vocabulary. ``torch._dynamo.reset()``
    calls a backend's ``reset()`` with no argument: that is a no-op too.
    """
    if draft is not None:
        st = _state(draft, "reset", required=False)
        if st is not None:
            st.reset()


def stats(draft) -> dict:
    """Active-set sizes and counters of ``draft`` (reads the device: call it between steps).

    Keys (both modes): ``mode`` ("static" or "dynamic"), ``vocab_size``, ``active`` (active ids per
    batch position of the latest call; one entry in the static mode). Dynamic mode adds
    ``capacity``, ``max_rows``, ``core`` (core slots per row: kept + configured + learned),
    ``learned``, ``calls`` (admissions), ``requests`` (engine-bound rows) and ``bytes_per_row``.
    For a model :func:`generate` decoded: ``mode`` "fused", the loop's counters summed over its
    calls (``rounds``, ``drafted``, ``accepted``, ``emitted``, ``body_steps``, ``trimmed_calls``,
    ``verifications``, ``rechecks``, ``acceptance``, ``mat``, ``batched_passes`` (lookup
    verifications), ``passes_per_token``, ``sources`` (rounds, drafted and accepted of ``lookup``
    and of the trimmed ``self``-draft apart), ``warm_up_s`` and ``graphs`` (the first call's
    compile)) and ``drafter``, its step's stats.
    """
    loop = getattr(draft, "_trimpass_fused", None)
    if loop is not None:  # a model trimpass.generate decoded: the loop's counters
        out = loop.stats.as_dict()
        out["drafter"] = stats(loop.step) if loop.speculate and active_state(loop.step) else None
        return out
    be = _backend_of(draft)
    if not be.config.dynamic:
        idx = be.config.settings.index(1 << 62, "cpu")[0]
        return {"mode": "static", "vocab_size": be.config.vocab_size, "active": [idx.numel()]}
    return _state(draft, "stats").stats()


def observe(draft, target_logits_or_ids: torch.Tensor, k: int = 3) -> None:
    """Opt-in: admit the target's top-``k`` predictions (logits ``[B, ..., V]`` or ids
    ``[B, ...]``)."""
    _state(draft, "observe").observe(target_logits_or_ids, k)


def self_drafter(model, gamma: int | None = None, confidence: float | None = None, **config):
    """``model`` as its own drafter: an assistant for ``model.generate(..., assistant_model=...)``
    that shares every parameter and buffer with ``model`` (no copy), keeps its own trimpass state,
    KV cache and generation config, and drafts through its own trimmed head, verified by
    ``model``'s full head: up to ``gamma`` tokens a round, stopping where the trimmed confidence
    drops below ``confidence`` (0: always ``gamma``). ``config`` is :class:`TrimConfig`'s
    (zero-config by default). Any Hugging Face causal LM with a ``[V, d]`` head, tied or not, all
    of its layers. Hugging Face's assisted generation takes batch 1 only. The defaults
    (:class:`~trimpass.spec.config.SelfDraftConfig`'s: 16 and 0.4) measured best with the real
    Gemma-3-270M (x1.58 the plain target, against x1.47 at a fixed 4 and x1.54 at 6;
    ``bench/results/self_gamma.md``)."""
    from trimpass.hf.selfdraft import shared_copy
    from trimpass.hf.upcast import RowsBackend
    from trimpass.spec.config import SelfDraftConfig
    d = SelfDraftConfig()
    settings = SelfDraftConfig(d.gamma if gamma is None else gamma,
                               d.confidence if confidence is None else confidence)
    be = make_backend(**config)  # the settings checked before anything is built
    draft = shared_copy(model, settings)
    draft._trimpass_backend = be
    # every length symbolic from the first call: HF's loop calls the drafter with prompts, steps
    # and catch-ups of any length over a cache of any length, each a new static graph otherwise;
    # its passes over several tokens upcast where this CPU multiplies half precision slowly
    draft.compile(backend=RowsBackend(be, model.get_output_embeddings().weight.shape),
                  dynamic=True)
    return draft


def generate(model, input_ids, max_new_tokens: int, do_sample: bool = False,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             attention_mask=None, gamma: int | None = None, confidence: float | None = None,
             speculate: bool = True, lookup: bool | int = True, output_cache=None,
             suffix: bool | dict = True, tenant: str = "", tree: bool | dict = True,
             **config) -> torch.Tensor:
    """Decode with ``model`` drafting for itself in one fused loop; returns prompt + new ids
    ``[1, P + n]``, as ``model.generate`` does. The trimmed head drafts up to ``gamma`` tokens,
    stopping where its confidence drops below ``confidence``; the full head verifies the body's
    stored hidden states in one batched product, and the KV cache rolls back to the first mismatch:
    no body pass is spent on verification (:mod:`trimpass.hf.fused`). Greedy decoding emits the
    full head's argmax of every step; sampling (``do_sample=True``; ``temperature``, ``top_k``,
    ``top_p`` as ``model.generate`` applies them, None: off) is lossless in distribution by
    speculative sampling. Stops at ``max_new_tokens`` or the generation config's EOS.
    ``lookup`` (default True) adds free drafts from the text repeating itself: where the text's
    suffix occurred before, the tokens that followed it (up to 15, or ``lookup`` tokens) are
    verified in one batched body pass, chosen per round over the trimmed self-draft by expected
    tokens per second by the speculation core's controller (:mod:`trimpass.spec.control`);
    ``lookup=False`` drafts with the trimmed head alone
    (a dict of :class:`~trimpass.spec.config.LookupConfig`'s fields, or one, sets more). The
    settings are checked once, as a :class:`~trimpass.spec.config.GenerateConfig`.
    ``suffix`` (default True) adds the suffix index's drafts: the longest earlier occurrence (up to
    64 tokens) of the text's end, in the text itself and in this model's earlier outputs **of the
    same** ``tenant`` (default ``""``: a library caller is one tenant), the continuation most of
    them agree on, priced by the same controller (a dict of
    :class:`~trimpass.spec.config.SuffixConfig`'s fields sets its byte cap, ``share`` across
    tenants, ...). This call's output is kept for the tenant's later calls; :func:`forget` drops
    them. ``tree`` (default True) verifies the free drafts as one tree in one pass: every
    continuation the index knows, best-first by estimated probability, and the lookup draft beside
    them, as many nodes as are worth their measured cost (a dict of
    :class:`~trimpass.spec.config.TreeConfig`'s ``size`` and ``depth``; False: the better chain).
    ``output_cache`` (an :class:`OutputCache`, deprecated: the suffix index keeps outputs per
    tenant) adds its earlier outputs as lookup sources.
    ``speculate=False`` decodes plainly through the same compiled body (the reference for a
    bit-for-bit check), as ``TRIMPASS_DISABLE=1`` does. ``config`` is :class:`TrimConfig`'s.
    Batch 1. :func:`stats` reports the loop's counters."""
    from trimpass.hf import buckets, fused, fused_checks
    from trimpass.hf.sampler import Sampler
    from trimpass.spec.config import GenerateConfig, check_tenant
    fused_checks.check_model(model)
    fused_checks.check_call(input_ids, attention_mask, max_new_tokens)
    settings = GenerateConfig.of(gamma, confidence, lookup, suffix, tree, do_sample=do_sample,
                                 temperature=temperature, top_k=top_k, top_p=top_p)
    check_tenant(tenant)
    buckets.check_length(input_ids.shape[1], max_new_tokens, buckets.context_of(model),
                         input_ids.device)
    fused_checks.check_output_cache(output_cache, settings.lookup_tokens, model)
    if not fused_checks.owned(model):
        return _assisted(model, input_ids, max_new_tokens, settings, speculate, output_cache,
                         config)
    loop = _fused_loop(model, settings, speculate, config)
    model._trimpass_fused = loop  # the one stats(model) reports
    return loop.generate(input_ids, max_new_tokens, Sampler.of(settings.sampling),
                         fused.eos_ids(model), output_cache, _suffix_store(model, settings.suffix),
                         tenant, settings.suffix)


def _suffix_store(model, suffix):
    """The model's earlier outputs for the suffix index (one store per sharing setting, kept on
    the model; the latest call's byte cap applies), or None where the index is off."""
    from trimpass.spec.proposers.suffix import SuffixStore
    if suffix is None:
        return None
    stores = model.__dict__.setdefault("_trimpass_suffix", {})
    store = stores.setdefault(suffix.share, SuffixStore(suffix.max_bytes, suffix.share))
    store.max_bytes = suffix.max_bytes
    return store


def forget(model, tenant: str | None = None) -> None:
    """Drop the earlier outputs :func:`generate` kept for ``tenant`` on ``model`` (None: every
    tenant's), so that none of them drafts again."""
    from trimpass.spec.config import check_tenant
    if tenant is not None:
        check_tenant(tenant)
    for store in model.__dict__.get("_trimpass_suffix", {}).values():
        store.clear(tenant)


def _assisted(model, input_ids, max_new_tokens, settings, speculate, output_cache, config):
    """A family the fused loop does not own yet (:data:`trimpass.hf.fused_checks.OWNED`):
    Hugging Face's assisted generation with the model drafting for itself through its trimmed
    head (:func:`self_drafter`), lossless as the loop is, with one warning that names it."""
    import warnings

    from trimpass.hf import fused_checks
    kind = model.config.get_text_config(decoder=True).model_type
    if output_cache is not None:
        raise TrimpassError(f"output_cache: {kind} runs Hugging Face's assisted generation "
                            "(the fused loop does not own it yet), which takes no lookup drafts; "
                            "drop output_cache")
    if not model.__dict__.get("_trimpass_warned"):
        warnings.warn(f"trimpass.generate: the fused loop does not own {kind} models yet (it owns "
                      f"{', '.join(sorted(set(fused_checks.OWNED.values())))}); decoding with "
                      "Hugging Face's assisted generation and trimpass.self_drafter instead "
                      "(lossless, no lookup drafts)", stacklevel=3)
        model._trimpass_warned = True
    s, draft = settings.sampling, _assistant(model, settings, config) if speculate else None
    with torch.no_grad():
        return model.generate(input_ids, assistant_model=draft, max_new_tokens=max_new_tokens,
                              do_sample=s.do_sample, temperature=s.temperature,
                              top_k=s.top_k or 0, top_p=1.0 if s.top_p is None else s.top_p,
                              pad_token_id=model.generation_config.pad_token_id or 0)


def _assistant(model, settings, config):
    """The self-drafter a model the fused loop does not own decodes with, built on its first use
    and kept on the model."""
    if "_trimpass_assistant" not in model.__dict__:  # not a submodule: no state_dict entries
        model.__dict__["_trimpass_assistant"] = self_drafter(model, settings.gamma,
                                                             settings.confidence, **config)
    return model.__dict__["_trimpass_assistant"]


def _fused_loop(model, settings, speculate, config):
    """The fused loop of ``model`` for one setting (its sampling aside), built on its first use and
    kept on the model."""
    from dataclasses import replace

    from trimpass.hf import fused
    from trimpass.spec.config import Sampling
    key = (replace(settings, sampling=Sampling(), suffix=None), settings.free_tokens,
           settings.suffix is None, bool(speculate), repr(sorted(config.items())))  # the graphs
    loops = model.__dict__.setdefault("_trimpass_loops", {})
    if key not in loops:  # each setting compiles its own step once, kept for its next call
        be = make_backend(**config)
        cfg = be.config

        def plain(gm, example_inputs):
            return compile_inner(gm, example_inputs, cfg.inner, cfg.mode, cfg.options)

        loops[key] = fused.FusedLoop(model, settings, speculate, be, plain)
    return loops[key]


def warm_up(model, draft=None, gamma: int | None = None, confidence: float | None = None,
            speculate: bool = True, lookup: bool | int = True, **config) -> float:
    """Compile, ahead of the first prompt, every graph a route runs; returns the seconds it took
    (0 when done already). No later prompt compiles anything, whatever its length.
    ``warm_up(model, ...)`` with :func:`generate`'s settings warms the fused loop (its first call
    does it too); ``warm_up(model, draft)`` with ``draft = self_drafter(model)`` warms Hugging
    Face's assisted generation with that drafter (its first ``generate`` does not: call this)."""
    from trimpass.hf import fused_checks, selfdraft
    from trimpass.spec.config import GenerateConfig
    fused_checks.check_model(model)
    if draft is not None:
        if gamma is not None or confidence is not None or config or not speculate \
                or lookup is not True:
            raise TrimpassError("warm_up: a self_drafter keeps its own settings; pass only "
                                "model and draft")
        return selfdraft.warm_up(model, draft)
    settings = GenerateConfig.of(gamma, confidence, lookup)
    if not fused_checks.owned(model):  # generate runs Hugging Face's loop with its assistant
        return selfdraft.warm_up(model, _assistant(model, settings, config)) if speculate else 0.0
    with torch.no_grad():
        return _fused_loop(model, settings, speculate, config).warm_up()


def pair(target: torch.nn.Module, draft, k: int = 3):
    """Opt-in target feedback: after each pass of ``target`` (prompt, verification), its top-``k``
    ids at every position join ``draft``'s request rows; no loop change, the target untouched.
    Returns a handle: ``.remove()`` unpairs. See :mod:`trimpass.dynamic.feedback`."""
    from trimpass.dynamic import feedback
    if not _backend_of(draft).config.dynamic:
        raise TrimpassError("pair: draft has a static vocabulary, with no request rows to "
                            "feed; trim it in the dynamic mode (the default)")
    return feedback.pair(target, draft, k, state=active_state)


def active_ids(draft) -> torch.Tensor:
    """The active ids that compact outputs index: ``[B, capacity]`` per batch position of the latest
    call (dynamic; valid up to ``stats(draft)["active"]``) or ``[K]`` (static)."""
    be = _backend_of(draft)
    if not be.config.dynamic:
        return be.config.settings.index(1 << 62, "cpu")[0]
    st = _state(draft, "active_ids")
    return st.active(st.batch or 1)[0]


class _CallableModule(types.ModuleType):
    """Lets ``torch.compile(draft, backend=trimpass)`` take the module itself as the backend."""

    def __call__(self, gm, example_inputs, **kwargs):
        return dynamo_entry(gm, example_inputs, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
