"""trimpass in vLLM (tested with 0.32.0): the public face, importable without vLLM.

vLLM runs a ``draft_model`` drafter (or an EAGLE one, ``method="eagle"``/``"eagle3"``:
:mod:`trimpass.serving.vllm_eagle`) with its own KV cache and batching and computes its logits
outside any graph trimpass compiles. Trimming is switched on by configuration alone:
:func:`engine_args` checks the two checkpoints and the settings and returns the keyword arguments
for ``vllm.LLM(...)``, the settings in vLLM's ``additional_config`` under ``"trimpass"``, which
vLLM carries to every worker process; there the ``vllm.general_plugins`` entry point
:func:`register` installs the wrappers of :mod:`trimpass.serving.vllm_compat` (the one module that
touches vLLM), whose state lives in :mod:`trimpass.serving.vllm_state`. :func:`cli_args` gives the
same as the OpenAI server's command-line flags. The command line's fallbacks, where
``--additional-config`` is not given: the ``TRIMPASS_VLLM`` environment variable (a JSON object of
settings, or ``1``) and ``trimpass.json`` beside the drafter checkpoint (:func:`settings_dir`
writes one into a linked copy in trimpass's cache). ``TRIMPASS_DISABLE=1`` turns it off
everywhere. Without settings the plugin does nothing. Which vLLM versions run what:
:mod:`trimpass.serving.vllm_version`. :func:`stats` sums the workers' counters from the user's
process.
"""
from __future__ import annotations

import hashlib
import json
import os

from trimpass.cache import cache_dir
from trimpass.config import TrimpassError, disabled
from trimpass.serving import vllm_compat as compat
from trimpass.serving import vllm_version
from trimpass.serving.vllm_eagle import METHODS, check_drafter, check_method
from trimpass.serving.vllm_settings import (  # noqa: F401  (the public face keeps these names)
    ENV,
    EXTRA_KEYS,
    KEYS,
    RUNS,
    SETTINGS_FILE,
    carried,
    checked_config,
    hf_config,
    resolve,
    resolve_budget,
    vocab_size,
)
from trimpass.spec.control.policies import POLICIES
from trimpass.spec.control.policies import check_settings as check_budget

TESTED_VERSION = vllm_version.TESTED[-1]
EXTRA_HINT = vllm_version.EXTRA_HINT


def _vllm_version() -> str:
    return vllm_version.verdict().version


def check_version(version: str | None = None, *, self_drafting: bool = False) -> None:
    """Refuse (one sentence, naming the symbol) a vLLM whose symbols differ from what trimpass
    relies on, and the target drafting for itself on an untested one; warn once on an untested
    one that matches (:mod:`trimpass.serving.vllm_version`)."""
    vllm_version.require(vllm_version.verdict(version), self_drafting=self_drafting)


def same_checkpoint(a: str, b: str) -> bool:
    """Whether checkpoint directory ``b`` is ``a`` (the same directory, or every file of ``b``
    but ``trimpass.json`` a link to ``a``'s file of the same name)."""
    a, b = os.path.realpath(a), os.path.realpath(b)
    if a == b:
        return True
    names = [n for n in os.listdir(b) if n != SETTINGS_FILE]
    return bool(names) and all(os.path.realpath(os.path.join(b, n)) ==
                               os.path.realpath(os.path.join(a, n)) for n in names)


def _budget_settings(budget) -> dict | None:
    if budget is None:
        return None
    if isinstance(budget, str):
        return {"policy": budget}
    if isinstance(budget, dict):
        return dict(budget)
    raise ValueError(f"budget: expected a policy name ({', '.join(POLICIES)}) or a dict of "
                     f"budget settings, got {type(budget).__name__}")


def _jsonable(v):
    if hasattr(v, "tolist"):
        return v.tolist()
    return list(v) if isinstance(v, (tuple, set, range)) else v


