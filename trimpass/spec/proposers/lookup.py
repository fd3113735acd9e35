"""Free drafts from the text repeating itself. :class:`NgramIndex` is the one n-gram follower index:
for every n-gram of up to ``ngram`` tokens, the latest place a token followed it, searched longest
suffix first. :class:`Lookup` keeps one over a request's own tokens (prompt and output so far) and
proposes the tokens that followed the text's longest recurring suffix, at no model step.
:class:`LookupProposer` keeps one :class:`Lookup` per live request of a batch, keyed by request id,
so that no request's text drafts for another (:mod:`trimpass.spec.proposers.requests`). The fused
loop (:mod:`trimpass.hf.fused`) is its batch-of-one client; the vLLM adapter proposes through it
each step. :class:`~trimpass.hf.output_cache.OutputCache` indexes earlier outputs with the same
index."""
from __future__ import annotations

from trimpass.spec.config import LookupConfig
from trimpass.spec.proposers.requests import PerRequest


class NgramIndex:
    """Every n-gram of up to ``ngram`` tokens mapped to where a token last followed it."""

    def __init__(self, ngram: int):
        self.ngram = ngram
        self.follow: dict[tuple, object] = {}

    def index(self, seq: list[int], start: int = 1, tag=None) -> None:
        """Index the n-grams that end just before each position ``i`` of ``seq`` from ``start``
        on: each maps to ``i`` (or ``(tag, i)``), the token after it."""
        follow, N = self.follow, self.ngram
        for i in range(max(start, 1), len(seq)):
            at = i if tag is None else (tag, i)
            for n in range(1, min(N, i) + 1):
                follow[tuple(seq[i - n:i])] = at

    def longest(self, text: list[int], shortest: int = 1, valid=None) -> tuple[int, object]:
        """(n, where) for the longest suffix of ``text`` of ``shortest`` to ``ngram`` tokens that
        the index holds (and ``valid(where)`` accepts), or (0, None)."""
        for n in range(min(self.ngram, len(text)), shortest - 1, -1):
            at = self.follow.get(tuple(text[-n:]))
            if at is not None and (valid is None or valid(at)):
                return n, at
        return 0, None

    def clear(self) -> None:
        self.follow = {}

    def __len__(self) -> int:
        return len(self.follow)


class Lookup:
    """Prompt lookup over one request's tokens, kept incrementally (``extend`` as tokens arrive)."""

    def __init__(self, config: LookupConfig, outputs=None):
        """``outputs``: an :class:`~trimpass.hf.output_cache.OutputCache` of earlier requests'
        outputs, searched beside the request's own text (None: the request's text alone)."""
        self.config, self.outputs = config, outputs
        self.seq: list[int] = []
        self.index = NgramIndex(config.ngram)

    def extend(self, ids) -> None:
        start = len(self.seq)
        self.seq.extend(int(t) for t in ids)
        self.index.index(self.seq, start)

    def propose(self, limit: int) -> tuple[list[int], int]:
        """``min(tokens, limit)`` tokens that followed the latest earlier occurrence of the text's
        longest recurring suffix, and that suffix's length (0 and no tokens where nothing recurs).
        Where that occurrence is closer to the end than the tokens wanted, the text since it is
        taken as a period and repeated: a greedy loop's text does exactly that, and proposing only
        the tokens up to the end cut its proposals to the loop's length."""
        want = min(self.config.tokens, limit)
        own, (match, at) = [], self.index.longest(self.seq, self.config.min_match)
        if match:
            period = len(self.seq) - at  # the text since that occurrence repeats with it
            own = [self.seq[at + i % period] for i in range(want)]
        if self.outputs is not None and match < self.config.ngram:
            theirs, n = self.outputs.propose(self.seq, want)
            if n > match:  # an earlier output matches a longer suffix than the text itself
                return theirs, n
        return own, match


class LookupProposer(PerRequest):
    """One :class:`Lookup` per live request of a batch (:class:`~trimpass.spec.proposers.requests.
    PerRequest`), over the request's own text (and ``outputs``, where given)."""
    source = "lookup"

    def __init__(self, config: LookupConfig, outputs=None):
        if config.tokens is None:
            raise ValueError("lookup tokens: the proposer needs a number of tokens (the engine's "
                             "draft length where the setting left it open), got None")
        super().__init__()
        self.config, self.outputs = config, outputs

    def fresh(self, rid, i: int, n: int, tenants) -> Lookup:
        return Lookup(self.config, self.outputs)

    def propose(self, rid, index: Lookup, limit: int):
        return (*index.propose(limit), None)
