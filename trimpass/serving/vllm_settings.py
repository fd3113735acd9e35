"""Where the vLLM workers' trimpass settings come from, importable without vLLM, checked into a
:class:`TrimConfig` for the drafter's vocabulary. First ``TRIMPASS_DISABLE=1`` (off everywhere),
then vLLM's ``additional_config`` under the key ``trimpass`` (what :func:`trimpass.serving.vllm.
engine_args` returns; vLLM 0.32 carries it in its ``VllmConfig`` to every worker, so it must be
JSON: :func:`carried` refuses a setting it cannot carry), then the command line's fallbacks: the
``TRIMPASS_VLLM`` environment variable, then ``trimpass.json`` beside the drafter checkpoint.
Shared by the public face (:mod:`trimpass.serving.vllm`) and the workers' hooks
(:mod:`trimpass.serving.vllm_state`)."""
from __future__ import annotations

import json
import os

from trimpass.config import DYNAMIC_DEFAULTS, FLAT_ESCAPE, TrimConfig, TrimpassError, disabled

SETTINGS_FILE = "trimpass.json"
ENV = "TRIMPASS_VLLM"
# TrimConfig settings this engine's route cannot run: refused by name, not dropped
UNSUPPORTED = {k: "vLLM's route has no escape path (its drafter's logits come from "
               "trimpass.serving.head, which has none)" for k in ("escape", *FLAT_ESCAPE)}
UNSUPPORTED.update({k: f"vLLM's route does not run {k}" for k in ("refresh_every",
                                                                   "refresh_topk")})
RUNS = {"escape": None, "refresh_every": 0}  # what it runs instead, as stats reports
# every other TrimConfig setting of the two modes (a new admission policy's setting comes along)
KEYS = ("vocab", "keep", *(k for k in DYNAMIC_DEFAULTS if k not in UNSUPPORTED))
# check: verify every call (tests); log every N seconds; stats_dir: where workers write counters
EXTRA_KEYS = ("check", "log_interval", "stats_dir")


def hf_config(checkpoint: str) -> dict:
    """A Hugging Face checkpoint directory's ``config.json``."""
    with open(os.path.join(checkpoint, "config.json")) as f:
        return json.load(f)


def vocab_size(checkpoint: str) -> int:
    """The vocabulary size in a Hugging Face checkpoint directory's ``config.json``."""
    cfg = hf_config(checkpoint)
    V = cfg.get("vocab_size", (cfg.get("text_config") or {}).get("vocab_size"))
    if not isinstance(V, int):
        raise ValueError(f"{checkpoint}/config.json: no vocab_size")
    return V


def checked_config(settings: dict, V: int) -> TrimConfig:
    """The settings as a validated :class:`TrimConfig` for a head of ``V`` rows."""
    cannot = sorted(set(settings) & set(UNSUPPORTED))
    if cannot:
        raise TrimpassError(f"{cannot[0]}: {UNSUPPORTED[cannot[0]]}; remove it")
    unknown = sorted(set(settings) - set(KEYS) - set(EXTRA_KEYS))
    if unknown:
        raise TrimpassError(f"{unknown[0]}: not a trimpass setting for vLLM; use {', '.join(KEYS)}"
                            f" (or {', '.join(EXTRA_KEYS)})")
    cfg = TrimConfig(**{k: v for k, v in settings.items() if k in KEYS}, vocab_size=V,
                     escape=None)
    cfg.settings.check_vocab_size(V)
    return cfg


def carried(settings: dict, where: str = "additional_config") -> dict:
    """``settings`` as vLLM's ``additional_config`` carries them to the workers: JSON (vLLM
    hashes it as JSON and sends it to every worker); a value it cannot carry is refused by
    name."""
    for k, v in settings.items():
        try:
            same = json.loads(json.dumps(v, allow_nan=False)) == v
        except (TypeError, ValueError):
            same = False
        if not same:
            raise TrimpassError(f"{k}: {where} carries JSON values only (lists, numbers, strings, "
                                f"dicts) to vLLM's workers, got {type(v).__name__}; give a list "
                                "or a file path")
    return settings


def _settings_file(drafter_dir: str | None) -> dict | None:
    path = os.path.join(drafter_dir or "", SETTINGS_FILE)
    if not drafter_dir or not os.path.isfile(path):
        return None
    with open(path) as f:
        return dict(json.load(f))


def resolve(drafter_dir: str | None, additional=None) -> dict | None:
    """The trim settings a worker uses, or None when trimming is off: ``TRIMPASS_DISABLE=1``
    wins, then ``additional`` (``additional_config["trimpass"]``), then ``TRIMPASS_VLLM``
    (``0``/``1`` or a JSON object), then ``trimpass.json`` beside the drafter checkpoint
    (``{"trim": false}`` turns it off)."""
    if disabled():
        return None
    env = os.environ.get(ENV, "").strip()
    if additional is not None:
        d = dict(additional)
    elif env:
        if env in ("0", "false"):
            return None
        return {} if env in ("1", "true") else dict(json.loads(env))
    else:
        d = _settings_file(drafter_dir)
        if d is None:
            return None
    d.pop("budget", None)
    return d if d.pop("trim", True) else None


def resolve_budget(drafter_dir: str | None, additional=None) -> dict | None:
    """The D-Cut settings a worker uses (``budget`` in ``additional``, else in
    ``trimpass.json``), or None: off with ``TRIMPASS_DISABLE=1`` or without either. Independent
    of trimming."""
    if disabled():
        return None
    d = dict(additional) if additional is not None else _settings_file(drafter_dir)
    return None if d is None else d.get("budget")


def budget_settings(budget, gamma_max: int) -> dict:
    """A budget given as a policy name or a dict, checked against ``gamma_max``."""
    from trimpass.spec.control.policies import POLICIES, check_settings
    if isinstance(budget, str):
        budget = {"policy": budget}
    if not isinstance(budget, dict):
        raise ValueError(f"budget: expected a policy name ({', '.join(POLICIES)}) or a dict of "
                         f"budget settings, got {type(budget).__name__}")
    return check_settings(budget, gamma_max)
