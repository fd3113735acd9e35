"""Host cost of one eager call of the trimmed head, with the kernel launch itself stubbed out.

What a Python-launched call costs before the GPU sees anything: the custom op's dispatch, the
argument checks, the launcher's checks, the output allocation, the kernel's arguments, the
autotuner's lookup. The Triton path runs on CPU tensors under ``TRITON_INTERPRET=1`` with the
JIT function's ``run`` replaced by a no-op, so every line of trimpass's and the autotuner's Python
runs and no kernel does (Triton's own launch Python, ~13 us measured before, is not counted: on a
GPU it comes on top). Variants are timed side by side in one run (interleaved, median round):

- ``op, hot``: ``trimpass::head_compact`` with the launch cache warm (what every call after a
  shape's first costs);
- ``op, cold``: the same call with the launch cache emptied before it, i.e. the checks and the
  autotuner's lookup on every call (the path before the cache, plus one dictionary insert);
- one row per stage of the call, each timed alone.

Shapes: V = 32,000, d = 512, K = 4,096 active ids, one row, bf16 (the breakdown in issue 52).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: CPU tensors take the kernel path
os.environ.setdefault("TRIMPASS_KERNEL", "triton")


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=30, help="timed rounds per variant (median)")
    p.add_argument("--calls", type=int, default=2000, help="calls per round")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--out", default=None, help="also write the table to this markdown file")
    a = p.parse_args(argv)
    for name in ("rounds", "calls", "threads"):
        if getattr(a, name) < 1:
            p.error(f"--{name}: must be at least 1, got {getattr(a, name)}")
    return a


def variants(V=32_000, d=512, K=4096):
    import torch
    import triton

    from trimpass import ops
    from trimpass.kernels import trimmed_head as th

    th._trimmed_head_kernel.run = lambda *a, **k: None  # the launch itself: stubbed
    x = torch.randn(1, d, dtype=torch.bfloat16)
    w = torch.randn(V, d, dtype=torch.bfloat16)
    idx, count = torch.randperm(V)[:K], torch.tensor([K], dtype=torch.int32)
    x3, idx2, cnt = ops._grouped(x, idx, count, 1)
    out = torch.empty(1, 1, K, dtype=x.dtype)
    args, flags = th.launch_args(x3, w, idx2, cnt, None, 1.0, 0.0, out, False, True)
    grid = lambda m: (triton.cdiv(K, m["BLOCK_K"]), 1, 1)  # noqa: E731
    op = ops.head_compact.default

    def cold():
        th.clear_launch_cache()
        op(x, w, None, idx, count)

    return {
        "op, hot": lambda: op(x, w, None, idx, count),
        "op, cold (checks + autotuner each call)": cold,
        "  the op's Python body, called directly": lambda: ops._head_compact(x, w, None, idx,
                                                                               count),
        "  check_head_args": lambda: ops.check_head_args(x, w, None, idx, count),
        "  _grouped": lambda: ops._grouped(x, idx, count, 1),
        "  launch_signature (the cache key)": lambda: th.launch_signature(
            x3, w, idx2, cnt, None, None, False, True, 0.0),
        "  check_launch (skipped when hot)": lambda: th.check_launch(x3, w, idx2, cnt, None,
                                                                     None, False),
        "  torch.empty (the compact output)": lambda: torch.empty((1, 1, K), dtype=x.dtype),
        "  launch_args": lambda: th.launch_args(x3, w, idx2, cnt, None, 1.0, 0.0, out, False,
                                                True),
        "  Autotuner.run, cached key (skipped when hot)": lambda: th._tuned_kernel[grid](
            *args, **flags),
    }


def main(argv=None) -> int:
    a = parse(argv)
    import torch

    from trimpass.measure import interleaved_ms

    torch.set_num_threads(a.threads)
    fns = variants()
    ms = interleaved_ms(fns, a.rounds, "cpu", calls=a.calls)
    hot, cold = ms["op, hot"], ms["op, cold (checks + autotuner each call)"]
    lines = ["| call or stage | µs per call |", "|---|---|"]
    lines += [f"| {k.strip() if not k.startswith('  ') else '· ' + k.strip()} | {v * 1e3:.1f} |"
              for k, v in ms.items()]
    lines.append(f"\nhot / cold: {hot / cold:.2f} ({(cold - hot) * 1e3:.1f} µs saved per call); "
                 f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
                 f"{a.threads} thread(s), {a.rounds} rounds x {a.calls} calls")
    table = "\n".join(lines)
    print(table)
    if a.out:
        with open(a.out, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
