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

from dataclasses import dataclass

import numpy as np

from trimpass.isotonic import pav
from trimpass.shapes import drafter


@dataclass
class FlopsModel:
    layers: int
    d: int
    ffn: int
    V: int

    @classmethod
    def named(cls, name: str) -> FlopsModel:
        s = drafter(name)
        return cls(s.layers, s.d, s.ffn, s.V)

    def step_flops(self, K) -> np.ndarray:
        body = self.layers * 2 * (4 * self.d**2 + 3 * self.d * self.ffn)
        return body + 2 * self.d * np.asarray(K, dtype=np.float64)

    def reduction(self, K) -> np.ndarray:
        return 1.0 - self.step_flops(K) / self.step_flops(self.V)


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
        return cls(V, d, ks.tolist(), raw.tolist(), pav(raw).tolist(), float(full_ms),
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
        from trimpass import measure
        from trimpass.headbench import time_head

        def timed() -> dict:
            rows = [time_head("custom", K, 1, V=V, d=d, device=device, rounds=7) for K in ks]
            return cls.fit(V, d, ks, [r.trimmed_ms for r in rows],
                           float(np.median([r.full_ms for r in rows])), device).__dict__

        key = f"select-head:{V}x{d}:K={list(ks)}"  # device name and torch version: by cached()
        return cls(**(measure.cached(key, timed, device) if cache else timed()))
