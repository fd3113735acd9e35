"""Compact copies of the active rows of an LM head, for devices without the Triton kernel.

On a CPU, gathering ``W[idx]`` on every call costs a large share of the full head, while a dense
matmul on a pre-gathered ``[K, d]`` copy runs from cache. So the CPU path keeps that copy and
refreshes it incrementally: each call compares the id buffer with the snapshot taken at the last
gather (one ``torch.equal``, about a microsecond for thousands of ids) and re-gathers only the slots
that changed. The copy is keyed by the weight and the id buffer's shape and dtype, and dropped
whenever the weight's storage, shape or version counter changes, so results follow in-place updates
(``load_state_dict``, ``copy_`` under ``no_grad``) and re-assigned parameters. A weight made under
``torch.inference_mode`` has no version counter, so its rows are re-gathered on every call (exact,
at the cost of the gather). The cache holds a strong reference to the weight's storage, so an
address cannot be reused while cached.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

_MAX_ENTRIES = 16


@dataclass
class _Entry:
    storage: torch.UntypedStorage
    w_version: int | None  # None: the weight (or bias) has no version counter
    snapshot: torch.Tensor  # [G, CAP] ids the rows were gathered for; -1 = never gathered
    rows: torch.Tensor  # [G, CAP, d]
    bias: torch.Tensor | None  # [G, CAP]
    gathers: int = 0  # rows gathered over the entry's life (for tests and stats)
    views: tuple = (-1,)  # (n, snapshot[:, :n], rows[:, :n], bias[:, :n]), made once per n
    src: tuple = (None,)  # (idx, n, idx[:, :n], its flat view if G = 1) of the last call


_cache: OrderedDict[tuple, _Entry] = OrderedDict()


def _version(weight: torch.Tensor, bias: torch.Tensor | None) -> int | None:
    if weight.is_inference() or (bias is not None and bias.is_inference()):
        return None
    return weight._version + (0 if bias is None else bias._version)


def clear() -> None:
    _cache.clear()


def rows_gathered() -> int:
    """Total rows gathered by live cache entries (a test hook for incrementality)."""
    return sum(e.gathers for e in _cache.values())


def compact_rows(weight: torch.Tensor, bias: torch.Tensor | None, idx: torch.Tensor,
                 n: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Rows ``weight[idx[g, j]]`` for ``j < n`` as ``[G, n, d]`` (bias ``[G, n]``), kept current,
    and for G = 1 the ids ``idx[..., :n]`` as a flat view; ``idx`` is ``[G, CAP]`` or ``[CAP]``."""
    G, CAP = (1, idx.shape[0]) if idx.dim() == 1 else idx.shape
    # Not keyed by idx's address: compiled graphs may pass a fresh functional copy every call.
    # The snapshot comparison below finds what changed, whatever buffer the ids arrive in.
    key = (weight.data_ptr(), weight.shape, weight.stride(), weight.dtype,
           None if bias is None else bias.data_ptr(), G, CAP, idx.dtype)
    entry = _cache.get(key)
    w_version = _version(weight, bias)
    if entry is None or entry.w_version != w_version:
        entry = _Entry(weight.untyped_storage(), w_version,
                       torch.full((G, CAP), -1, dtype=idx.dtype, device=idx.device),
                       weight.new_empty((G, CAP, weight.shape[1])),
                       None if bias is None else bias.new_empty((G, CAP)))
        _cache[key] = entry
        while len(_cache) > _MAX_ENTRIES:
            _cache.popitem(last=False)
    _cache.move_to_end(key)
    # The views are cached (each costs about a microsecond to make); the values are always read.
    if entry.views[0] != n:
        entry.views = (n, entry.snapshot[:, :n], entry.rows[:, :n],
                       None if bias is None else entry.bias[:, :n])
    if entry.src[0] is not idx or entry.src[1] != n:
        ids = idx.view(G, CAP)[:, :n]
        entry.src = (idx, n, ids, ids[0] if G == 1 else None)
    _, snapshot, rows, brows = entry.views
    ids = entry.src[2]
    if w_version is None:
        snapshot.fill_(-1)  # no version counter: nothing proves the rows are still current
    if not torch.equal(ids, snapshot):
        with torch.no_grad():
            g, j = (ids != snapshot).nonzero(as_tuple=True)
            new_ids = ids[g, j]
            entry.rows[g, j] = weight.index_select(0, new_ids)
            if bias is not None:
                entry.bias[g, j] = bias.index_select(0, new_ids)
            snapshot[g, j] = new_ids
        entry.gathers += int(new_ids.numel())
    return rows, brows, entry.src[3]
