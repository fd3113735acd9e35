"""Shapes of real drafters, one table for everything that needs them: select's FLOPs cost model
(``--drafter``), the head benchmarks (``python -m trimpass bench``, ``bench/``) and the GPU check's
EAGLE-shaped drafter. Only shapes: no weights, nothing imported.

A :class:`DrafterShape` is a named tuple ``(layers, d, ffn, V, heads)``: decoder layers, hidden
size, MLP intermediate size, vocabulary (head rows) and attention heads; ``shape.head`` is the LM
head's ``(V, d)``.
"""
from __future__ import annotations

from typing import NamedTuple


class DrafterShape(NamedTuple):
    layers: int
    d: int
    ffn: int
    V: int
    heads: int

    @property
    def head(self) -> tuple[int, int]:
        """The LM head's weight shape ``(V, d)``."""
        return self.V, self.d


DRAFTERS: dict[str, DrafterShape] = {
    "gemma3-270m": DrafterShape(layers=18, d=640, ffn=2048, V=262_144, heads=4),
    "qwen2.5-0.5b": DrafterShape(layers=24, d=896, ffn=4864, V=151_936, heads=14),
    "eagle-llama3-8b": DrafterShape(layers=1, d=4096, ffn=14336, V=128_256, heads=32),
}
HEADS: dict[str, tuple[int, int]] = {name: s.head for name, s in DRAFTERS.items()}  # (V, d)


def drafter(name: str) -> DrafterShape:
    """The shape of a named drafter; ``ValueError`` naming the choices otherwise."""
    if name not in DRAFTERS:
        raise ValueError(f"drafter: unknown {name!r}; choose one of {sorted(DRAFTERS)}")
    return DRAFTERS[name]
