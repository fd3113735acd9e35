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

For one id group (a static vocabulary, batch 1, a serving batch's union), :func:`linear` also keeps
a copy packed for oneDNN once the rows have stayed unchanged for ``PACK_AFTER`` calls: a plain
matmul re-lays the weight out on every call, which here costs about a quarter of a bf16 head and
half of an fp32 one at several rows. Which of the two is faster is measured once per entry and row
count's power-of-two bucket (a serving batch's size changes every few steps; each measurement costs
a few calls), on the call's own inputs with the caches evicted before each timed call (inside a
model step
the layers' weights evict the head's rows between two calls; measured here, the packed copy is then
1.2-2x as fast, while for one fp32 row on warm caches the two tie), so a CPU where packing does not
pay keeps the plain matmul.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from trimpass import measure

_MAX_ENTRIES = 16
PACK_AFTER = 4  # unchanged calls before packing: a pack costs about as much as 3-4 calls
# what packed_pays writes to evict the caches: a VM reports its host's whole last-level cache
# (480 MB here), and twice that, allocated and written six times a decision, stalled a vLLM worker
EVICT_BYTES = 64 << 20
_unpackable: dict[torch.dtype, str] = {}  # dtypes oneDNN failed to pack or run here, and why


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
    stable: int = 0  # calls since the rows last changed
    packed: torch.Tensor | None = None  # rows[0, :n] packed for oneDNN, while they are unchanged
    faster: dict = field(default_factory=dict)  # rows bucket -> whether the packed copy was faster


_cache: OrderedDict[tuple, _Entry] = OrderedDict()


def _version(weight: torch.Tensor, bias: torch.Tensor | None) -> int | None:
    if weight.is_inference() or (bias is not None and bias.is_inference()):
        return None
    return weight._version + (0 if bias is None else bias._version)


def clear() -> None:
    _cache.clear()


def forget(weight: torch.Tensor, keep_capacity: int) -> None:
    """Drop ``weight``'s compact copies of every capacity but ``keep_capacity`` (a caller whose id
    buffer grew no longer uses the smaller ones)."""
    key = weight.data_ptr()
    for k in [k for k in _cache if k[0] == key and k[6] != keep_capacity]:
        del _cache[k]


def nbytes(t: torch.Tensor | None) -> int:
    """Bytes of ``t``'s elements (0 for None); also for oneDNN's packed layout."""
    return 0 if t is None else t.numel() * t.element_size()


def held_bytes() -> dict:
    """Bytes the live cache entries hold: ``rows`` (their compact copies, ids and biases) and
    ``packed`` (oneDNN's packed copies of them)."""
    return {"rows": sum(nbytes(e.rows) + nbytes(e.snapshot) + nbytes(e.bias)
                        for e in _cache.values()),
            "packed": sum(nbytes(e.packed) for e in _cache.values())}


def rows_gathered() -> int:
    """Total rows gathered by live cache entries (a test hook for incrementality)."""
    return sum(e.gathers for e in _cache.values())


def _refresh(weight: torch.Tensor, bias: torch.Tensor | None, idx: torch.Tensor,
             n: int) -> _Entry:
    """The cache entry of ``weight`` for ids like ``idx``, its rows current for ``idx[:, :n]``."""
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
        entry.stable, entry.packed = 0, None
        entry.views = (n, entry.snapshot[:, :n], entry.rows[:, :n],
                       None if bias is None else entry.bias[:, :n])
    if entry.src[0] is not idx or entry.src[1] != n:
        ids = idx.view(G, CAP)[:, :n]
        entry.src = (idx, n, ids, ids[0] if G == 1 else None)
    snapshot, ids = entry.views[1], entry.src[2]
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
        entry.stable, entry.packed = 0, None
    return entry


def compact_rows(weight: torch.Tensor, bias: torch.Tensor | None, idx: torch.Tensor,
                 n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows ``weight[idx[g, j]]`` for ``j < n`` as ``[G, n, d]`` (bias ``[G, n]``), kept current;
    ``idx`` is ``[G, CAP]`` or ``[CAP]``."""
    entry = _refresh(weight, bias, idx, n)
    return entry.views[2], entry.views[3]


def linear(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, idx: torch.Tensor,
           n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x2[M, d] @ weight[idx[:n]].T`` (plus the bias) for one id group, on the cached rows
    (packed once they are stable and packing is faster), and the ids ``idx[:n]`` as a flat view."""
    entry = _refresh(weight, bias, idx, n)
    rows, brows = entry.views[2][0], entry.views[3]
    brows = None if brows is None else brows[0]
    if entry.stable >= PACK_AFTER and n:
        if entry.packed is None:
            entry.packed = pack(rows)
        M = 1 << (x2.shape[0] - 1).bit_length()  # the row count's power-of-two bucket
        if entry.packed is not None and entry.faster.get(M) is None:
            entry.faster[M] = packed_pays(x2, entry.packed, brows,
                                          lambda: F.linear(x2, rows, brows))
        if entry.packed is not None and entry.faster[M]:
            return packed_linear(x2, entry.packed, brows), entry.src[3]
    entry.stable += 1
    return F.linear(x2, rows, brows), entry.src[3]


def pack(w: torch.Tensor) -> torch.Tensor | None:
    """``w[N, K]`` packed for oneDNN's linear (:func:`packed_linear`), or None where this torch,
    device or dtype cannot pack it (a dtype that failed once is not tried again)."""
    if w.device.type != "cpu" or w.dtype in _unpackable or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 1)
    except (RuntimeError, AttributeError, NotImplementedError) as e:  # an op or dtype not built
        _failed(w.dtype, e)
        return None


def packed_linear(x2: torch.Tensor, packed: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x2[M, K] @ w.T`` (plus ``bias``) on ``packed = pack(w)``."""
    return torch.ops.mkldnn._linear_pointwise(x2.contiguous(), packed, bias, "none", [None], "")


def packed_pays(x2: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                plain: Callable[[], object]) -> bool:
    """Whether :func:`packed_linear` on these inputs beats ``plain()`` (:func:`measure.faster`);
    False if it fails here (its dtype is then never packed again)."""
    try:
        packed_linear(x2, packed, bias)  # oneDNN makes its primitive on the first call
    except (RuntimeError, NotImplementedError) as e:
        _failed(x2.dtype, e)
        return False
    return measure.faster(lambda: packed_linear(x2, packed, bias), plain,
                          before=measure.cache_evictor(EVICT_BYTES))


def _failed(dtype: torch.dtype, e: Exception) -> None:
    _unpackable[dtype] = f"{type(e).__name__}: {e}"


def packing() -> dict:
    """Whether this torch has oneDNN to pack with, and the dtypes it failed on (with why)."""
    return {"available": torch.backends.mkldnn.is_available(),
            "failed": {str(k): v for k, v in _unpackable.items()}}
