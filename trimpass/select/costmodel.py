"""Cost of a draft step as a function of the kept vocabulary size K, two interchangeable models.

``FlopsModel``: architecture-aware FLOPs of a decoder drafter (layers, hidden and intermediate
sizes, V): each layer ``2·(4·d² + 3·d·f)`` per token (attention projections and a gated MLP), the
head ``2·d·K``; ``reduction(K)`` is the share of the whole step saved. ``MeasuredModel``: the real
trimmed LM-head op timed on this device at a handful of K (side by side with the full head), fit as
``t(K) = a + b·K`` and cached per device; ``reduction(K) = 1 - t(K) / t_full`` is the head's saving.
Both are monotone in K.
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
    def named(cls, name: str) -> "FlopsModel":
        if name not in DRAFTERS:
            raise ValueError(f"drafter: unknown {name!r}; choose one of {sorted(DRAFTERS)}")
        return cls(*DRAFTERS[name])

    def step_flops(self, K) -> np.ndarray:
        body = self.layers * 2 * (4 * self.d**2 + 3 * self.d * self.ffn)
        return body + 2 * self.d * np.asarray(K, dtype=np.float64)

    def reduction(self, K) -> np.ndarray:
        return 1.0 - self.step_flops(K) / self.step_flops(self.V)


@dataclass
class MeasuredModel:
    V: int
    d: int
    a: float
    b: float
    full_ms: float
    device: str

    def ms(self, K) -> np.ndarray:
        return self.a + self.b * np.asarray(K, dtype=np.float64)

    def reduction(self, K) -> np.ndarray:
        return np.clip(1.0 - self.ms(K) / self.full_ms, 0.0, 1.0)

    @classmethod
    def measure(cls, V: int, d: int, device: str = "cpu", ks=(256, 1024, 4096, 16384),
                cache: bool = True) -> "MeasuredModel":
        from trimpass.headbench import time_head
        from trimpass.cache import cache_dir
        tag = f"{platform.node()}-{device}-{V}x{d}"
        path = os.path.join(cache_dir(), "costmodel", f"{tag}.json")
        if cache and os.path.exists(path):
            with open(path) as f:
                return cls(**json.load(f))
        rows = [time_head("custom", K, 1, V=V, d=d, device=device, rounds=7) for K in ks]
        b, a = np.polyfit(np.asarray(ks, dtype=np.float64), [r.trimmed_ms for r in rows], 1)
        m = cls(V, d, float(max(a, 0.0)), float(max(b, 1e-12)),
                float(np.median([r.full_ms for r in rows])), device)
        if cache:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                json.dump(m.__dict__, f)
        return m
