"""Trimmed-vocabulary LM head:
``out[g, r, j] = epilogue(x[g, r, :] . W[idx[g, j], :] + bias[idx[g, j]])``.

The active ids live in a capacity-sized buffer ``idx[G, CAP]`` with a device-side count
``count[G]`` (G = 1 for a static vocabulary, G = batch rows for the dynamic one). The grid is
static: programs whose block of ids starts past the count exit before touching ``W``, so a launch
needs no host read of the count and can be captured in a CUDA graph. Two output layouts: compact
(column ``j``) and scattered into a V-sized row (column ``idx[g, j]``), whose caller pre-fills
``-inf``. Scale and soft-capping are applied to active logits only, so an inactive id never becomes
finite. The file holds, in order: the kernel, its autotune configs (``CONFIGS``; the launcher's
``config=`` pins one, so tests can run each under the interpreter), the launcher, and a pure-torch
reference with the same signature.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from trimpass import base


@triton.jit
def _trimmed_head_kernel(
    x_ptr, w_ptr, b_ptr, idx_ptr, cnt_ptr, out_ptr,
    R, D, CAP, M_BUCKET,
    stride_xg, stride_xr, stride_wv, stride_ig, stride_og, stride_or,
    scale, softcap,
    HAS_BIAS: tl.constexpr, SCATTER: tl.constexpr, FILL_TAIL: tl.constexpr,
    SOFTCAP: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_k = tl.program_id(0)
    pid_m = tl.program_id(1)
    g = tl.program_id(2).to(tl.int64)
    count = tl.minimum(tl.load(cnt_ptr + g).to(tl.int32), CAP)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < R
    out_rows = out_ptr + g * stride_og + offs_m[:, None].to(tl.int64) * stride_or
    if pid_k * BLOCK_K >= count:
        if FILL_TAIL:
            tail = tl.full([BLOCK_M, BLOCK_K], float("-inf"), tl.float32)
            tl.store(out_rows + offs_k[None, :], tail.to(out_ptr.dtype.element_ty),
                     mask=mask_m[:, None] & (offs_k[None, :] < CAP))
        return
    mask_k = offs_k < count
    ids = tl.load(idx_ptr + g * stride_ig + offs_k, mask=mask_k, other=0).to(tl.int64)
    x_rows = x_ptr + g * stride_xg + offs_m[:, None].to(tl.int64) * stride_xr
    w_rows = w_ptr + ids[None, :] * stride_wv
    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        a = tl.load(x_rows + offs_d[None, :], mask=mask_m[:, None] & mask_d[None, :], other=0.0)
        b = tl.load(w_rows + offs_d[:, None], mask=mask_d[:, None] & mask_k[None, :], other=0.0)
        if UPCAST:
            # the Triton interpreter's bf16 tl.dot returns garbage; fp32 operands are exact there
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + ids, mask=mask_k, other=0.0).to(tl.float32)[None, :]
    acc = acc * tl.cast(scale, tl.float32)
    if SOFTCAP:
        cap = tl.cast(softcap, tl.float32)
        acc = cap * (2.0 * tl.sigmoid(2.0 * (acc / cap)) - 1.0)
    if SCATTER:
        cols = ids
        mask_store = mask_m[:, None] & mask_k[None, :]
    else:
        cols = offs_k.to(tl.int64)
        if FILL_TAIL:
            acc = tl.where(mask_k[None, :], acc, float("-inf"))
            mask_store = mask_m[:, None] & (offs_k[None, :] < CAP)
        else:
            mask_store = mask_m[:, None] & mask_k[None, :]
    tl.store(out_rows + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask_store)


INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_K": bk, "BLOCK_D": bd}, num_warps=w, num_stages=s)
    for bm, bk, bd, w, s in [
        (16, 32, 128, 4, 3), (16, 64, 128, 4, 3), (16, 128, 64, 4, 4), (16, 64, 256, 8, 3),
        (32, 64, 128, 4, 3), (64, 64, 64, 4, 3), (64, 128, 64, 8, 3), (128, 128, 64, 8, 3),
    ]
]
# The interpreter cannot time configs ("0 active drivers"), so the tuner gets exactly one there;
# tests run every one of CONFIGS by passing ``config=`` to the launcher.
_INTERPRET_CONFIGS = [triton.Config({"BLOCK_M": 16, "BLOCK_K": 32, "BLOCK_D": 64})]


def _prune(configs, named_args, **kwargs):
    bucket = named_args["M_BUCKET"]
    kept = [c for c in configs if c.kwargs["BLOCK_M"] <= max(16, bucket)]
    return kept or configs[:1]


_tuned_kernel = triton.autotune(
    configs=_INTERPRET_CONFIGS if INTERPRET else CONFIGS,
    key=["M_BUCKET", "D", "CAP", "SCATTER"],
    prune_configs_by={"early_config_prune": _prune},
)(_trimmed_head_kernel)


def _m_bucket(rows: int) -> int:
    return 1 << max(0, min(rows, 128) - 1).bit_length()


def trimmed_head(x: torch.Tensor, weight: torch.Tensor, idx: torch.Tensor, count: torch.Tensor,
                 bias: torch.Tensor | None = None, *, scale: float = 1.0, softcap: float = 0.0,
                 out: torch.Tensor | None = None, scatter: bool = False,
                 fill_tail: bool = True, config: triton.Config | None = None) -> torch.Tensor:
    """Launch the kernel on ``x[G, R, d]``, ``idx[G, CAP]``, ``count[G]``; metadata must be checked.

    Compact mode writes ``out[G, R, CAP]`` (``-inf`` past the count when ``fill_tail``); scatter
    mode writes active columns of a caller-provided ``out[G, R, V]`` and leaves the rest untouched.
    ``config`` (one of :data:`CONFIGS`) pins the launch to that config instead of the autotuner's.
    """
    G, R, D = x.shape
    CAP = idx.shape[1]
    if out is None:
        out = torch.empty((G, R, CAP), device=x.device, dtype=x.dtype)
    if R == 0 or CAP == 0:
        return out
    upcast = INTERPRET and x.dtype == torch.bfloat16
    kernel, meta = (_tuned_kernel, {}) if config is None else \
        (_trimmed_head_kernel, config.all_kwargs())
    grid = lambda m: (triton.cdiv(CAP, m["BLOCK_K"]), triton.cdiv(R, m["BLOCK_M"]), G)  # noqa: E731
    kernel[grid](
        x, weight, bias if bias is not None else weight, idx, count, out,
        R, D, CAP, _m_bucket(R),
        x.stride(0), x.stride(1), weight.stride(0), idx.stride(0), out.stride(0), out.stride(1),
        float(scale), float(softcap) if softcap else 1.0,
        HAS_BIAS=bias is not None, SCATTER=scatter, FILL_TAIL=fill_tail and not scatter,
        SOFTCAP=bool(softcap), UPCAST=upcast, **meta,
    )
    return out


def best_config() -> str | None:
    """The config the autotuner picked last (None before any tuned launch)."""
    cfg = getattr(_tuned_kernel, "best_config", None)
    return None if cfg is None else str(cfg)


def trimmed_head_reference(x: torch.Tensor, weight: torch.Tensor, idx: torch.Tensor,
                           count: torch.Tensor, bias: torch.Tensor | None = None, *,
                           scale: float = 1.0, softcap: float = 0.0,
                           out: torch.Tensor | None = None, scatter: bool = False,
                           fill_tail: bool = True) -> torch.Tensor:
    """Pure-torch reference of :func:`trimmed_head`, same signature and layout, fp32 maths."""
    G, R, _ = x.shape
    CAP = idx.shape[1]
    if out is None:
        out = torch.empty((G, R, CAP), device=x.device, dtype=x.dtype)
    for g in range(G):
        n = min(int(count[g]), CAP)
        ids = idx[g, :n].long()
        z = x[g].float() @ weight[ids].float().T
        if bias is not None:
            z = z + bias[ids].float()
        z = base.softcap(z * scale, softcap)
        if scatter:
            out[g][:, ids] = z.to(out.dtype)
        else:
            out[g, :, :n] = z.to(out.dtype)
            if fill_tail:
                out[g, :, n:] = float("-inf")
    return out
