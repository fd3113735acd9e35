"""Command line: ``python -m trimpass {demo,bench} ...`` (``--help`` on each)."""
from __future__ import annotations

import argparse
import sys


def _demo(args) -> int:
    import torch

    from trimpass.headbench import format_table, time_head
    from trimpass.progress import progress

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    print(f"trimpass demo: LM head of {args.shape} on {device} ({dtype}), full vs trimmed vs a "
          "dense pre-gathered copy, timed side by side (random weights: timing only)")
    rows = [time_head(args.shape, K, M, dtype=dtype, device=device)
            for K, M in progress([(K, M) for K in args.k for M in args.m], desc="timing")]
    print(format_table(rows))
    return 0


def _bench(args) -> int:
    import torch

    from trimpass.headbench import SHAPES, format_table, time_head
    from trimpass.progress import progress

    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = args.shape or list(SHAPES)
    cases = [(s, K, M) for s in shapes for K in args.k for M in args.m]
    rows = [time_head(s, K, M, device=device) for s, K, M in progress(cases, desc="timing")]
    print(format_table(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m trimpass",
        description="Trim a speculative-decoding drafter's LM head to an active vocabulary.")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    d = sub.add_parser("demo", help="the main job: show what trimming buys on this machine",
                       description="Time the full LM head against the trimmed op.")
    d.add_argument("--shape", default="gemma3-270m", help="head shape (default: %(default)s)")
    d.add_argument("--k", type=int, nargs="+", default=[1000, 3000, 8000, 32000],
                   help="active vocabulary sizes (default: %(default)s)")
    d.add_argument("--m", type=int, nargs="+", default=[1, 8], help="rows per call")
    d.set_defaults(fn=_demo)

    b = sub.add_parser("bench", help="time full vs trimmed vs pre-gathered heads, as ratios",
                       description="Side-by-side head timings on real drafters' shapes.")
    b.add_argument("--shape", nargs="+", help="gemma3-270m, qwen2.5-0.5b, eagle-llama3-8b")
    b.add_argument("--k", type=int, nargs="+", default=[1000, 3000, 8000, 32000])
    b.add_argument("--m", type=int, nargs="+", default=[1, 8, 64])
    b.set_defaults(fn=_bench)

    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
