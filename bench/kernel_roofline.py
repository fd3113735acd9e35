"""Predicted time of one trimmed-head launch on an H100 or an H200, beside cuBLAS's full head, for
the shapes ``bench/gpu_check.py`` measures: Gemma-3-270M, the Llama-3-8B EAGLE-3 drafter and
Qwen2.5 at d = 896 and 3,584; K = 1k, 3k and 32k live ids; M = 1, 4, 16 and 64 rows; bf16. A launch
moves the live ids' weight rows once from HBM (row blocks after the first re-read them from L2),
the ids, the M input rows and the compact output (``-inf`` past the count up to the capacity); the
V-wide ``-inf`` fill of ``head_full`` is a separate fill kernel and is not counted (its bytes are
given beside). Predicted time: the launch floor (:data:`LAUNCH_US`, a kernel node replayed in a
CUDA graph) plus the larger of bytes over the device's copy bandwidth and FLOPs over
:data:`TC_TFLOPS` (tensor cores; the one-row path's FMAs stay far below either). On the machine,
gpu_check runs :func:`section`, which first measures that machine's copy bandwidth and predicts
from it, so each GPU is judged against itself; ``python bench/kernel_roofline.py --out
bench/results/kernel_roofline.md`` writes the tables ahead of a run from each GPU's nominal copy
bandwidth (:data:`GPUS`).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    name: str
    copy_tbs: float  # device-to-device copy, bytes read + written per second / 1e12
    sms: int
    source: str  # where copy_tbs comes from


GPUS = {"h200": Gpu("NVIDIA H200", 4.23, 132, "measured by gpu_check on an H200, 2026-12-04 "
                    "(HBM3e: 4.8 TB/s peak)"),
        "h100": Gpu("NVIDIA H100 80GB HBM3", 3.0, 132, "assumed, not yet measured: the H200's "
                    "copy reaches 88% of its peak, and 88% of the H100 SXM's 3.35 TB/s is 3.0")}
LAUNCH_US = 2.5  # one kernel node of a replayed CUDA graph on an H100 or H200, 2-3 us
TC_TFLOPS = 500.0  # bf16 tl.dot on 16-64-row tiles: about half the 989 TFLOPS dense peak of both
CAPACITY = 4096  # idx[CAP] of the dynamic vocabulary; K = 32k uses a static list (CAP = K)
HEADS = {"gemma3-270m": (262_144, 640), "llama3-8b-eagle3": (128_256, 4_096),
         "qwen2.5-0.5b": (151_936, 896), "qwen2.5-7b": (151_936, 3_584)}  # (V, d)
KS = (1_000, 3_000, 32_000)
MS = (1, 4, 16, 64)
ELEM = 2  # bf16
ID_BYTES = 8  # int64 ids


def capacity(K: int) -> int:
    return CAPACITY if K <= CAPACITY else K


def block_k_range(M: int) -> tuple[int, int]:
    """The smallest and largest BLOCK_K (and their BLOCK_M) the autotuner may pick for M rows,
    bf16, from the kernel's own configs."""
    import torch

    from trimpass.kernels.trimmed_head import CONFIGS, prune_configs
    bucket = 1 << max(0, min(M, 128) - 1).bit_length()
    x = torch.empty(0, dtype=torch.bfloat16)
    kept = prune_configs(CONFIGS, {"M_BUCKET": bucket, "x_ptr": x})
    pairs = sorted((c.kwargs["BLOCK_K"], c.kwargs["BLOCK_M"]) for c in kept)
    return pairs[0], pairs[-1]


