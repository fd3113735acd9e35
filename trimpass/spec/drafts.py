"""One step's drafts, as one ragged record for a whole batch (vLLM's ``SpecDecodeMetadata`` shape):
flat ids, per request their count, offset, source and match length, a confidence per drafted
token where the source has one, and where the drafts are trees each id's parent (a tree's ids
best-first: its confidences are each node's value over the one before,
:meth:`~trimpass.spec.tree.DraftTree.confidences`). Proposers return it, verification takes it,
and the budget reads it (:meth:`Drafts.per_request` gives its older per-request view). Host data:
a step's drafts are a few dozen ids."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

SOURCES = ("none", "lookup", "suffix", "self")


@dataclass(frozen=True)
class Drafts:
    ids: tuple  # flat drafted ids, request after request
    counts: tuple  # per request: its drafted ids (0: nothing drafted)
    source: tuple  # per request: one of SOURCES
    match: tuple  # per request: the lookup suffix it matched (0 for other sources)
    confidence: tuple | None = None  # per drafted id, where the source has one
    parents: tuple | None = None  # per drafted id of a tree: its parent's index in its row, or -1

    def __post_init__(self):
        n = len(self.counts)
        if len(self.source) != n or len(self.match) != n:
            raise ValueError(f"Drafts: counts, source and match need one entry per request, got "
                             f"{n}, {len(self.source)} and {len(self.match)}")
        if sum(self.counts) != len(self.ids) or any(c < 0 for c in self.counts):
            raise ValueError(f"Drafts: counts {self.counts} do not add up to {len(self.ids)} ids")
        if any(s not in SOURCES for s in self.source):
            raise ValueError(f"Drafts: source must be one of {SOURCES}, got {self.source}")
        if self.confidence is not None and len(self.confidence) != len(self.ids):
            raise ValueError("Drafts: one confidence per drafted id")
        if self.parents is not None and len(self.parents) != len(self.ids):
            raise ValueError("Drafts: one parent per drafted id")

    @classmethod
    def of(cls, rows, source: str | list, match=None, confidence=None, parents=None) -> Drafts:
        """From per-request rows of ids (None or empty: nothing drafted)."""
        rows = [list(r) if r else [] for r in rows]
        sources = [source] * len(rows) if isinstance(source, str) else list(source)
        sources = [s if r else "none" for s, r in zip(sources, rows, strict=True)]
        return cls(ids=tuple(itertools.chain.from_iterable(rows)),
                   counts=tuple(len(r) for r in rows), source=tuple(sources),
                   match=tuple(match if match is not None else [0] * len(rows)),
                   confidence=None if confidence is None else tuple(confidence),
                   parents=None if parents is None else tuple(parents))

    @classmethod
    def empty(cls, requests: int) -> Drafts:
        return cls.of([[]] * requests, "none")

    def __len__(self) -> int:
        return len(self.counts)

    @property
    def offsets(self) -> tuple:
        """Where each request's ids start in :attr:`ids` (cumulative counts, first 0)."""
        return tuple(itertools.accumulate(self.counts, initial=0))[:-1]

    def row(self, i: int) -> list[int]:
        start = self.offsets[i]
        return list(self.ids[start:start + self.counts[i]])

    def tensor(self, i: int, device=None) -> torch.Tensor:
        return torch.tensor(self.row(i), dtype=torch.long, device=device)

    def per_request(self) -> list:
        """Per request ``(ids, match length)``, or None where it drafted nothing."""
        return [(self.row(i), self.match[i]) if self.counts[i] else None
                for i in range(len(self))]
