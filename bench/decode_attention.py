"""One query's attention on this CPU: Hugging Face's ``sdpa`` (PyTorch's CPU flash kernel) against
``trimpass.hf.decode_attention`` (two products and a softmax in fp32), side by side in one run, on
Gemma-3-270M's shapes (4 query heads on 1 KV head of 256), for a range of cached keys, in bf16 and
fp32, eager and compiled (inductor, dynamic shapes, as the drafter and the fused loop run it).
Each timing is the best of 5 medians of 50 calls, the two alternating. Prints a markdown table.

    python bench/decode_attention.py
"""
from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import time

import torch


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--keys", default="64,256,1024,2048", help="cached keys, comma-separated")
    ap.add_argument("--queries", default="1,4", help="query rows, comma-separated")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = ap.parse_args(argv)
    try:
        a.keys = [int(x) for x in a.keys.split(",")]
        a.queries = [int(x) for x in a.queries.split(",")]
    except ValueError:
        ap.error("--keys and --queries: comma-separated ints")
    if min(a.keys) < 1 or min(a.queries) < 1 or a.threads < 0:
        ap.error("--keys and --queries must be >= 1, --threads >= 0")
    return a


def _median_ms(f, n=50):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main(argv=None) -> int:
    a = _args(argv)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from trimpass.hf import decode_attention as D
    if a.threads:
        torch.set_num_threads(a.threads)

    class Attn(torch.nn.Module):  # what HF's attention functions read from the module
        num_key_value_groups, is_causal = 4, True

    mod = Attn()
    fns = {"sdpa": lambda *x: sdpa_attention_forward(mod, *x, scaling=0.0625)[0],
           "decode": lambda *x: D.attention(mod, *x, scaling=0.0625)[0]}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(f"commit {commit}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}\n")
    print("| dtype | mode | queries | keys | sdpa ms | decode_attention ms | sdpa / decode |")
    print("|---|---|---|---|---|---|---|")
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for mode in ("eager", "compiled"):
            run = fns if mode == "eager" else {k: torch.compile(f, dynamic=True)
                                               for k, f in fns.items()}
            for M in a.queries:
                for N in a.keys:
                    q = torch.randn(1, 4, M, 256, dtype=dtype)
                    k, v = (torch.randn(1, 1, N, 256, dtype=dtype) for _ in range(2))
                    mask = torch.ones(1, 1, M, N, dtype=torch.bool).tril(N - M)
                    best = {}
                    for _ in range(5):  # alternate, keep each one's best median
                        for name, f in run.items():
                            f(q, k, v, mask)  # compiles, warms
                            ms = _median_ms(lambda f=f, x=(q, k, v, mask): f(*x))
                            best[name] = min(best.get(name, ms), ms)
                    print(f"| {str(dtype).split('.')[-1]} | {mode} | {M} | {N} | "
                          f"{best['sdpa']:.3f} | {best['decode']:.3f} | "
                          f"x{best['sdpa'] / best['decode']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
