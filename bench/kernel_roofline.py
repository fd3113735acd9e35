"""Predicted time of one trimmed-head launch on an H200, beside cuBLAS's full head, for the shapes
``bench/gpu_check.py`` measures: Gemma-3-270M, the Llama-3-8B EAGLE-3 drafter and Qwen2.5 at
d = 896 and 3,584; K = 1k, 3k and 32k live ids; M = 1, 4, 16 and 64 rows; bf16. A launch moves
the live ids' weight rows once from HBM (row blocks after the first re-read them from L2), the ids,
the M input rows and the compact output (``-inf`` past the count up to the capacity); the V-wide
``-inf`` fill of ``head_full`` is a separate fill kernel and is not counted (its bytes are given
beside). Predicted time: the launch floor (:data:`LAUNCH_US`, a kernel node replayed in a CUDA
graph) plus the larger of bytes over :data:`HBM_TBS` and FLOPs over :data:`TC_TFLOPS` (tensor
cores; the one-row path's FMAs stay far below either). ``python bench/kernel_roofline.py --out
bench/results/kernel_roofline.md`` writes the table; gpu_check runs :func:`section`, which times
the same shapes and prints them beside the prediction.
"""
from __future__ import annotations

import argparse
import sys

HBM_TBS = 4.3  # H200 HBM3e: 4.8 TB/s peak, about 4.3 sustained by a device copy
LAUNCH_US = 2.5  # one kernel node of a replayed CUDA graph on an H200, 2-3 us
TC_TFLOPS = 500.0  # bf16 tl.dot on 16-64-row tiles: about half the 989 TFLOPS dense peak
SMS = 132
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


def predicted_us(nbytes: int, flops: float) -> float:
    return LAUNCH_US + max(nbytes / (HBM_TBS * 1e6), flops / (TC_TFLOPS * 1e6))


def rows(heads=HEADS, ks=KS, ms=MS) -> list[dict]:
    """One dict per (head, K, M): bytes, programs and predicted microseconds, trimmed and full."""
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
                out.append(dict(head=name, V=V, d=d, K=K, M=M, bytes=nb, grid=grid,
                                working=(least, most), us=predicted_us(nb, 2 * padded * K * d),
                                fill_bytes=M * V * ELEM, full_bytes=full_b,
                                full_us=predicted_us(full_b, 2 * M * V * d)))
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


