"""vLLM's EAGLE routes (``method="eagle"`` and ``"eagle3"``): what an EAGLE drafter checkpoint must
agree on with its target, checked before an engine starts. vLLM 0.32 builds the drafter class from
the checkpoint's architecture (``LlamaForCausalLM`` becomes ``EagleLlamaForCausalLM`` or
``Eagle3LlamaForCausalLM``), feeds it the target's hidden states (EAGLE-3: several layers' of them,
which the target must expose through ``SupportsEagle3``) and computes its logits in the drafter's
``compute_logits``, which trimpass trims as on the ``draft_model`` route
(:mod:`trimpass.serving.vllm_trim`). An EAGLE-3 head may have its own smaller vocabulary: row
``i`` scores target id ``i + d2t[i]`` (:class:`trimpass.serving.head.DraftVocab`). Importable
without vLLM; only the target's class check loads vLLM's model registry."""
from __future__ import annotations

import glob
import os

import torch

from trimpass.serving import vllm_compat as compat
from trimpass.serving.head import check_draft_map
from trimpass.serving.vllm_settings import hf_config, vocab_size

METHODS = ("draft_model", "eagle", "eagle3")


def _text(cfg: dict) -> dict:
    return cfg.get("text_config") or cfg


def read_tensor(checkpoint: str, suffix: str) -> torch.Tensor | None:
    """The checkpoint's tensor whose name ends with ``suffix`` (safetensors or a PyTorch
    ``.bin``), or None."""
    from safetensors import safe_open
    for path in sorted(glob.glob(os.path.join(checkpoint, "*.safetensors"))):
        with safe_open(path, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                if name == suffix or name.endswith("." + suffix):
                    return f.get_tensor(name)
    for path in sorted(glob.glob(os.path.join(checkpoint, "*.bin"))):
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        for name, t in state.items():
            if name == suffix or name.endswith("." + suffix):
                return t
    return None


def check_method(method) -> None:
    if method not in METHODS:
        raise ValueError(f"method: {method!r} is not a vLLM route trimpass trims; use one of "
                         f"{', '.join(METHODS)}")


def check_drafter(target_dir: str, drafter_dir: str, method: str) -> None:
    """Refuse, naming the file and what disagrees, an EAGLE drafter that vLLM would fail on in
    its workers or serve wrongly: another hidden size or vocabulary than the target's, a ``d2t``
    map with ids outside the target's vocabulary or two draft ids on one target id, a target or
    drafter architecture without vLLM's EAGLE support for ``method``."""
    check_method(method)
    if method == "draft_model":
        return
    t, d = _text(hf_config(target_dir)), _text(hf_config(drafter_dir))
    where = os.path.join(drafter_dir, "config.json")
    hs = d.get("target_hidden_size") or d.get("hidden_size")
    if hs != t.get("hidden_size"):
        raise ValueError(f"{where}: the drafter reads hidden states of size {hs}, but the target "
                         f"{target_dir} has hidden_size {t.get('hidden_size')}; use an EAGLE "
                         "drafter trained for this target")
    V, Vd = vocab_size(target_dir), vocab_size(drafter_dir)
    if Vd != V:
        raise ValueError(f"{where}: vocab_size {Vd}, but the target {target_dir} has {V}; use an "
                         "EAGLE drafter trained for this target")
    draft_V = d.get("draft_vocab_size") or V
    if draft_V != V and method == "eagle":
        raise ValueError(f"{where}: draft_vocab_size {draft_V} is an EAGLE-3 head's own "
                         "vocabulary; serve it with method='eagle3'")
    if draft_V > V:
        raise ValueError(f"{where}: draft_vocab_size {draft_V} exceeds the target's {V} ids")
    if draft_V < V:
        d2t = read_tensor(drafter_dir, "d2t")
        if d2t is None:
            raise ValueError(f"{drafter_dir}: draft_vocab_size {draft_V} < vocab_size {V}, but "
                             "the checkpoint has no d2t tensor mapping draft ids to target ids")
        if d2t.numel() != draft_V:
            raise ValueError(f"{drafter_dir}: d2t has {d2t.numel()} entries for draft_vocab_size "
                             f"{draft_V}")
        d2t = d2t.reshape(-1).long()
        check_draft_map(torch.arange(draft_V) + d2t, V, f"{drafter_dir}: d2t")
    _check_classes(t.get("architectures") or hf_config(target_dir).get("architectures") or [],
                   d.get("architectures") or [], method, target_dir, where)


def _drafter_arch(arch: str, method: str) -> str:
    """The class vLLM 0.32 builds for a drafter of ``arch`` (its ``EAGLEConfig``'s rule)."""
    if method == "eagle":
        return arch if arch.startswith("Eagle") else f"Eagle{arch}"
    return arch if arch.startswith("Eagle3") or arch.endswith("Eagle3") else f"Eagle3{arch}"


def _check_classes(target_archs: list, drafter_archs: list, method: str, target_dir: str,
                   where: str) -> None:
    known = compat.supported_archs()
    built = [_drafter_arch(a, method) for a in drafter_archs]
    if not any(a in known for a in built):
        raise ValueError(f"{where}: architectures {drafter_archs}: vLLM has no {method} drafter "
                         f"class {' or '.join(built) or '(none named)'}; use an EAGLE checkpoint "
                         "of an architecture vLLM drafts with (e.g. LlamaForCausalLM)")
    if method == "eagle3" and not any(compat.supports_eagle3(a) for a in target_archs):
        raise ValueError(f"method: the target {target_dir} ({', '.join(target_archs)}) does "
                         "not give vLLM's EAGLE-3 drafters its layers' hidden states "
                         "(SupportsEagle3); use method='eagle' or 'draft_model'")
