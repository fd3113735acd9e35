"""Cost of a draft step as a function of the kept vocabulary size K, two interchangeable models.

``FlopsModel``: architecture-aware FLOPs of a decoder drafter (layers, hidden and intermediate
sizes, V): each layer ``2·(4·d² + 3·d·f)`` per token (attention projections and a gated MLP), the
head ``2·d·K``; ``reduction(K)`` is the share of the whole step saved. ``MeasuredModel``: the real
trimmed LM-head op timed on this device at a handful of K (side by side with the full head), fit
by isotonic (non-decreasing least-squares) regression, interpolated linearly between the timed K
and extended past the largest by the fit's mean slope; cached per device. ``reduction(K) = 1 -
t(K) / t_full`` is the head's saving (negative where the trimmed op is slower than the full head).
Both are monotone in K by construction: FLOPs grow linearly, and an isotonic fit cannot decrease.
"""
from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass

import numpy as np

DRAFTERS = {  # name: (layers, d, ffn, V)
    "gemma3-270m": (18, 640, 2048, 262_144),
    "qwen2.5-0.5b": (24, 896, 4864, 151_936),
    "eagle-llama3-8b": (1, 4096, 14336, 128_256),
}


@dataclass
class FlopsModel:
    layers: int
    d: int
    ffn: int
    V: int

    @classmethod
    def named(cls, name: str) -> FlopsModel:
        if name not in DRAFTERS:
            raise ValueError(f"drafter: unknown {name!r}; choose one of {sorted(DRAFTERS)}")
        return cls(*DRAFTERS[name])

    def step_flops(self, K) -> np.ndarray:
        body = self.layers * 2 * (4 * self.d**2 + 3 * self.d * self.ffn)
        return body + 2 * self.d * np.asarray(K, dtype=np.float64)

    def reduction(self, K) -> np.ndarray:
        return 1.0 - self.step_flops(K) / self.step_flops(self.V)


def isotonic(y) -> np.ndarray:
    """The least-squares non-decreasing fit of ``y`` (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, size]
    for v in np.asarray(y, dtype=np.float64):
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, n2 = blocks.pop()
            m1, n1 = blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return np.concatenate([np.full(int(n), m) for m, n in blocks]) if blocks else np.zeros(0)


@dataclass
class MeasuredModel:
    V: int
    d: int
    ks: list  # the K the trimmed op was timed at, increasing
    raw_ms: list  # its measured ms at each of ks
    fit_ms: list  # isotonic fit of raw_ms: what ms() interpolates
    full_ms: float
    device: str

    @classmethod
    def fit(cls, V: int, d: int, ks, raw_ms, full_ms: float, device: str = "cpu"
            ) -> MeasuredModel:
        """A model from timings at ``ks`` (any order; at least two distinct K)."""
        ks = np.asarray(ks, dtype=np.int64)
        raw = np.asarray(raw_ms, dtype=np.float64)
        if ks.shape != raw.shape or len(np.unique(ks)) != len(ks) or len(ks) < 2:
            raise ValueError(f"cost model: needs timings at two or more distinct K, got {ks}")
        order = np.argsort(ks)
        ks, raw = ks[order], raw[order]
        return cls(V, d, ks.tolist(), raw.tolist(), isotonic(raw).tolist(), float(full_ms),
                   device)

    def ms(self, K) -> np.ndarray:
        k = np.asarray(K, dtype=np.float64)
        ks = np.asarray(self.ks, dtype=np.float64)
        fit = np.asarray(self.fit_ms, dtype=np.float64)
        slope = (fit[-1] - fit[0]) / (ks[-1] - ks[0])  # >= 0: the fit is non-decreasing
        return np.where(k > ks[-1], fit[-1] + slope * (k - ks[-1]), np.interp(k, ks, fit))

    def reduction(self, K) -> np.ndarray:
        return 1.0 - self.ms(K) / self.full_ms

    @classmethod
    def measure(cls, V: int, d: int, device: str = "cpu", ks=(256, 1024, 4096, 16384),
                cache: bool = True) -> MeasuredModel:
        from trimpass.cache import cache_dir
        from trimpass.headbench import time_head
        tag = f"{platform.node()}-{device}-{V}x{d}-{'-'.join(map(str, ks))}"
        path = os.path.join(cache_dir(), "costmodel-v2", f"{tag}.json")
        if cache and os.path.exists(path):
            with open(path) as f:
                return cls(**json.load(f))
        rows = [time_head("custom", K, 1, V=V, d=d, device=device, rounds=7) for K in ks]
        m = cls.fit(V, d, ks, [r.trimmed_ms for r in rows],
                    float(np.median([r.full_ms for r in rows])), device)
        if cache:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                json.dump(m.__dict__, f)
        return m
