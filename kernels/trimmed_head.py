"""Trimmed-vocabulary LM head:
``out[g, r, j] = epilogue(x[g, r, :] . W[idx[g, j], :] + bias[idx[g, j]])``.

The active ids live in a capacity-sized buffer ``idx[G, CAP]`` with a device-side count
``count[G]`` (G = 1 for a static vocabulary, G = batch rows for the dynamic one). The grid is
static: programs whose block of ids starts past the count exit before touching ``W``, so a launch
needs no host read of the count and can be captured in a CUDA graph. Two output layouts: compact
(column ``j``) and scattered into a V-sized row (column ``idx[g, j]``), whose caller pre-fills
``-inf``. Scale and soft-capping are applied to active logits only, so an inactive id never becomes
finite. One row (a decode step) runs without tl.dot on blocks of at most 16 ids, so one request
spreads over more programs than an H200 has SMs; more rows run tl.dot on 16- to 64-row tiles, with
fp32 operands multiplied in fp32 ("ieee", not TF32). The file holds, in order: the kernel, its
autotune configs (``CONFIGS``; the launcher's ``config=`` pins one, so tests can run each under
the interpreter), the launcher, and a pure-torch reference with the same signature.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from trimpass import base
from trimpass.kernels import require_triton


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
    x_rows = x_ptr + g * stride_xg + offs_m.to(tl.int64) * stride_xr
    if BLOCK_M == 1:
        # one row: no tl.dot (it needs 16 rows); fp32 products summed along d in a
        # [BLOCK_K, BLOCK_D] tile, reduced once at the end, in the same order on every launch
        w_rows = w_ptr + ids[:, None] * stride_wv
        part = tl.zeros([BLOCK_K, BLOCK_D], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            mask_d = offs_d < D
            a = tl.load(x_rows + offs_d, mask=mask_m & mask_d, other=0.0)
            b = tl.load(w_rows + offs_d[None, :], mask=mask_k[:, None] & mask_d[None, :],
                        other=0.0)
            part += b.to(tl.float32) * a.to(tl.float32)[None, :]
        acc = tl.sum(part, axis=1)[None, :]
    else:
        w_rows = w_ptr + ids[None, :] * stride_wv
        acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            mask_d = offs_d < D
            a = tl.load(x_rows[:, None] + offs_d[None, :], mask=mask_m[:, None] & mask_d[None, :],
                        other=0.0)
            b = tl.load(w_rows + offs_d[:, None], mask=mask_d[:, None] & mask_k[None, :],
                        other=0.0)
            if UPCAST:
                # the Triton interpreter's bf16 tl.dot returns garbage; fp32 operands are exact
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            # "ieee": fp32 operands are multiplied in fp32, as the reference does (NVIDIA's
            # default, TF32, keeps 10 mantissa bits); 16-bit products are exact in fp32 anyway
            acc = tl.dot(a, b, acc, input_precision="ieee")
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
        # M = 1: no tl.dot; BLOCK_K <= 16, so one request with 2,112 live ids or more keeps
        # every SM of an H200 (132) working, and 3,000 live ids give 188 programs or more
        (1, 16, 256, 4, 1), (1, 16, 128, 4, 3), (1, 8, 256, 2, 1), (1, 4, 512, 2, 1),
        # 2 <= M <= 16: tl.dot on a 16-row tile, BLOCK_K = 16 as above
        (16, 16, 128, 4, 3), (16, 16, 256, 4, 3),
        # M > 16: tensor-core tiles; no BLOCK_M = 128 (252 registers for fp32 on sm_80)
        (32, 32, 64, 4, 3), (32, 32, 128, 4, 3), (32, 64, 128, 4, 3), (64, 64, 64, 4, 3),
        (64, 128, 64, 8, 3),
    ]
]
# The interpreter cannot time configs ("0 active drivers"): the launcher takes one per path there
# without the autotuner; tests run every one of CONFIGS by passing ``config=`` to the launcher.
_INTERPRET_CONFIGS = [triton.Config({"BLOCK_M": 1, "BLOCK_K": 16, "BLOCK_D": 64}),
                      triton.Config({"BLOCK_M": 16, "BLOCK_K": 32, "BLOCK_D": 64})]


def prune_configs(configs, named_args, **kwargs):
    """The configs the autotuner may pick for a launch (its ``early_config_prune``):
    ``BLOCK_M = 1`` for one row, ``BLOCK_M = 16`` up to 16 rows, ``16 <= BLOCK_M <= bucket``
    above; for fp32 at most 16 x 16 x 256 operand elements (an "ieee" tl.dot runs on the FMA
    units with its operands in registers: 32 x 32 x 128 spills 440 bytes on sm_80)."""
    bucket = named_args["M_BUCKET"]
    if bucket == 1:
        kept = [c for c in configs if c.kwargs["BLOCK_M"] == 1]
    elif bucket <= 16:
        kept = [c for c in configs if c.kwargs["BLOCK_M"] == 16]
    else:
        kept = [c for c in configs if 16 <= c.kwargs["BLOCK_M"] <= bucket]
    if named_args["x_ptr"].dtype == torch.float32:
        kept = [c for c in kept if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_K"] *
                c.kwargs["BLOCK_D"] <= 16 * 16 * 256]
    return kept or configs[:1]


KERNEL = _trimmed_head_kernel  # the untuned kernel, for builds ahead of time (its GPU check)
_tuned_kernel = triton.autotune(
    configs=CONFIGS,
    key=["M_BUCKET", "D", "CAP", "SCATTER"],
    prune_configs_by={"early_config_prune": prune_configs},
)(_trimmed_head_kernel)


def _m_bucket(rows: int) -> int:
    return 1 << max(0, min(rows, 128) - 1).bit_length()


def trimmed_head(x: torch.Tensor, weight: torch.Tensor, idx: torch.Tensor, count: torch.Tensor,
                 bias: torch.Tensor | None = None, *, scale: float = 1.0, softcap: float = 0.0,
                 out: torch.Tensor | None = None, scatter: bool = False,
                 fill_tail: bool = True, config: triton.Config | None = None) -> torch.Tensor:
    """Launch the kernel on ``x[G, R, d]``, ``idx[G, CAP]``, ``count[G]`` (metadata checked by
    :func:`check_launch`; id values are not read on the host).

    Compact mode writes ``out[G, R, CAP]`` (``-inf`` past the count when ``fill_tail``); scatter
    mode writes active columns of a caller-provided ``out[G, R, V]`` and leaves the rest untouched.
    ``config`` (one of :data:`CONFIGS`) pins the launch to that config instead of the autotuner's.
    """
    sig = None if config is not None else \
        launch_signature(x, weight, idx, count, bias, out, scatter, fill_tail, softcap)
    hot = None if sig is None else _LAUNCHES.get(sig)
    if hot is None:
        check_launch(x, weight, idx, count, bias, out, scatter)
    G, R, D = x.shape
    CAP = idx.shape[1]
    if out is None:
        out = torch.empty((G, R, CAP), device=x.device, dtype=x.dtype)
    if R == 0 or CAP == 0:
        return out
    args, flags = launch_args(x, weight, idx, count, bias, scale, softcap, out, scatter,
                              fill_tail)
    if hot is not None:  # checked and tuned before: launch the picked config, no autotuner
        _trimmed_head_kernel[hot[1]](*args, **flags, **hot[0])
        return out
    grid = lambda m: (triton.cdiv(CAP, m["BLOCK_K"]), triton.cdiv(R, m["BLOCK_M"]), G)  # noqa: E731
    if config is None:
        _tuned_launch(grid, args, flags, x)
    else:
        _trimmed_head_kernel[grid](*args, **flags, **config.all_kwargs())
    if sig is not None and best_config() is not None:
        picked = best_config()
        _LAUNCHES[sig] = (picked.all_kwargs(), grid(picked.kwargs))
    return out


def _tuned_launch(grid, args, flags, x: torch.Tensor) -> None:
    """Launch through the autotuner; under the interpreter, which cannot time a config (and
    triton 3.6's autotuner times even the only one its pruning leaves), with that one config."""
    if not INTERPRET:
        _tuned_kernel[grid](*args, **flags)
        return
    named = {"M_BUCKET": _m_bucket(x.shape[1]), "x_ptr": x}  # x: [G, R, d]
    _INTERPRETED[0] = prune_configs(_INTERPRET_CONFIGS, named)[0]
    _trimmed_head_kernel[grid](*args, **flags, **_INTERPRETED[0].all_kwargs())


_INTERPRETED: list = [None]  # the interpreter's last pick, what the autotuner's best_config is


# What the launcher checked and the autotuner picked, per launch signature (every shape, stride,
# dtype and device the checks and the tuning key read): a hot call skips both (~16 us of Python).
_LAUNCHES: dict = {}


def clear_launch_cache() -> None:
    """Forget every checked launch: the next call of each signature is checked and tuned again."""
    _LAUNCHES.clear()


def launch_signature(x, weight, idx, count, bias, out, scatter, fill_tail, softcap) -> tuple:
    """The metadata a launch's checks and tuning depend on."""
    return (x.shape, x.stride(), x.dtype, x.device, weight.shape, weight.stride(), weight.dtype,
            weight.device, idx.shape, idx.stride(), idx.dtype, idx.device, count.shape,
            count.dtype, count.device,
            None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.device),
            None if out is None else (out.shape, out.stride(), out.dtype, out.device),
            scatter, fill_tail, bool(softcap))


DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_launch(x, weight, idx, count, bias, out, scatter) -> None:
    """Raise, naming the argument (or triton's version), on a launch the kernel cannot serve: the
    checks of the metadata alone that the kernel relies on, so a bad call fails before launching."""
    require_triton()
    if x.dim() != 3 or weight.dim() != 2:
        raise ValueError(f"x and weight: expected x[G, R, d] and weight[V, d], got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    G, R, D = x.shape
    V = weight.shape[0]
    if x.dtype not in DTYPES:
        raise TypeError(f"x: dtype {x.dtype} is not supported by the Triton kernel (float32, "
                        "float16 or bfloat16)")
    if not (x.is_cuda or INTERPRET and x.device.type == "cpu"):
        raise ValueError(f"x: on {x.device}; the Triton kernel runs on CUDA devices (on CPU only "
                         "under TRITON_INTERPRET=1, set before triton is imported)")
    for name, t in (("weight", weight), ("idx", idx), ("count", count), ("bias", bias),
                    ("out", out)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: on {t.device} but x is on {x.device}")
    if weight.dtype != x.dtype or bias is not None and bias.dtype != x.dtype:
        raise TypeError(f"weight and bias: dtype must be x's ({x.dtype}), got {weight.dtype} and "
                        f"{None if bias is None else bias.dtype}")
    if weight.shape[1] != D or weight.stride(1) != 1 or x.stride(2) != 1:
        raise ValueError(f"weight and x: need d-contiguous weight[V, {D}] and x[..., {D}], got "
                         f"weight {tuple(weight.shape)} strides {weight.stride()}, x strides "
                         f"{x.stride()}")
    if idx.dim() != 2 or idx.shape[0] != G or idx.stride(1) != 1 or \
            idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"idx: expected int32/int64 [{G}, CAP] with contiguous rows, got "
                         f"{idx.dtype} {tuple(idx.shape)} strides {idx.stride()}")
    if count.numel() != G or count.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"count: expected {G} int32/int64 count(s), got {count.dtype} "
                         f"{tuple(count.shape)}")
    if bias is not None and (tuple(bias.shape) != (V,) or bias.stride(0) != 1):
        raise ValueError(f"bias: expected a contiguous ({V},), got {tuple(bias.shape)}")
    cols = V if scatter else idx.shape[1]
    if out is not None and (tuple(out.shape) != (G, R, cols) or out.stride(2) != 1):
        raise ValueError(f"out: expected a [{G}, {R}, {cols}] buffer with contiguous rows "
                         f"({'the vocabulary' if scatter else 'one column per id of idx'}), got "
                         f"{tuple(out.shape)} strides {out.stride()}")
    if scatter and out is None:
        raise ValueError("out: scatter mode writes into a caller-provided [G, R, V] buffer")


def launch_args(x, weight, idx, count, bias, scale, softcap, out, scatter, fill_tail):
    """The kernel's arguments and flags exactly as :func:`trimmed_head` passes them (the GPU build
    check specializes its builds on these, as the JIT does at launch)."""
    G, R, D = x.shape
    args = (x, weight, bias if bias is not None else weight, idx, count, out,
            R, D, idx.shape[1], _m_bucket(R),
            x.stride(0), x.stride(1), weight.stride(0), idx.stride(0), out.stride(0), out.stride(1),
            float(scale), float(softcap) if softcap else 1.0)
    flags = dict(HAS_BIAS=bias is not None, SCATTER=scatter, FILL_TAIL=fill_tail and not scatter,
                 SOFTCAP=bool(softcap), UPCAST=INTERPRET and x.dtype == torch.bfloat16)
    return args, flags


def best_config() -> triton.Config | None:
    """The config the autotuner picked last (None before any tuned launch); under the
    interpreter, the one config the pruning left at the last tuned launch."""
    if INTERPRET:
        return _INTERPRETED[0]
    return getattr(_tuned_kernel, "best_config", None)


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
