"""Deprecated (the suffix index keeps earlier outputs per tenant: ``trimpass.generate(...,
tenant=...)``, :mod:`trimpass.spec.proposers.suffix`). Earlier outputs of one model as a source of
lookup drafts for later requests (suffix decoding's global tree, kept as an n-gram index): off
unless the user passes an :class:`OutputCache` to
:func:`trimpass.generate`, because it makes one request's output visible to the next. It holds at
most ``max_tokens`` tokens of outputs (the oldest output leaves first), its index at most
``2 * ngram`` entries a held token (stale entries are dropped by a rebuild), it refuses a model of
another vocabulary, and ``clear()`` forgets everything.
"""
from __future__ import annotations

import warnings
from collections import OrderedDict

from trimpass.spec.proposers.lookup import NgramIndex


class OutputCache:
    """Outputs of earlier requests of one model, indexed by every n-gram of up to ``ngram`` tokens
    (the newest place it was followed by a token: the speculation core's
    :class:`~trimpass.spec.proposers.lookup.NgramIndex`); bounded by ``max_tokens``."""

    def __init__(self, max_tokens: int = 65536, ngram: int = 4):
        warnings.warn("trimpass.OutputCache is deprecated: trimpass.generate keeps earlier "
                      "outputs in its suffix index, per tenant (tenant=...; trimpass.forget "
                      "drops them)", DeprecationWarning, stacklevel=2)
        for name, value, lo in (("max_tokens", max_tokens, 1), ("ngram", ngram, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ValueError(f"OutputCache: {name} must be an int >= {lo}, got {value!r}")
        self.max_tokens, self.ngram = max_tokens, ngram
        self.vocab: int | None = None  # the model's vocabulary, bound at the first use
        self.clear()

    def clear(self) -> None:
        """Forget every output (the vocabulary binding stays)."""
        self.outputs: OrderedDict[int, list[int]] = OrderedDict()
        self.index = NgramIndex(self.ngram)  # n-gram -> (output, index after it)
        self.tokens, self.serial = 0, 0

    def bind(self, vocab: int) -> None:
        """Refuse a model whose vocabulary is not the one this cache holds ids of."""
        if self.vocab is None:
            self.vocab = vocab
        elif vocab != self.vocab:
            raise ValueError(f"output_cache: holds ids of a {self.vocab}-token vocabulary, this "
                             f"model has {vocab}; use one OutputCache per model")

    def add(self, ids) -> None:
        """Keep one request's output (the oldest outputs leave to stay within ``max_tokens``)."""
        seq = [int(t) for t in ids][-self.max_tokens:]
        if len(seq) < 2:
            return
        while self.outputs and self.tokens + len(seq) > self.max_tokens:
            self.tokens -= len(self.outputs.popitem(last=False)[1])
        self.serial += 1
        self.outputs[self.serial] = seq
        self.tokens += len(seq)
        self.index.index(seq, tag=self.serial)
        if len(self.index) > 2 * self.ngram * self.max_tokens:  # stale entries of old outputs
            self.index.clear()
            for key, out in self.outputs.items():
                self.index.index(out, tag=key)

    def propose(self, text: list[int], limit: int) -> tuple[list[int], int]:
        """Up to ``limit`` tokens that followed the longest suffix of ``text`` (up to ``ngram``
        tokens) in a held output, and that suffix's length (0 and nothing where none matches)."""
        n, hit = self.index.longest(text, valid=lambda at: at[0] in self.outputs)
        if not n:
            return [], 0
        key, at = hit
        return self.outputs[key][at:at + limit], n
