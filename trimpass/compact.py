"""Compact copies of the active rows of an LM head, for devices without the Triton kernel.

On a CPU, gathering ``W[idx]`` on every call costs as much as a large share of the full head, while a
dense matmul on a pre-gathered ``[K, d]`` copy runs from cache. So the CPU path keeps that copy and
refreshes it incrementally: each call compares the id buffer with the snapshot taken at the last
gather (a few microseconds for thousands of ids) and re-gathers only the slots that changed. The copy
is keyed by the weight and the id buffer's shape, and dropped whenever the weight's storage, shape
or version counter changes, so results follow in-place updates (``load_state_dict``, ``copy_``
under ``no_grad``) and re-assigned parameters. The cache holds a strong reference to the weight's
storage, so an address cannot be reused while cached.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

_MAX_ENTRIES = 16


@dataclass
class _Entry:
    storage: torch.UntypedStorage
    w_version: int
    snapshot: torch.Tensor  # [G, CAP] ids the rows were gathered for; -1 = never gathered
    rows: torch.Tensor  # [G, CAP, d]
    bias: torch.Tensor | None  # [G, CAP]
    gathers: int = 0  # rows gathered over the entry's life (for tests and stats)


_cache: OrderedDict[tuple, _Entry] = OrderedDict()


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference-mode tensors carry no version counter
        return -1


def clear() -> None:
    _cache.clear()


def rows_gathered() -> int:
    """Total rows gathered by live cache entries (a test hook for incrementality)."""
    return sum(e.gathers for e in _cache.values())


def compact_rows(weight: torch.Tensor, bias: torch.Tensor | None, idx: torch.Tensor,
                 n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows ``weight[idx[g, j]]`` for ``j < n`` as ``[G, n, d]`` (and bias ``[G, n]``), kept current."""
    G, CAP = idx.shape
    # Not keyed by idx's address: compiled graphs may pass a fresh functional copy every call.
    # The snapshot comparison below finds what changed, whatever buffer the ids arrive in.
    key = (weight.data_ptr(), tuple(weight.shape), weight.stride(), weight.dtype,
           None if bias is None else bias.data_ptr(), G, CAP)
    entry = _cache.get(key)
    w_version = _version(weight) + (0 if bias is None else _version(bias))
    if entry is None or entry.w_version != w_version or w_version < 0:
        entry = _Entry(weight.untyped_storage(), w_version,
                       torch.full((G, CAP), -1, dtype=torch.long, device=idx.device),
                       weight.new_empty((G, CAP, weight.shape[1])),
                       None if bias is None else bias.new_empty((G, CAP)))
        _cache[key] = entry
        while len(_cache) > _MAX_ENTRIES:
            _cache.popitem(last=False)
    _cache.move_to_end(key)
    ids = idx[:, :n]
    stale = ids != entry.snapshot[:, :n]
    if stale.any():
        g, j = stale.nonzero(as_tuple=True)
        new_ids = ids[g, j].long()
        entry.rows[g, j] = weight.index_select(0, new_ids)
        if bias is not None:
            entry.bias[g, j] = bias.index_select(0, new_ids)
        entry.snapshot[g, j] = new_ids
        entry.gathers += int(new_ids.numel())
    return entry.rows[:, :n], None if bias is None else entry.bias[:, :n]