def engine_args(target_dir: str, drafter_dir: str | None = None, num_speculative_tokens: int = 4,
                trim: bool = True, budget: str | dict | None = None, method: str = "draft_model",
                **trim_settings) -> dict:
    """Keyword arguments for ``vllm.LLM(**engine_args(...), dtype=..., ...)``: ``target_dir``
    served with ``drafter_dir`` as its ``draft_model`` drafter (None: the target drafting for
    itself, greedy: vLLM's CPU build is not lossless under sampling even untrimmed), whose head
    trimpass trims to each request's active ids (``trim=False``: the same drafter untrimmed).
    ``method="eagle"`` or ``"eagle3"`` serves ``drafter_dir`` as an EAGLE drafter instead, its
    head trimmed the same way (an EAGLE-3 head with its own ``d2t`` vocabulary: to the active ids
    inside it), after :func:`trimpass.serving.vllm_eagle.check_drafter`.
    ``trim_settings`` are :class:`trimpass.TrimConfig`'s engine settings (``vocab``, ``keep``,
    ``capacity``, ``core``, ``learn_core``, ``successors``, ``max_rows``; ``max_rows`` defaults to
    vLLM's ``max_num_seqs``). Everything is checked here, before an engine starts, the installed
    vLLM too (:func:`check_version`: the target drafting for itself, ``drafter_dir`` None or the
    target's checkpoint, only on a tested one). The settings go in ``additional_config`` under
    ``"trimpass"``, which vLLM carries to every worker (JSON values only: another is refused by
    name); nothing is written to disk. vLLM 0.32's draft-model route loads the drafter's weights
    again, even when it is the target. A target
    mixing sliding and full attention layers also gets ``disable_hybrid_kv_cache_manager=True``
    (vLLM 0.32's draft-model route needs the drafter's layers in one KV-cache group).

    ``budget`` turns on D-Cut (:mod:`trimpass.spec.control.controller`), trimmed or not: ``"dcut"``,
    ``"all-or-nothing"``, ``{"policy": "fixed", "gamma": k}``, ``"none"`` (speculation paused),
    ``"off"``, or a dict that also sets ``buckets`` (allowed totals of verified drafted tokens)
    ``measure_s`` (seconds for the start-up cost measurement, <= 30) and ``probe`` (the share
    of the seconds saved by skipped proposals that probes, drafted anyway to keep the timings
    current, may spend: in (0, 1], 1/16 by default; :mod:`trimpass.spec.control.schedule`);
    ``num_speculative_tokens`` is then the longest draft (gamma_max). :func:`set_budget` changes
    the policy of a running engine. The target drafting for itself uses the target's own KV
    cache (:mod:`trimpass.serving.vllm_kv`): its first forward runs over each request's next
    token alone, and a step that drafts nothing runs no drafter forward; another drafter runs its
    first forward there, as vLLM does."""
    budget = _budget_settings(budget)
    if budget is not None:
        budget = check_budget(budget, num_speculative_tokens)
    check_method(method)
    if drafter_dir is None and method != "draft_model":
        raise ValueError(f"drafter_dir: method={method!r} needs an EAGLE drafter checkpoint; "
                         "None (the target drafting for itself) is the draft_model route")
    own = drafter_dir is None or same_checkpoint(target_dir, drafter_dir)
    if trim or budget is not None:
        check_version(self_drafting=own and method == "draft_model")
    drafter_dir = target_dir if drafter_dir is None else drafter_dir
    check_drafter(target_dir, drafter_dir, method)
    Vt, Vd = vocab_size(target_dir), vocab_size(drafter_dir)
    if Vt != Vd:
        raise ValueError(f"vocab size: the drafter {drafter_dir} has {Vd} ids but the target "
                         f"{target_dir} has {Vt}; trimpass serves a drafter of the target's "
                         "vocabulary")
    settings = {k: _jsonable(v) for k, v in trim_settings.items()}
    if trim:
        checked_config(carried(settings), Vd)
    elif trim_settings:
        raise TrimpassError(f"{next(iter(trim_settings))}: a trim setting with trim=False")
    args = {"model": target_dir,
            "speculative_config": {"method": method, "model": drafter_dir,
                                   "num_speculative_tokens": int(num_speculative_tokens)}}
    if trim or budget is not None:
        entry = {"trim": bool(trim), **settings}
        args["additional_config"] = {compat.ADDITIONAL_KEY: entry if budget is None else
                                     {**entry, "budget": budget}}
    # vLLM 0.32's draft-model proposer needs all drafter layers in one KV-cache group; a hybrid
    # sliding/full target (Gemma 3) splits them unless the hybrid KV-cache manager is off
    if len(set(hf_config(target_dir).get("layer_types") or ())) > 1:
        args["disable_hybrid_kv_cache_manager"] = True
    return args


def cli_args(args: dict) -> list[str]:
    """:func:`engine_args`' result as the OpenAI server's command-line flags (after ``--model
    TARGET``): ``--speculative-config``, ``--additional-config`` and, where needed,
    ``--disable-hybrid-kv-cache-manager``."""
    out = ["--speculative-config", json.dumps(args["speculative_config"])]
    if "additional_config" in args:
        out += ["--additional-config", json.dumps(args["additional_config"])]
    if args.get("disable_hybrid_kv_cache_manager"):
        out.append("--disable-hybrid-kv-cache-manager")
    return out


