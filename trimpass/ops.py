"""The trimmed LM-head ops, ``torch.library`` custom ops in the ``trimpass`` namespace.

Each op takes ``x[..., d]``, the full head ``weight[V, d]`` (maybe a bias) and the active ids as
a capacity-sized buffer ``idx`` with a device-side ``count`` (``idx[CAP]``/``count[1]`` shared, or
``idx[G, CAP]``/``count[G]`` with ``x[G, ..., d]``, one vocabulary per batch row); only metadata is
checked, so a step never syncs with the host (ids are checked where they enter,
:func:`trimpass.vocab.as_index`). On CUDA (or when forced, e.g. under ``TRITON_INTERPRET=1``) the
Triton kernel runs; on CPU a dense matmul on a cached compact copy of the active rows
(:mod:`trimpass.compact`), whose logits go into the ``-inf`` row by the counts the host reads for
free there. They are plain ``Library`` ops, not ``triton_op``: ``wrap_triton`` fails in Dynamo's
fake-tensor tracing under the interpreter, and the CPU cache must stay opaque to the compiler.
"""
from __future__ import annotations

from collections import Counter

import torch

from trimpass import compact
from trimpass.base import filled, softcap, threads, use_kernel, use_triton  # noqa: F401

calls: Counter = Counter()  # real (non-fake) executions per op, for tests and stats


