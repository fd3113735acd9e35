"""Where token ids enter trimpass: checked once here, so the per-step ops only check metadata.

A static vocabulary is given as a list or 1-D tensor of token ids, or as a path to a file saved with
``torch.save`` holding a 1-D int64 tensor (a dict with key ``"ids"`` is accepted too). Every value
check — range, duplicates, emptiness, integer dtype — happens in :func:`as_index`, at configuration
time, with an error that names the argument and says what to do.
"""
from __future__ import annotations

import os
from collections.abc import Iterable

import torch


def load_ids(path: str | os.PathLike, name: str = "vocab") -> torch.Tensor:
    """Read a vocabulary file: a torch-saved 1-D integer tensor, or a dict with key ``ids``."""
    if not os.path.isfile(path):
        raise ValueError(f"{name}: no such file {str(path)!r}; pass a list of ids, a tensor, or a "
                         "file written by `python -m trimpass select --out`")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file gets the same advice
        raise ValueError(f"{name}: could not read {str(path)!r} as a torch-saved tensor "
                         f"({e})") from e
    if isinstance(obj, dict):
        if "ids" not in obj:
            raise ValueError(f"{name}: {str(path)!r} holds a dict without key 'ids' "
                             f"(keys: {sorted(obj)[:8]})")
        obj = obj["ids"]
    if not isinstance(obj, torch.Tensor):
        raise ValueError(f"{name}: {str(path)!r} holds a {type(obj).__name__}, not a tensor of ids")
    return obj


def as_ids(ids, name: str = "vocab") -> torch.Tensor:
    """Any accepted form of a vocabulary as a CPU int64 1-D tensor (values not yet checked)."""
    if isinstance(ids, (str, os.PathLike)):
        ids = load_ids(ids, name)
    if isinstance(ids, torch.Tensor):
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise TypeError(f"{name}: token ids must be integers, got a {ids.dtype} tensor")
        t = ids.detach().to("cpu", torch.int64)
    elif isinstance(ids, Iterable):
        items = list(ids)
        if any(not isinstance(i, int) or isinstance(i, bool) for i in items):
            bad = next(i for i in items if not isinstance(i, int) or isinstance(i, bool))
            raise TypeError(f"{name}: token ids must be integers, got {bad!r}")
        t = torch.tensor(items, dtype=torch.int64)
    else:
        raise TypeError(f"{name}: expected a list or 1-D tensor of token ids or a file path, got "
                        f"{type(ids).__name__}")
    if t.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D list of token ids, got shape {tuple(t.shape)}")
    return t


def check_ids(t: torch.Tensor, vocab_size: int | None, name: str = "vocab") -> None:
    """Raise if ``t`` is empty, has negative ids, ids >= ``vocab_size``, or duplicates."""
    if t.numel() == 0:
        raise ValueError(f"{name}: is empty; keep at least one token id (e.g. the EOS token)")
    if int(t.min()) < 0:
        raise ValueError(f"{name}: has negative token id {int(t.min())}; ids start at 0")
    if vocab_size is not None and int(t.max()) >= vocab_size:
        raise ValueError(f"{name}: has token id {int(t.max())} but the head has only {vocab_size} "
                         "rows; was the list made with another tokenizer?")
    uniq = torch.unique(t)
    if uniq.numel() != t.numel():
        lo = int(t.min())
        dup = int(uniq[torch.bincount(t - lo).index_select(0, uniq - lo) > 1][0])
        raise ValueError(f"{name}: token id {dup} appears more than once; pass each id once")


def as_index(ids, vocab_size: int | None = None, keep: Iterable[int] = (), *,
             device: torch.device | str | None = None, name: str = "vocab"
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked ``(idx, count)`` for the ops: sorted unique ids (``ids`` ∪ ``keep``), their
    count."""
    t = as_ids(ids, name)
    check_ids(t, vocab_size, name)
    kept = as_ids(list(keep), "keep")
    if kept.numel():
        check_ids(kept, vocab_size, "keep")
        t = torch.cat([t, kept])
    idx = torch.unique(t)  # sorted: ascending ids read W in address order
    count = torch.tensor([idx.numel()], dtype=torch.int32)
    return idx.to(device), count.to(device)
