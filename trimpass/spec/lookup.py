"""Free drafts from the text repeating itself, engine-neutral. :class:`Lookup` keeps an index of
one request's tokens (prompt and output so far): for every n-gram of up to ``ngram`` tokens, the
latest place it ended with a token after it. It finds the longest suffix of the text that occurred
earlier and proposes up to ``tokens`` tokens that followed it there, at no model step.
:class:`RequestLookups` keeps one per request of an engine's continuously batched requests (a
serving engine's: rows come and go, a preempted request is rebuilt from its own tokens), so that no
request's text drafts for another. Both loops use them: the fused HF loop
(:mod:`trimpass.hf.fused`) and the vLLM adapter's budget (:mod:`trimpass.budget.runner`)."""
from __future__ import annotations


class Lookup:
    """Prompt lookup over one request's tokens, kept incrementally (``extend`` as tokens arrive)."""

    def __init__(self, tokens: int, ngram: int, outputs=None):
        """``outputs``: an :class:`~trimpass.hf.output_cache.OutputCache` of earlier requests'
        outputs, searched beside the request's own text (None: the request's text alone)."""
        self.tokens, self.ngram, self.outputs = tokens, ngram, outputs
        self.seq: list[int] = []
        self.follow: dict[tuple, int] = {}  # n-gram -> index of the token that followed it last

    def extend(self, ids) -> None:
        for t in ids:
            self.seq.append(int(t))
            i = len(self.seq) - 1  # the n-grams ending just before i now have a follower
            for n in range(1, min(self.ngram, i) + 1):
                self.follow[tuple(self.seq[i - n:i])] = i

    def propose(self, limit: int) -> tuple[list[int], int]:
        """``min(tokens, limit)`` tokens that followed the latest earlier occurrence of the text's
        longest recurring suffix, and that suffix's length (0 and no tokens where nothing recurs).
        Where that occurrence is closer to the end than the tokens wanted, the text since it is
        taken as a period and repeated: a greedy loop's text does exactly that, and proposing only
        the tokens up to the end cut its proposals to the loop's length."""
        want = min(self.tokens, limit)
        own, match = [], 0
        for n in range(min(self.ngram, len(self.seq)), 0, -1):
            at = self.follow.get(tuple(self.seq[-n:]))
            if at is not None:
                period = len(self.seq) - at  # the text since that occurrence repeats with it
                own, match = [self.seq[at + i % period] for i in range(want)], n
                break
        if self.outputs is not None and match < self.ngram:
            theirs, n = self.outputs.propose(self.seq, want)
            if n > match:  # an earlier output matches a longer suffix than the text itself
                return theirs, n
        return own, match


class RequestLookups:
    """One :class:`Lookup` per live request of a continuously batched engine, keyed by request
    id. :meth:`drafts` brings each request's index up to its text (the engine's tokens of the
    request, then the tokens it emitted this step) and returns its proposal; a request whose
    engine text is not the one its index expects (preempted and recomputed, a prefill in chunks)
    is rebuilt from the engine's tokens; :meth:`keep_only` drops the finished, aborted and
    preempted ones."""

    def __init__(self, tokens: int, ngram: int):
        self.tokens, self.ngram = tokens, ngram
        self.live: dict = {}  # request id -> its Lookup
        self.expected: dict = {}  # request id -> the engine's length of it at the next step

    def drafts(self, req_ids, lengths, tokens, emitted_ids, limit: int) -> list:
        """Per request ``req_ids[i]``: its proposal ``(tokens, match length)``, or None where it
        emitted nothing this step. ``tokens(i, a, b)``: the request's tokens ``a:b`` in the
        engine, ``lengths[i]`` of them; ``emitted_ids[i]``: the tokens it emitted this step, not
        yet among them."""
        out = []
        for i, rid in enumerate(req_ids):
            new = emitted_ids[i] if i < len(emitted_ids) else []
            if not new:
                out.append(None)
                continue
            look, n = self.live.get(rid), int(lengths[i])
            if look is None or self.expected.get(rid) != n:
                look = self.live[rid] = Lookup(self.tokens, self.ngram)
                look.extend(tokens(i, 0, n).tolist())
            look.extend(new)
            self.expected[rid] = n + len(new)
            out.append(look.propose(limit))
        return out

    def keep_only(self, req_ids) -> None:
        keep = set(req_ids)
        for rid in [r for r in self.live if r not in keep]:
            del self.live[rid]
            self.expected.pop(rid, None)

    def __len__(self) -> int:
        return len(self.live)