def check_head_args(x, weight, bias, idx, count) -> int:
    """Check a head call's metadata; return G, the number of id groups. Raises before any launch."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x: expected a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
    if weight.dim() != 2:
        raise ValueError(f"weight: expected the full head as [V, d], got shape "
                         f"{tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x and weight: hidden sizes differ (x has d={x.shape[-1]}, weight has "
                         f"d={weight.shape[1]}); pass the head's input, not another activation")
    if x.dtype != weight.dtype:
        raise TypeError(f"x and weight: dtypes differ ({x.dtype} vs {weight.dtype}); cast one")
    if not weight.is_contiguous():
        raise ValueError("weight: must be contiguous [V, d] (row-major); call .contiguous() once "
                         "at setup, not per step")
    if idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"idx: token ids must be int32 or int64, got {idx.dtype}")
    if count.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"count: must be an int32 or int64 tensor, got {count.dtype}")
    for name, t in (("weight", weight), ("idx", idx), ("count", count), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: on {t.device} but x is on {x.device}; move it to {x.device}")
    if bias is not None and (tuple(bias.shape) != (weight.shape[0],) or bias.dtype != weight.dtype):
        raise ValueError(f"bias: expected shape ({weight.shape[0]},) and dtype {weight.dtype}, "
                         f"got {tuple(bias.shape)} {bias.dtype}")
    if idx.dim() not in (1, 2) or idx.shape[-1] == 0:
        raise ValueError(f"idx: expected a non-empty [CAP] or [G, CAP] id buffer, got "
                         f"{tuple(idx.shape)}")
    G = 1 if idx.dim() == 1 else idx.shape[0]
    if G > 1 and (x.dim() < 2 or x.shape[0] != G):
        raise ValueError(f"x: with per-row ids idx[{G}, CAP], x must be [{G}, ..., d], got "
                         f"{tuple(x.shape)}")
    if count.numel() != G:
        raise ValueError(f"count: expected {G} element(s) (one per id group), got {count.numel()}")
    return G


def _grouped(x, idx, count, G):
    x3 = x.reshape(G, -1, x.shape[-1])
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    return x3, idx.reshape(G, -1), count.reshape(G)


def _host_counts(cnt: torch.Tensor, cap: int) -> list[int]:
    # The torch path reads the counts: free on CPU, a device sync where it is forced on CUDA.
    return [min(max(c, 0), cap) for c in cnt.tolist()]


def _torch_logits(x3, weight, bias, idx2, counts, scale, cap):
    """``[G, R, max(counts)]`` logits from the cached compact rows; a group's slots at or past its
    own count hold junk, which callers cut off."""
    if x3.shape[0] == 1:
        z = compact.linear(x3[0], weight, bias, idx2, max(counts))[0][None]
    else:
        rows, brows = compact.compact_rows(weight, bias, idx2, max(counts))
        z = (torch.bmm(x3, rows.transpose(1, 2)) if brows is None
             else torch.baddbmm(brows[:, None, :], x3, rows.transpose(1, 2)))
    if scale != 1.0:
        z.mul_(scale)
    return softcap(z, cap, inplace=True)


def _cut(z3: torch.Tensor, counts: list[int], cap: int, fill: float) -> torch.Tensor:
    """``z3[G, R, n]`` widened to a new ``[G, R, cap]`` with ``fill`` at and past each count."""
    out = torch.empty((*z3.shape[:2], cap), dtype=z3.dtype, device=z3.device)
    out[:, :, :z3.shape[2]] = z3
    for g, c in enumerate(counts):
        out[g, :, c:] = fill
    return out


def _place(z3: torch.Tensor, idx2: torch.Tensor, counts: list[int], V: int,
           fill: float) -> torch.Tensor:
    """``z3[g, :, :count]`` at columns ``idx2[g, :count]`` of a new ``[G, R, V]`` of ``fill``. The
    ids within a count are distinct: ``as_index`` and the dynamic state keep them a set."""
    G, R = z3.shape[:2]
    out = filled((G, R, V), fill, z3)
    for g, c in enumerate(counts):
        if c:
            ids = idx2[g, :c]
            out[g].index_copy_(1, ids if ids.dtype == torch.long else ids.long(), z3[g, :, :c])
    return out


def _full_one(x, weight, bias, idx, count, scale, cap):
    """``head_full``'s torch path for one id group (a static vocabulary, or batch 1): the common
    case, with as few tensor views as possible (each costs about a microsecond on this hot path).
    Also returns the compact logits ``[R, n]``."""
    V, d = weight.shape
    n = min(max(int(count), 0), idx.shape[-1])
    x2 = x if x.dim() == 2 else x.reshape(-1, d)
    z, cols = compact.linear(x2, weight, bias, idx, n)
    if scale != 1.0:
        z.mul_(scale)
    softcap(z, cap, inplace=True)
    out = filled((*x.shape[:-1], V), float("-inf"), x)
    out2 = out if x.dim() == 2 else out.view(-1, V)
    out2.index_copy_(1, cols if cols.dtype == torch.long else cols.long(), z)
    return out, z


def _compact_logits(x3, weight, bias, idx2, cnt, scale, cap):
    CAP = idx2.shape[1]
    if use_triton(x3):
        from trimpass.kernels import trimmed_head as kernel
        return kernel.trimmed_head(x3, weight, idx2, cnt, bias, scale=scale, softcap=cap)
    counts = _host_counts(cnt, CAP)
    z = _torch_logits(x3, weight, bias, idx2, counts, scale, cap)
    return z if min(counts) == CAP else _cut(z, counts, CAP, float("-inf"))


def mask_tail(t3: torch.Tensor, cnt: torch.Tensor, fill: float) -> torch.Tensor:
    """A new ``t3[G, R, CAP]`` with entries at or past each group's count replaced by ``fill``."""
    if t3.device.type == "cpu":
        return _cut(t3, _host_counts(cnt, t3.shape[-1]), t3.shape[-1], fill)
    valid = torch.arange(t3.shape[-1], device=t3.device) < cnt.reshape(-1, 1, 1)
    return torch.where(valid, t3, torch.full((), fill, dtype=t3.dtype, device=t3.device))


def _head_compact(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  idx: torch.Tensor, count: torch.Tensor, scale: float = 1.0,
                  softcap: float = 0.0) -> torch.Tensor:
    """Logits over the active ids, ``[..., CAP]``; ``-inf`` past the count."""
    G = check_head_args(x, weight, bias, idx, count)
    calls["head_compact"] += 1
    x3, idx2, cnt = _grouped(x, idx, count, G)
    out = _compact_logits(x3, weight, bias, idx2, cnt, scale, softcap)
    return out.reshape(*x.shape[:-1], idx2.shape[1])