def settings_dir(drafter_dir: str, settings: dict) -> str:
    """The command line's fallback where ``--additional-config`` cannot be given: a drafter
    checkpoint for ``--speculative-config``, a directory of the trimpass cache (one per checkpoint
    and settings) with a link to each file of ``drafter_dir`` and ``trimpass.json`` holding
    ``settings`` (as in ``additional_config["trimpass"]``); the user's directory is only read."""
    src = os.path.abspath(drafter_dir)
    text = json.dumps(settings, sort_keys=True)
    key = hashlib.sha1(f"{src}\n{text}".encode()).hexdigest()[:16]
    out = os.path.join(cache_dir(), "vllm", f"{os.path.basename(src)}-{key}")
    os.makedirs(out, exist_ok=True)
    names = set(os.listdir(src)) - {SETTINGS_FILE}
    for name in set(os.listdir(out)) - names - {SETTINGS_FILE}:
        os.remove(os.path.join(out, name))  # a file the checkpoint no longer has
    for name in names:
        if not os.path.lexists(os.path.join(out, name)):
            os.symlink(os.path.join(src, name), os.path.join(out, name))
    tmp = os.path.join(out, f".{SETTINGS_FILE}.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(out, SETTINGS_FILE))  # workers never read half a file
    return out


def stats(llm) -> dict:
    """The trimming counters of every worker of ``llm`` (a ``vllm.LLM``), summed: ``calls``
    (trimmed-head calls), ``fallbacks`` (drafter logits computed by the plain head), ``rows``
    (live request rows), ``mean_active`` (active ids per request row per call), ``mean_union``
    (distinct ids computed per call), ``bytes_per_row``, ``workers`` (those trimming),
    ``proposals`` and ``propose_s`` (draft proposals and their seconds, trimmed or not);
    ``plain_steps`` (engine steps that verified no draft and so ran vLLM's plain sampler, not its
    rejection sampler: one worker's count); with the
    ``check`` setting also ``checked``, ``violations`` and the isolation check's ``foreign``,
    ``missing`` and ``isolation_checked``, and ``first``: each proposal's first drafted row, by the
    request's first tokens and length (:class:`trimpass.serving.vllm_check.CheckedTrimmer`);
    ``runs``: what this route runs where it differs from :class:`trimpass.TrimConfig`'s defaults
    (no escape path, no refresh); ``shared_cache``: where the target drafts for itself on its own
    KV cache, ``first_pass_rows`` (rows its next-token first forwards ran) and
    ``cache_unused_bytes`` (the drafter's own cache, allocated by vLLM, unused); ``lookup_live``:
    requests holding a lookup index, where the budget drafts lookups; ``budget_s``: the seconds
    of the budget's own host work (its decisions, cuts and lookups; the driver worker's). All zero
    when nothing trims."""
    every = [s for s in compat.rpc(llm, "trimpass_stats") if s]
    got = [s for s in every if "calls" in s]
    out = {"workers": len(got), "proposals": sum(s["proposals"] for s in every),
           "propose_s": sum(s["propose_s"] for s in every),
           "plain_steps": max((s.get("plain_steps", 0) for s in every), default=0)}
    for k in ("calls", "fallbacks", "rows", "active_sum", "row_calls", "union_sum", "checked",
              "violations", "steps", "foreign", "missing", "isolation_checked"):
        out[k] = sum(s.get(k, 0) for s in got)
    out["mean_active"] = out.pop("active_sum") / max(out.pop("row_calls"), 1)
    out["mean_union"] = out.pop("union_sum") / max(out["calls"], 1)
    out["bytes_per_row"] = max((s.get("bytes_per_row", 0) for s in got), default=0)
    out["max_abs_err"] = max((s.get("max_abs_err", 0.0) for s in got), default=0.0)
    out["runs"] = dict(RUNS)  # the engine's own defaults, where they differ from TrimConfig's
    shared = [s["shared_cache"] for s in every if "shared_cache" in s]
    if shared:  # the target drafting for itself on its own cache, summed over the workers
        out["shared_cache"] = {k: sum(s[k] for s in shared) for k in shared[0]}
    out["budget_s"] = max((s.get("budget_s", 0.0) for s in every), default=0.0)
    if any("lookup_live" in s for s in every):  # requests with a lookup index, the driver's
        out["lookup_live"] = max(s.get("lookup_live", 0) for s in every)
    budgets = [s["budget"] for s in every if "budget" in s]
    if budgets:  # the driver worker's: its drafts are the ones the scheduler takes
        out["budget"] = budgets[0]
    seen: dict = {}
    for s in got:
        for rid, ids in s.get("seen", {}).items():
            seen.setdefault(rid, set()).update(ids)
    if seen:
        out["seen"] = seen
    first = [s["first"] for s in got if s.get("first")]
    if first:  # check mode: the driver worker's first-draft logits per (request, length)
        out["first"] = first[0]
    return out


def set_budget(llm, budget: str | dict) -> dict:
    """Change the D-Cut policy of a running engine started with ``engine_args(..., budget=...)``
    (same forms as there); returns the settings now in force. The cost model is kept."""
    settings = _budget_settings(budget)
    check_budget(settings, compat.llm_gamma(llm))
    return compat.rpc(llm, "trimpass_budget", settings)[0]


def check_startup(speculative_config, version: str | None = None, target_dir: str | None = None,
                  additional_config=None) -> None:
    """What an engine is started with, checked before it starts (in the process that parses its
    arguments: the API server, or ``vllm.LLM``'s caller): the settings (``additional_config``'s
    ``trimpass`` entry, else ``TRIMPASS_VLLM``, else the drafter's ``trimpass.json``) must be a
    JSON object of known settings valid for the drafter's vocabulary, with a valid budget;
    trimming needs a vLLM trimpass runs (``version``: the installed one by default; the target
    drafting for itself: a tested one), a drafter whose logits come from its ``compute_logits``
    (not ``use_local_argmax_reduction``) and, on an EAGLE route, a drafter that agrees with
    ``target_dir`` (:func:`check_drafter`). Raises a :class:`TrimpassError` naming where the
    settings came from and the setting."""
    sc = speculative_config
    if isinstance(sc, str):
        sc = json.loads(sc)
    if not isinstance(sc, dict) or sc.get("method") not in METHODS or not sc.get("model"):
        return
    drafter = str(sc["model"])
    extra = additional_config.get(compat.ADDITIONAL_KEY) if isinstance(additional_config,
                                                                        dict) else None
    where = os.path.join(drafter, SETTINGS_FILE)
    if extra is not None:
        where = f"additional_config[{compat.ADDITIONAL_KEY!r}]"
    elif os.environ.get(ENV, "").strip():
        where = f"the {ENV} environment variable"
    try:
        if extra is not None and not isinstance(extra, dict):
            raise TypeError(f"got {type(extra).__name__}")
        settings, budget = resolve(drafter, extra), resolve_budget(drafter, extra)
        if extra is not None:
            carried(extra, where)
    except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
        raise TrimpassError(f"{where}: not a JSON object of trimpass settings ({e}); fix it, or "
                            "remove it to serve untrimmed") from None
    except TrimpassError as e:
        raise TrimpassError(f"{where}: {e}") from None
    if settings is None and budget is None:
        return
    own = bool(target_dir) and sc["method"] == "draft_model" and \
        os.path.isdir(str(target_dir)) and same_checkpoint(str(target_dir), drafter)
    try:
        vllm_version.require(vllm_version.verdict(version), self_drafting=own,
                             where=f"{where} asks for trimming")
    except ImportError as e:
        raise TrimpassError(f"{where} asks for trimming: {e}") from None
    if settings is not None and sc.get("use_local_argmax_reduction"):
        raise TrimpassError(f"{where} asks for trimming, but use_local_argmax_reduction takes "
                            "the drafter's tokens without its compute_logits, which trimpass "
                            "trims; drop one of the two")
    try:
        if settings is not None:
            checked_config(settings, vocab_size(drafter))
        if budget is not None:
            check_budget(_budget_settings(budget), int(sc.get("num_speculative_tokens") or 0))
    except (TrimpassError, ValueError, TypeError) as e:
        raise TrimpassError(f"{where}: {e}") from None
    if target_dir and os.path.isfile(os.path.join(str(target_dir), "config.json")):
        try:
            check_drafter(str(target_dir), drafter, sc["method"])
        except (ValueError, TypeError) as e:
            raise TrimpassError(str(e)) from None


def register() -> None:
    """The ``vllm.general_plugins`` entry point: runs in every vLLM process. Installs the
    wrappers of :mod:`trimpass.serving.vllm_compat` (each inert unless trimming is asked for) and
    the start-up check (:func:`check_startup`), which refuses bad settings, a vLLM whose symbols
    differ (naming the symbol), and the target drafting for itself on an untested vLLM, before an
    engine starts. On a vLLM whose symbols differ only the start-up check is installed."""
    if disabled():
        return
    from trimpass.serving.vllm_state import Hooks
    v = vllm_version.verdict()
    hooks = Hooks(lambda spec, target, extra: check_startup(spec, v.version, target, extra),
                  self_drafting_ok=v.tested)
    guard = compat.PATCHES[0]
    if v.accepted:
        compat.install(hooks)
    elif not any(m.startswith(guard) for m in v.mismatches):
        compat.install(hooks, places=(guard,))
    if not v.accepted and os.environ.get(ENV, "").strip() not in ("", "0", "false"):
        vllm_version.require(v, self_drafting=False)
