"""Kernel regression suite: full head, trimmed op (compact and V-sized), dense pre-gathered head.

Save a baseline per machine and compare a change against it (see README):
    TRIMPASS_BENCH=full pytest bench/test_head.py --benchmark-save=base
    TRIMPASS_BENCH=full pytest bench/test_head.py --benchmark-compare \
        --benchmark-compare-fail=median:10%
"""
import os

import pytest
import torch
import torch.nn.functional as F

from trimpass import measure, ops
from trimpass.shapes import HEADS as SHAPES

FULL = os.environ.get("TRIMPASS_BENCH") == "full"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
CASES = ([(s, K, M) for s in SHAPES for K in (1000, 3000, 8000, 32000) for M in (1, 8, 64)]
         if FULL else [("tiny", 37, 1), ("tiny", 37, 3)])


def _setup(shape, K, M):
    V, d = SHAPES.get(shape, (613, 48))
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(V, d, generator=g) / d**0.5).to(DEVICE, DTYPE)
    x = torch.randn(M, d, generator=g).to(DEVICE, DTYPE)
    idx = torch.randperm(V, generator=g)[:K].sort().values.to(DEVICE)
    return x, w, idx, torch.tensor([K], dtype=torch.int32, device=DEVICE)


def _run(benchmark, fn):
    def call():
        out = fn()
        measure.sync(DEVICE)  # time the work, not the launch
        return out
    with torch.no_grad():
        return benchmark(call)


@pytest.mark.parametrize("shape,K,M", CASES)
@pytest.mark.parametrize("variant", ["full", "trimmed", "trimmed_full", "trimmed_compiled",
                                     "dense"])
def test_head(benchmark, variant, shape, K, M):
    x, w, idx, count = _setup(shape, K, M)
    benchmark.group = f"{shape} K={K} M={M}"
    if variant == "full":
        out = _run(benchmark, lambda: F.linear(x, w))
    elif variant == "trimmed":
        out = _run(benchmark, lambda: ops.head_compact(x, w, None, idx, count))
    elif variant == "trimmed_full":  # the V-sized, -inf-filled output a drafter's graph returns
        out = _run(benchmark, lambda: ops.head_full(x, w, None, idx, count))
        out = out[:, idx]
    elif variant == "trimmed_compiled":
        fn = torch.compile(lambda x: ops.head_compact(x, w, None, idx, count), backend="inductor")
        out = _run(benchmark, lambda: fn(x))
    else:
        dense = w[idx].contiguous()
        out = _run(benchmark, lambda: F.linear(x, dense))
    assert out.shape[0] == M and torch.isfinite(out).all()