def _head_compact_fake(x, weight, bias, idx, count, scale=1.0, softcap=0.0):
    check_head_args(x, weight, bias, idx, count)
    return x.new_empty((*x.shape[:-1], idx.shape[-1]))


def _head_full(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               idx: torch.Tensor, count: torch.Tensor, scale: float = 1.0,
               softcap: float = 0.0) -> torch.Tensor:
    """V-sized logits: exact on the active ids, ``-inf`` everywhere else."""
    return full_and_last(x, weight, bias, idx, count, scale, softcap)[0]


def full_and_last(x, weight, bias, idx, count, scale, softcap):
    """``head_full``'s output and, on the torch path, each id group's compact logits at its last
    position (``[G, n]``, junk past a group's count; None from the Triton kernel)."""
    G = check_head_args(x, weight, bias, idx, count)
    calls["head_full"] += 1
    if G == 1 and not use_triton(x):
        out, z = _full_one(x, weight, bias, idx, count, scale, softcap)
        return out, z[-1:]
    x3, idx2, cnt = _grouped(x, idx, count, G)
    V = weight.shape[0]
    if use_triton(x3):
        from trimpass.kernels import trimmed_head as kernel
        out = filled((G, x3.shape[1], V), float("-inf"), x)
        kernel.trimmed_head(x3, weight, idx2, cnt, bias, scale=scale, softcap=softcap, out=out,
                            scatter=True)
        last = None
    else:
        counts = _host_counts(cnt, idx2.shape[1])
        z = _torch_logits(x3, weight, bias, idx2, counts, scale, softcap)
        out, last = _place(z, idx2, counts, V, float("-inf")), z[:, -1]
    return out.reshape(*x.shape[:-1], V), last


def head_full_meta(x, weight, bias, idx, count, scale=1.0, softcap=0.0):
    check_head_args(x, weight, bias, idx, count)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _scatter(c3, idx2, cnt, V, fill):
    if c3.device.type == "cpu":
        return _place(c3, idx2, _host_counts(cnt, idx2.shape[1]), V, fill)
    # No host read on a device: slots past the count hold stale ids; they write `fill`, and amax
    # keeps any real value (every value is >= fill: -inf for logits, 0 for probabilities).
    vals = mask_tail(c3, cnt, fill)
    cols = idx2.long().clamp(0, V - 1)[:, None, :].expand_as(vals)
    out = filled((*vals.shape[:-1], V), fill, vals)
    return out.scatter_reduce_(-1, cols, vals, "amax", include_self=True)


def _scatter_full(compact_values: torch.Tensor, idx: torch.Tensor, count: torch.Tensor,
                  vocab_size: int, fill: float) -> torch.Tensor:
    """Place ``compact_values[..., CAP]`` at columns ``idx`` of a ``[..., V]`` row of ``fill``."""
    calls["scatter_full"] += 1
    G = 1 if idx.dim() == 1 else idx.shape[0]
    c3 = compact_values.reshape(G, -1, idx.shape[-1])
    out = _scatter(c3, idx.reshape(G, -1), count.reshape(G), vocab_size, fill)
    return out.reshape(*compact_values.shape[:-1], vocab_size)


def _scatter_full_fake(compact_values, idx, count, vocab_size, fill):
    return compact_values.new_empty((*compact_values.shape[:-1], vocab_size))


def _mask_inactive(compact_values: torch.Tensor, idx: torch.Tensor, count: torch.Tensor,
                   fill: float) -> torch.Tensor:
    """``compact_values[..., CAP]`` with slots at or past the count set to ``fill``."""
    G = 1 if idx.dim() == 1 else idx.shape[0]
    c3 = compact_values.reshape(G, -1, idx.shape[-1])
    return mask_tail(c3, count.reshape(G), fill).reshape(compact_values.shape)


def _mask_inactive_fake(compact_values, idx, count, fill):
    return torch.empty_like(compact_values)


