"""Selections to and from other systems' files.

SGLang's ``--speculative-token-map``: a torch-saved 1-D int64 tensor of hot token ids. EAGLE-3's
draft vocabulary: ``d2t`` (``d2t[i] = hot_id[i] − i``) and ``t2d`` (a ``[V]`` bool mask). FR-Spec's
released ``freq_*.pt``: token ids ordered by frequency (``top_k`` keeps the first K).
"""
from __future__ import annotations

import torch


def export_sglang(ids, path: str) -> None:
    torch.save(torch.as_tensor(ids, dtype=torch.int64).sort().values, path)


def export_eagle3(ids, vocab_size: int, path: str) -> None:
    hot = torch.as_tensor(ids, dtype=torch.int64).sort().values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[hot] = True
    torch.save({"d2t": hot - torch.arange(hot.numel()), "t2d": t2d}, path)


def load_any(path: str, top_k: int | None = None) -> torch.Tensor:
    """Token ids from an SGLang map, EAGLE-3 d2t/t2d, FR-Spec freq list, or trimpass vocab file."""
    obj = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(obj, dict):
        if "d2t" in obj:
            d2t = obj["d2t"].long()
            ids = d2t + torch.arange(d2t.numel())
        elif "t2d" in obj:
            ids = obj["t2d"].nonzero().flatten()
        elif "ids" in obj:
            ids = obj["ids"]
        else:
            raise ValueError(f"{path}: a dict without 'd2t', 't2d' or 'ids' (keys {sorted(obj)})")
    elif isinstance(obj, torch.Tensor) and obj.dtype == torch.bool:
        ids = obj.nonzero().flatten()
    elif isinstance(obj, torch.Tensor):
        ids = obj.flatten()
    else:
        raise ValueError(f"{path}: holds a {type(obj).__name__}, not token ids")
    ids = ids.long()
    return ids[:top_k] if top_k else ids
