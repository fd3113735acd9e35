"""What a draft source is worth, one record per source, so that the controller prices every source
with one cost model. :class:`PriceRecord` keeps, by match length and position, how often a drafted
token was reached (every earlier one accepted) and kept (accepted too), and reads P(position k
accepted | every earlier one was) with a Beta prior until observed. A lookup draft
(:mod:`trimpass.spec.proposers.lookup`) is priced by the length of the suffix it matched (rows 0 ..
``match_cap``), a suffix-index draft (:mod:`trimpass.spec.proposers.suffix`) by its match's power of
two (1, 2-3, 4-7 ... 64); a self-draft has one row. Each learns from every draft offered, sent or
not: the tokens a request emitted are the target's own, so where a draft parts from them the target
would have rejected it, and where it agrees the target would have kept it (:func:`agreement`)."""
from __future__ import annotations

import math

import numpy as np
import torch

from trimpass.spec.config import LookupConfig
from trimpass.spec.drafts import Drafts

MATCH_MAX = LookupConfig.match_cap  # match lengths priced apart (longer ones pool with it)
SUFFIX_ROWS = 8  # a suffix match's rows: 0, 1, 2-3, ..., 32-63, 64 and more


def agreement(drafted, emitted) -> tuple[int, int]:
    """``(kept, reached)`` of a draft against the tokens the target emitted after the same text:
    its first ``kept`` tokens agree; positions up to ``reached`` are known (a disagreement is
    known only where the target emitted a token at that position)."""
    n = min(len(drafted), len(emitted))
    kept = next((i for i in range(n) if drafted[i] != emitted[i]), n)
    return kept, min(kept + 1, n)


class PriceRecord:
    """Acceptance of one source's drafts by match length (``rows``) and position (``gamma``). A
    cell's prior is its position's record pooled over the other match lengths, worth as many
    observations as ``prior`` holds pseudo-counts, and that pool's own prior is ``prior``
    (accepted, rejected): so a match length not yet seen starts from what the others did."""

    def __init__(self, gamma: int, rows: int = 1, prior: tuple[float, float] = (1.0, 1.0),
                 scale: str = "linear"):
        if not all(isinstance(p, (int, float)) and math.isfinite(p) and p > 0 for p in prior):
            raise ValueError(f"price prior: two finite pseudo-counts > 0 (accepted, rejected), "
                             f"got {prior!r}")
        if scale not in ("linear", "log2"):
            raise ValueError(f"price scale: 'linear' or 'log2', got {scale!r}")
        self.gamma, self.rows, self.prior = int(gamma), int(rows), tuple(map(float, prior))
        self.scale = scale  # log2: match lengths 1, 2-3, 4-7, ... share a row
        self.reached = np.zeros((self.rows, self.gamma))
        self.kept = np.zeros((self.rows, self.gamma))

    def table(self) -> np.ndarray:
        """P(position k accepted | reached), [rows, gamma]."""
        a, b = self.prior
        others_kept = self.kept.sum(axis=0) - self.kept  # each row's prior: the other rows'
        others = self.reached.sum(axis=0) - self.reached
        pooled = (others_kept + a) / (others + a + b)
        return (self.kept + (a + b) * pooled) / (self.reached + a + b)

    def rows_of(self, matches) -> np.ndarray:
        """The row of each match length (lengths past the last row pool with it)."""
        m = np.asarray(matches, dtype=np.int64)
        if self.scale == "log2":
            m = np.floor(np.log2(np.maximum(m, 1))).astype(np.int64) + (m > 0)
        return np.minimum(m, self.rows - 1)

    def row(self, match: int = 0) -> torch.Tensor:
        """One row's confidences [gamma]."""
        return torch.from_numpy(self.table()[int(self.rows_of(match))].copy())

    def confidences(self, lengths, matches, width: int) -> torch.Tensor:
        """Confidences [B, width] of drafts of ``lengths`` tokens at ``matches``: zero past each
        draft."""
        lengths = np.minimum(np.asarray(lengths, dtype=np.int64), min(self.gamma, width))
        match = self.rows_of(matches)
        conf = np.zeros((len(lengths), width))
        cols = min(width, self.gamma)
        conf[:, :cols] = self.table()[match, :cols]
        conf[np.arange(width)[None, :] >= lengths[:, None]] = 0.0
        return torch.from_numpy(conf)

    def observe(self, match: int, kept: int, reached: int) -> None:
        """One draft at ``match`` whose first ``reached`` positions are known, the first ``kept``
        of them accepted."""
        m, reached = int(self.rows_of(match)), min(int(reached), self.gamma)
        self.reached[m, :reached] += 1
        self.kept[m, :min(int(kept), reached)] += 1

    def clone(self) -> PriceRecord:
        """A fresh record of the same shape."""
        return PriceRecord(self.gamma, self.rows, self.prior, self.scale)

    def as_dict(self) -> dict:
        return {"reached": self.reached.sum(axis=1).tolist(),
                "accept_first": self.table()[:, 0].round(3).tolist()}


class Sources:
    """The price record of every source (``lookup``, ``suffix``, ``self``) of one drafter, up to
    ``gamma`` positions; ``sources[name]`` is one."""

    def __init__(self, gamma: int):
        self.gamma = gamma
        self.records = {"lookup": PriceRecord(gamma, MATCH_MAX + 1),
                        "suffix": PriceRecord(gamma, SUFFIX_ROWS, scale="log2"),
                        "self": PriceRecord(gamma)}

    def __getitem__(self, source: str) -> PriceRecord:
        return self.records[source]

    def items(self):
        return self.records.items()

    def forget(self, *sources: str) -> None:
        """Start the records of ``sources`` over."""
        for k in sources:
            self.records[k] = self.records[k].clone()

    def valued(self, tree, source: str, match: int):
        """A :class:`~trimpass.spec.tree.DraftTree` of ``source`` valued by its record at
        ``match`` (its measured acceptance by depth along its main path)."""
        record = self.records[source]
        return tree.valued(record.table()[int(record.rows_of(match))].tolist())

    def priced(self, drafts: Drafts) -> torch.Tensor:
        """Confidences [B, gamma] of each request's free draft (lookup or suffix index), from
        its own source's record; a tree's (drafts with parents) are its own, its nodes' values
        from that record (:meth:`~trimpass.spec.tree.DraftTree.valued`)."""
        theirs = torch.zeros(len(drafts), self.gamma, dtype=torch.float64)
        if drafts.parents is not None:
            for i, start in enumerate(drafts.offsets):
                n = min(drafts.counts[i], self.gamma)
                theirs[i, :n] = torch.tensor(drafts.confidence[start:start + n])
            return theirs
        for source in set(drafts.source) - {"none", "self"}:
            rows = [i for i, s in enumerate(drafts.source) if s == source]
            theirs[rows] = self.records[source].confidences(
                [drafts.counts[i] for i in rows], [drafts.match[i] for i in rows], self.gamma)
        return theirs

    def choose(self, *candidates: Drafts | None) -> Drafts | None:
        """Per request, of free drafts from several sources (each a :class:`Drafts` over the same
        requests, or None), the one worth more expected tokens by its source's record."""
        given = [d for d in candidates if d is not None and any(d.counts)]
        if len(given) < 2:
            return given[0] if given else None
        worth = torch.stack([torch.cumprod(self.priced(d), 1).sum(1) for d in given])
        chosen = [given[j] for j in worth.argmax(0).tolist()]
        return Drafts.of([d.row(i) for i, d in enumerate(chosen)],
                         [d.source[i] for i, d in enumerate(chosen)],
                         [d.match[i] for i, d in enumerate(chosen)])
