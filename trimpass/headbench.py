"""Side-by-side timing of the full LM head, the trimmed op, and a dense pre-gathered head.

This machine (and CI) is shared and noisy, so the three variants are timed interleaved in one run
(:func:`trimpass.measure.interleaved_ms`) and reported as ratios; a GPU run waits for the device
inside each timed call. Used by ``python -m trimpass bench`` and by select's measured cost model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trimpass import ops
from trimpass.measure import interleaved_ms
from trimpass.shapes import HEADS as SHAPES  # name: (V, d) of real drafters' heads


@dataclass
class HeadTiming:
    shape: str
    V: int
    d: int
    K: int
    M: int
    full_ms: float
    trimmed_ms: float
    dense_ms: float

    @property
    def speedup(self) -> float:
        return self.full_ms / self.trimmed_ms

    @property
    def vs_dense(self) -> float:
        return self.trimmed_ms / self.dense_ms


def time_head(shape: str, K: int, M: int, *, dtype=torch.float32, device="cpu", rounds: int = 15,
              V: int | None = None, d: int | None = None) -> HeadTiming:
    """Time one head shape at ``K`` active ids and ``M`` rows; random weights (timing only)."""
    V0, d0 = SHAPES.get(shape, (V, d))
    V, d = V or V0, d or d0
    device = torch.device(device)
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(V, d, generator=g) / d**0.5).to(device, dtype)
    x = torch.randn(M, d, generator=g).to(device, dtype)
    idx = torch.randperm(V, generator=g)[:K].sort().values.to(device)
    count = torch.tensor([K], dtype=torch.int32, device=device)
    dense = w[idx].contiguous()
    with torch.no_grad():
        ms = interleaved_ms({
            "full": lambda: F.linear(x, w),
            "trimmed": lambda: ops.head_compact(x, w, None, idx, count),
            "dense": lambda: F.linear(x, dense),
        }, rounds, device)
    return HeadTiming(shape, V, d, K, M, ms["full"], ms["trimmed"], ms["dense"])


def format_table(rows: list[HeadTiming]) -> str:
    lines = ["| head (V x d) | K | M | full ms | trimmed ms | dense [K,d] ms | full/trimmed | "
             "trimmed/dense |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.shape} ({r.V:,} x {r.d:,}) | {r.K:,} | {r.M} | {r.full_ms:.3f} | "
                     f"{r.trimmed_ms:.3f} | {r.dense_ms:.3f} | x{r.speedup:.1f} | "
                     f"{r.vs_dense:.2f} |")
    return "\n".join(lines)