def programs(K: int, M: int, block_k: int, block_m: int) -> tuple[int, int]:
    """(grid size, working programs) of one launch with one id group."""
    rows = -(-M // block_m)
    return -(-capacity(K) // block_k) * rows, -(-K // block_k) * rows


def trimmed_bytes(V: int, d: int, K: int, M: int) -> int:
    return K * d * ELEM + K * ID_BYTES + M * d * ELEM + M * capacity(K) * ELEM


def full_bytes(V: int, d: int, M: int) -> int:
    return V * d * ELEM + M * d * ELEM + M * V * ELEM


def predicted_us(nbytes: int, flops: float, copy_tbs: float) -> float:
    return LAUNCH_US + max(nbytes / (copy_tbs * 1e6), flops / (TC_TFLOPS * 1e6))


def rows(copy_tbs: float, heads=HEADS, ks=KS, ms=MS) -> list[dict]:
    """One dict per (head, K, M): bytes, programs and predicted microseconds, trimmed and full,
    at a copy bandwidth of ``copy_tbs`` TB/s."""
    out = []
    for name, (V, d) in heads.items():
        for M in ms:
            (bk_lo, bm_lo), (bk_hi, bm_hi) = block_k_range(M)
            padded = M if M == 1 else max(16, M)  # tl.dot computes whole 16-row tiles
            full_b = full_bytes(V, d, M)
            for K in ks:
                nb = trimmed_bytes(V, d, K, M)
                grid, most = programs(K, M, bk_lo, bm_lo)
                _, least = programs(K, M, bk_hi, bm_hi)
                us = predicted_us(nb, 2 * padded * K * d, copy_tbs)
                out.append(dict(head=name, V=V, d=d, K=K, M=M, bytes=nb, grid=grid,
                                working=(least, most), us=us,
                                fill_bytes=M * V * ELEM, full_bytes=full_b,
                                full_us=predicted_us(full_b, 2 * M * V * d, copy_tbs)))
    return out


def table(rs: list[dict]) -> str:
    lines = ["| head (V, d) | K | M | trimmed MB | grid (most) | working programs | trimmed us | "
             "full MB | full us | full / trimmed | head_full's -inf fill MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rs:
        lo, hi = r["working"]
        lines.append(
            f"| {r['head']} ({r['V']:,}, {r['d']:,}) | {r['K']:,} | {r['M']} | "
            f"{r['bytes'] / 1e6:.2f} | {r['grid']:,} | {lo:,}-{hi:,} | {r['us']:.1f} | "
            f"{r['full_bytes'] / 1e6:.1f} | {r['full_us']:.1f} | x{r['full_us'] / r['us']:.1f} | "
            f"{r['fill_bytes'] / 1e6:.2f} |")
    return "\n".join(lines)


def machine(device: str) -> Gpu:
    """The device in hand: its name, SMs and the copy bandwidth measured on it now (1 GiB copied
    on a GPU; 1 MiB on the dry run's CPU, whose figure means nothing)."""
    import torch

    from trimpass import measure
    gpu = device == "cuda"
    n = (1 << 30) if gpu else (1 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = measure.median_ms(lambda: dst.copy_(src), device, min_time_s=0.1 if gpu else 0.02)
    if not gpu:
        return Gpu("cpu (dry run)", 2 * n / ms / 1e9, 2, "measured now")
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return Gpu(props.name, 2 * n / ms / 1e9, props.multi_processor_count, "measured now")


def _time_shape(x, w, idx, count, K, bench_ms, graph_ms, rel_err) -> dict:
    """One (head, K, M): the trimmed head's error, graph and eager times, the config it ran."""
    import torch.nn.functional as F

    from trimpass import ops
    from trimpass.kernels import trimmed_head as kernel
    out = ops.head_compact(x, w, None, idx, count)
    err = rel_err(out[..., :K], F.linear(x.float(), w[idx[:K]].float()))

    def call():
        return ops.head_compact(x, w, None, idx, count)

    eager, t = bench_ms(call), graph_ms(call)
    return dict(ms=t, eager_ms=eager, rel_err=err, config=kernel.best_config())


def _print(out_rows, dtype, gpu: Gpu) -> None:
    print(f"\n## trimmed head vs prediction on {gpu.name}, {dtype} (L2 flushed before every timed "
          f"call; the prediction uses the device copy measured now, {gpu.copy_tbs * 1e3:,.0f} "
          "GB/s; graph: replayed in a CUDA graph; eager: launched from Python, host cost "
          "included)")
    print("| head | K | M | working programs | trimmed us, graph | eager | predicted us | "
          "cuBLAS full us, graph | eager | predicted us | rel err | config |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in out_rows:
        print(f"| {r['head']} ({r['V']:,}, {r['d']:,}) | {r['K']:,} | {r['M']} | "
              f"{r['working']} | {r['ms'] * 1e3:.1f} | {r['eager_ms'] * 1e3:.1f} | "
              f"{r['predicted_ms'] * 1e3:.1f} | {r['full_ms'] * 1e3:.1f} | "
              f"{r['full_eager_ms'] * 1e3:.1f} | {r['full_predicted_ms'] * 1e3:.1f} | "
              f"{r['rel_err']:.1e} | {r['config']} |")
    print()


def section(c, device: str, dtype, tol: float) -> list[dict]:
    """gpu_check's section: every shape of :func:`rows` (tiny ones on the dry run's CPU), the
    trimmed head (``head_compact``) and cuBLAS's full head beside the prediction from this
    device's own copy bandwidth (:func:`machine`), each timed two ways with the L2 cache flushed
    before every call: replayed in a CUDA graph (``measure.graph_ms``: the kernel, as a captured
    decode step runs it; what the prediction models and the checks use) and launched from Python
    (``measure.median_ms``, triton's do_bench: the host's launch cost included). ``c`` is
    gpu_check's ``Checks``."""
    import torch
    import torch.nn.functional as F

    from trimpass import measure, ops
    gpu = device == "cuda"
    heads, ks, ms = (HEADS, KS, MS) if gpu else ({"tiny": (1_031, 96)}, (37, 100), MS)
    here = machine(device)
    predicted = {(r["head"], r["K"], r["M"]): r for r in rows(here.copy_tbs, heads, ks, ms)}

    def bench_ms(fn) -> float:
        return measure.median_ms(fn, device, min_time_s=0.1 if gpu else 0.02)

    def graph_ms(fn) -> float:  # the dry run's CPU has no graphs: its eager time stands in
        return measure.graph_ms(fn) if gpu else bench_ms(fn)

    def rel_err(out, ref) -> float:
        return float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))

    g = torch.Generator().manual_seed(1)
    out_rows = []
    with ops.use_kernel("triton"):
        for name, (V, d) in heads.items():
            w = (torch.randn(V, d, generator=g) / d**0.5).to(device, dtype)
            for M in ms:
                x = torch.randn(M, d, generator=g).to(device, dtype)
                full = dict(full_eager_ms=bench_ms(lambda x=x, w=w: F.linear(x, w)),
                            full_ms=graph_ms(lambda x=x, w=w: F.linear(x, w)))
                for K in ks:
                    idx = torch.randperm(V, generator=g)[:capacity(K) if gpu else K + 5]
                    count = torch.tensor([K], dtype=torch.int32, device=device)
                    r = _time_shape(x, w, idx.to(device), count, K, bench_ms, graph_ms, rel_err)
                    cfg = r.pop("config")
                    bk, bm = cfg.kwargs["BLOCK_K"], cfg.kwargs["BLOCK_M"]
                    p = predicted[name, K, M]
                    r.update(section="roofline", head=name, V=V, d=d, K=K, M=M, **full,
                             predicted_ms=p["us"] / 1e3, full_predicted_ms=p["full_us"] / 1e3,
                             working=programs(K, M, bk, bm)[1], config=str(cfg),
                             gpu=here.name, copy_tbs=here.copy_tbs)
                    out_rows.append(r)
                    _shape_checks(c, r, ks, gpu, here, bk, tol)
            del w
    ratios = sorted(r["ms"] / r["predicted_ms"] for r in out_rows)
    median = ratios[len(ratios) // 2]
    if gpu:
        c.check(f"roofline: median measured/predicted within 0.5-2 on {here.name}",
                0.5 <= median <= 2.0, f"x{median:.2f} (range x{ratios[0]:.2f}-x{ratios[-1]:.2f};"
                f" predicted from the {here.copy_tbs * 1e3:,.0f} GB/s copy measured here)")
    else:
        c.skip("roofline: median measured/predicted within 0.5-2",
               f"dry run: timings mean nothing (x{median:.0f} here)")
    _print(out_rows, dtype, here)
    return out_rows


def _shape_checks(c, r: dict, ks, gpu: bool, here: Gpu, block_k: int, tol: float) -> None:
    tag = f"roofline {r['head']} K={r['K']:,} M={r['M']}"
    c.within(f"{tag}: logits vs a float32 reference", r["rel_err"], tol)
    if r["K"] == ks[len(ks) // 2] and r["M"] == 1:
        c.check(f"{tag}: working programs", r["working"] >= (here.sms if gpu else 2),
                f"{r['working']} (BLOCK_K {block_k}; the {here.name} has {here.sms} SMs)")
    if r["M"] == 1 and gpu:
        c.check(f"{tag}: faster than cuBLAS's full head", r["ms"] < r["full_ms"],
                f"{r['ms'] * 1e3:.1f} us vs {r['full_ms'] * 1e3:.1f} us in a CUDA graph "
                f"(launched from Python: {r['eager_ms'] * 1e3:.1f} vs "
                f"{r['full_eager_ms'] * 1e3:.1f})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--out", default=None, help="write the markdown here")
    p.add_argument("--gpu", choices=sorted(GPUS), nargs="+", default=["h100", "h200"],
                   help="the GPUs to predict for (default: both)")
    a = p.parse_args(argv)
    text = [
        "# Predicted cost of the trimmed head on an H100 and an H200 (bf16)", "",
        "Command: `python bench/kernel_roofline.py --out bench/results/kernel_roofline.md` "
        "(arithmetic, no measurement; `python bench/gpu_check.py` measures the copy bandwidth of "
        "the GPU it runs on, predicts from it and prints measured beside predicted).", "",
        f"Model: predicted us = {LAUNCH_US} us launch floor (a kernel node replayed in a CUDA "
        f"graph, 2-3 us) + max(bytes / copy bandwidth, FLOPs / {TC_TFLOPS:.0f} TFLOPS). "
        "Trimmed bytes: the K live weight rows (once; the other row blocks of M re-read them from "
        f"L2), K int64 ids, the M input rows and the compact output M x CAP (CAP = {CAPACITY} for "
        f"K <= {CAPACITY}, else K: `-inf` is written past the count). The V-wide `-inf` fill of "
        "`head_full` is not counted: it is a separate fill kernel (another launch floor plus its "
        "bytes, last column); `head_compact` and `head_topk` do not need it. Full: cuBLAS reads "
        "all V rows and writes M x V logits. Grid: cdiv(CAP, BLOCK_K) x cdiv(M, BLOCK_M) "
        "programs, for the config with the smallest BLOCK_K the autotuner may pick for M; "
        "working: those whose block of ids starts below K (the rest exit at once), from the "
        "config with the largest BLOCK_K to the one with the smallest. Fewer working programs "
        "than the GPU's SMs leave SMs idle and the bandwidth term optimistic."]
    for key in a.gpu:
        gpu = GPUS[key]
        text += ["", f"## {gpu.name}: copy bandwidth {gpu.copy_tbs} TB/s ({gpu.source}), "
                 f"{gpu.sms} SMs", "", table(rows(gpu.copy_tbs))]
    text = "\n".join(text + [""])
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