def map_ids(positions: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary ids of compact ``positions[..., k]`` (``idx[CAP]`` or ``idx[G, CAP]``)."""
    if idx.dim() == 1:
        return idx.long()[positions]
    G = idx.shape[0]
    flat = positions.reshape(G, -1)
    return torch.gather(idx.long(), 1, flat).reshape(positions.shape)


def _head_topk(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               idx: torch.Tensor, count: torch.Tensor, k: int, scale: float = 1.0,
               softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` logits over the active ids and their full-vocabulary ids; no V-sized tensor."""
    G = check_head_args(x, weight, bias, idx, count)
    if not 1 <= k <= idx.shape[-1]:
        raise ValueError(f"k: must be in [1, CAP={idx.shape[-1]}], got {k}")
    calls["head_topk"] += 1
    x3, idx2, cnt = _grouped(x, idx, count, G)
    logits = _compact_logits(x3, weight, bias, idx2, cnt, scale, softcap)
    values, pos = logits.topk(k, dim=-1)
    ids = torch.gather(idx2.long()[:, None, :].expand(-1, pos.shape[1], -1), 2, pos)
    lead = x.shape[:-1]
    return values.reshape(*lead, k), ids.reshape(*lead, k)


def _head_topk_fake(x, weight, bias, idx, count, k, scale=1.0, softcap=0.0):
    check_head_args(x, weight, bias, idx, count)
    shape = (*x.shape[:-1], k)
    return x.new_empty(shape), x.new_empty(shape, dtype=torch.long)


# Registered through torch.library.Library rather than @custom_op: the op sits on the drafter's hot
# path and @custom_op's Python autograd and dynamo-disable wrappers cost ~30 us a call on this CPU,
# as much as the whole matmul of a 1k-row head. No autograd kernel: graphs needing gradients are
# never rewritten.
_lib = torch.library.Library("trimpass", "DEF")
HEAD_ARGS = "Tensor x, Tensor weight, Tensor? bias, Tensor idx, Tensor count"
_SCHEMAS = {
    "head_compact": (f"({HEAD_ARGS}, float scale=1.0, float softcap=0.0) -> Tensor",
                     _head_compact, _head_compact_fake),
    "head_full": (f"({HEAD_ARGS}, float scale=1.0, float softcap=0.0) -> Tensor",
                  _head_full, head_full_meta),
    "head_topk": (f"({HEAD_ARGS}, int k, float scale=1.0, float softcap=0.0) -> (Tensor, Tensor)",
                  _head_topk, _head_topk_fake),
    "scatter_full": ("(Tensor compact_values, Tensor idx, Tensor count, SymInt vocab_size, "
                     "float fill) -> Tensor", _scatter_full, _scatter_full_fake),
    "mask_inactive": ("(Tensor compact_values, Tensor idx, Tensor count, float fill) -> Tensor",
                      _mask_inactive, _mask_inactive_fake),
}


def register(lib: torch.library.Library, schemas: dict) -> None:
    """Define each ``{name: (schema, impl, fake)}`` op in ``lib`` (CPU and CUDA alike)."""
    for name, (schema, impl, fake) in schemas.items():
        lib.define(name + schema)
        lib.impl(name, impl, "CompositeExplicitAutograd")
        torch.library.register_fake(f"trimpass::{name}", fake, lib=lib)


register(_lib, _SCHEMAS)

head_compact = torch.ops.trimpass.head_compact
head_full = torch.ops.trimpass.head_full
head_topk = torch.ops.trimpass.head_topk
scatter_full = torch.ops.trimpass.scatter_full
mask_inactive = torch.ops.trimpass.mask_inactive


def __getattr__(name: str):
    # the dynamic vocabulary's ops live in trimpass.dynamic.ops (registered when trimpass is
    # imported); looked up here by name so that trimpass.ops.head_full_escape keeps working
    if name in ("head_full_escape", "admit", "active", "refresh"):
        return getattr(torch.ops.trimpass, name)
    raise AttributeError(f"module 'trimpass.ops' has no attribute {name!r}")