def section(c, device: str, dtype, tol: float) -> list[dict]:
    """gpu_check's section: every shape of :func:`rows` (tiny ones on the dry run's CPU), the
    trimmed head (``head_compact``) and cuBLAS's full head beside the prediction, each timed two
    ways with the L2 cache flushed before every call: replayed in a CUDA graph
    (``measure.graph_ms``: the kernel, as a captured decode step runs it; what the prediction
    models and the checks use) and launched from Python (``measure.median_ms``, triton's do_bench:
    the host's launch cost included). ``c`` is gpu_check's ``Checks``."""
    import torch
    import torch.nn.functional as F

    from trimpass import measure, ops
    from trimpass.kernels import trimmed_head as kernel
    gpu = device == "cuda"
    heads, ks, ms = (HEADS, KS, MS) if gpu else ({"tiny": (1_031, 96)}, (37, 100), MS)
    predicted = {(r["head"], r["K"], r["M"]): r for r in rows(heads, ks, ms)}

    def bench_ms(fn) -> float:
        return measure.median_ms(fn, device, min_time_s=0.1 if gpu else 0.02)

    def graph_ms(fn) -> float:  # the dry run's CPU has no graphs: its eager time stands in
        return measure.graph_ms(fn) if gpu else bench_ms(fn)

    def rel_err(out, ref) -> float:
        return float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))

    n = (1 << 30) if gpu else (1 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_gbps = 2 * n / bench_ms(lambda: dst.copy_(src)) / 1e6  # bytes read + written
    g = torch.Generator().manual_seed(1)
    out_rows = []
    with ops.use_kernel("triton"):
        for name, (V, d) in heads.items():
            w = (torch.randn(V, d, generator=g) / d**0.5).to(device, dtype)
            for M in ms:
                x = torch.randn(M, d, generator=g).to(device, dtype)
                full_eager_ms = bench_ms(lambda x=x, w=w: F.linear(x, w))
                full_ms = graph_ms(lambda x=x, w=w: F.linear(x, w))
                for K in ks:
                    idx = torch.randperm(V, generator=g)[:capacity(K) if gpu else K + 5]
                    idx = idx.to(device)
                    count = torch.tensor([K], dtype=torch.int32, device=device)
                    out = ops.head_compact(x, w, None, idx, count)
                    err = rel_err(out[..., :K], F.linear(x.float(), w[idx[:K]].float()))
                    def call(x=x, w=w, idx=idx, count=count):
                        return ops.head_compact(x, w, None, idx, count)
                    eager, t = bench_ms(call), graph_ms(call)
                    cfg = kernel.best_config()
                    bk, bm = cfg.kwargs["BLOCK_K"], cfg.kwargs["BLOCK_M"]
                    working = programs(K, M, bk, bm)[1]
                    p = predicted[name, K, M]
                    out_rows.append(dict(section="roofline", head=name, V=V, d=d, K=K, M=M,
                                         ms=t, eager_ms=eager, predicted_ms=p["us"] / 1e3,
                                         full_ms=full_ms, full_eager_ms=full_eager_ms,
                                         full_predicted_ms=p["full_us"] / 1e3, working=working,
                                         rel_err=err, config=str(cfg)))
                    tag = f"roofline {name} K={K:,} M={M}"
                    c.within(f"{tag}: logits vs a float32 reference", err, tol)
                    if K == ks[len(ks) // 2] and M == 1:
                        c.check(f"{tag}: working programs", working >= (SMS if gpu else 2),
                                f"{working} (BLOCK_K {bk}; an H200 has {SMS} SMs)")
                    if M == 1 and gpu:
                        c.check(f"{tag}: faster than cuBLAS's full head", t < full_ms,
                                f"{t * 1e3:.1f} us vs {full_ms * 1e3:.1f} us in a CUDA graph "
                                f"(launched from Python: {eager * 1e3:.1f} vs "
                                f"{full_eager_ms * 1e3:.1f})")
            del w
    ratios = sorted(r["ms"] / r["predicted_ms"] for r in out_rows)
    median = ratios[len(ratios) // 2]
    if gpu:
        c.check("roofline: median measured/predicted within 0.5-2", 0.5 <= median <= 2.0,
                f"x{median:.2f} (range x{ratios[0]:.2f}-x{ratios[-1]:.2f})")
    else:
        c.skip("roofline: median measured/predicted within 0.5-2",
               f"dry run: timings mean nothing (x{median:.0f} here)")
    print(f"\n## trimmed head vs prediction, {dtype} (L2 flushed before every timed call; "
          f"device copy {copy_gbps:,.0f} GB/s, the prediction assumes {HBM_TBS * 1e3:,.0f}; "
          "graph: replayed in a CUDA graph; eager: launched from Python, host cost included)")
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
    return out_rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--out", default=None, help="write the markdown here")
    a = p.parse_args(argv)
    text = "\n".join([
        "# Predicted cost of the trimmed head on an H200 (bf16)", "",
        "Command: `python bench/kernel_roofline.py --out bench/results/kernel_roofline.md` "
        "(arithmetic, no measurement; `python bench/gpu_check.py` prints measured beside it).",
        "",
        f"Model: predicted us = {LAUNCH_US} us launch floor (a kernel node replayed in a CUDA "
        f"graph on an H200, 2-3 us) + max(bytes / {HBM_TBS} TB/s, FLOPs / {TC_TFLOPS:.0f} "
        "TFLOPS). Trimmed bytes: the K live weight rows (once; the other row blocks of M re-read "
        f"them from L2), K int64 ids, the M input rows and the compact output M x CAP (CAP = "
        f"{CAPACITY} for K <= {CAPACITY}, else K: `-inf` is written past the count). The V-wide "
        "`-inf` fill of `head_full` is not counted: it is a separate fill kernel (another launch "
        "floor plus its bytes, last column); `head_compact` and `head_topk` do not need it. Full: "
        "cuBLAS reads all V rows and writes M x V logits. Grid: cdiv(CAP, BLOCK_K) x "
        "cdiv(M, BLOCK_M) programs, for the config with the smallest BLOCK_K the autotuner may "
        "pick for M; working: those whose block of ids starts below K (the rest exit at once), "
        "from the config with the largest BLOCK_K to the one with the smallest. An H200 has "
        f"{SMS} SMs: fewer working programs than that leave SMs idle and the bandwidth term "
        "optimistic.", "",
        table(rows()), ""])
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
