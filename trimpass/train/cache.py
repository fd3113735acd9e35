"""The target-output cache: the target runs once over the training sequences and, per position, its
top-k logits and their ids, the logsumexp of its FULL logits / T (fp32) and its greedy token are
kept in one safetensors file, named by a hash of (model key, the token data, k, T), so training
never runs the target again and a rerun reloads the file. k = 32 by default: on Gemma-3's
262,144-token vocabulary that is 1/8000 of V, yet it holds nearly all of the target's mass at almost
every position, which is what the sampling losses (WTV, KL) need on the active columns — the mass
outside the top-k enters only through the full logsumexp, as mass the drafter cannot match (the
losses' subset semantics), and the greedy token is the top-1 itself, so greedy (EAL) training is
exact. A file that cannot be read, or does not match its name's inputs, raises ``ValueError`` naming
it and asking to delete it, before any compute.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import torch

from trimpass.cache import cache_dir
from trimpass.progress import progress

__all__ = ["TargetCache", "cache_key", "build_cache", "load_cache"]

K_DEFAULT = 32
_FIELDS = ("ids", "topk_logits", "topk_ids", "lse", "greedy")


@dataclass
class TargetCache:
    """ids [N, S] int64; topk_logits [N, S, k] fp32 (raw logits, descending); topk_ids [N, S, k]
    int64; lse [N, S] fp32, logsumexp(full logits / temperature); greedy [N, S] int64 (position
    j's outputs predict token j + 1)."""
    ids: torch.Tensor
    topk_logits: torch.Tensor
    topk_ids: torch.Tensor
    lse: torch.Tensor
    greedy: torch.Tensor
    vocab_size: int
    temperature: float
    key: str
    path: str | None = None

    @property
    def k(self) -> int:
        return self.topk_ids.shape[-1]


def cache_key(model_key: str, ids: torch.Tensor, k: int, temperature: float) -> str:
    h = hashlib.sha256()
    h.update(f"{model_key}\0{k}\0{float(temperature)!r}\0{tuple(ids.shape)}\0".encode())
    h.update(ids.to(torch.int64).contiguous().numpy().tobytes())
    return h.hexdigest()[:32]


def _check_ids(ids):
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point() \
            or ids.numel() == 0:
        raise ValueError("ids must be a non-empty int tensor of token sequences [N, S]")


def load_cache(path: str, expect_key: str | None = None) -> TargetCache:
    """Read a cache file; a corrupt or mismatched file raises ValueError naming it."""
    from safetensors import safe_open
    fix = f"target cache {path} is corrupt or unreadable; delete it and rerun to rebuild it"
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            t = {name: f.get_tensor(name) for name in _FIELDS}
        key, V, T = meta["key"], int(meta["vocab_size"]), float(meta["temperature"])
    except Exception as e:  # safetensors' own errors, missing keys, bad metadata
        raise ValueError(f"{fix} ({type(e).__name__}: {e})") from None
    N, S = t["ids"].shape if t["ids"].dim() == 2 else (-1, -1)
    k = t["topk_ids"].shape[-1] if t["topk_ids"].dim() == 3 else -1
    shapes = {"ids": (N, S), "topk_logits": (N, S, k), "topk_ids": (N, S, k), "lse": (N, S),
              "greedy": (N, S)}
    if N < 1 or k < 1 or any(tuple(t[n].shape) != s for n, s in shapes.items()):
        raise ValueError(f"{fix} (inconsistent shapes)")
    if expect_key is not None and key != expect_key:
        raise ValueError(f"{fix} (it holds key {key}, its name says {expect_key})")
    return TargetCache(t["ids"].long(), t["topk_logits"].float(), t["topk_ids"].long(),
                       t["lse"].float(), t["greedy"].long(), V, T, key, path)


@torch.no_grad()
def build_cache(target, ids: torch.Tensor, *, model_key: str, k: int = K_DEFAULT,
                temperature: float = 1.0, batch: int = 4, directory: str | None = None,
                path: str | None = None) -> TargetCache:
    """Run ``target`` (an HF causal LM) over ``ids`` [N, S] once and cache its outputs (see the
    module docstring); reload the file when it exists. ``model_key`` names the target (e.g.
    ``"gemma3-270m/fp32"``); the file is ``directory``/``<hash>.safetensors`` (default: the
    trimpass cache's ``targets`` folder) unless ``path`` is given."""
    _check_ids(ids)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    t = float(temperature)
    if not t > 0 or t == float("inf"):
        raise ValueError(f"temperature must be finite and > 0, got {temperature!r}")
    key = cache_key(model_key, ids, k, t)
    if path is None:
        path = os.path.join(directory or os.path.join(cache_dir(), "targets"),
                            f"{key}.safetensors")
    if os.path.exists(path):
        return load_cache(path, expect_key=key)
    V = target.get_output_embeddings().weight.shape[0]
    if k > V:
        raise ValueError(f"k={k} is larger than the target's vocabulary V={V}")
    if int(ids.min()) < 0 or int(ids.max()) >= V:
        raise ValueError(f"ids hold tokens outside the target's vocabulary [0, {V})")
    ids = ids.long().cpu()
    dev = next(target.parameters()).device
    out = {n: [] for n in _FIELDS[1:]}
    for i in progress(range(0, len(ids), batch), desc="target cache",
                      total=-(-len(ids) // batch)):
        logits = target(ids[i:i + batch].to(dev)).logits.float()
        vals, idx = logits.topk(k, -1)
        out["topk_logits"].append(vals.cpu())
        out["topk_ids"].append(idx.cpu())
        out["lse"].append(torch.logsumexp(logits / t, -1).cpu())
        out["greedy"].append(idx[..., 0].cpu())
    c = TargetCache(ids, *(torch.cat(out[n]) for n in _FIELDS[1:]), V, t, key, path)
    from safetensors.torch import save_file
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.part"
    save_file({"ids": c.ids, "topk_logits": c.topk_logits, "topk_ids": c.topk_ids.int(),
               "lse": c.lse, "greedy": c.greedy.int()}, tmp,
              metadata={"key": key, "vocab_size": str(V), "temperature": repr(t),
                        "model_key": model_key})
    os.replace(tmp, path)
    return c
