"""One index per live request of a batch, keyed by request id, as every free-draft proposer keeps
them: :class:`PerRequest` brings each request's index up to its text (the engine's tokens of the
request, then the tokens it emitted this step), rebuilds it where the engine's text is not the one
it expects (preempted and recomputed, a prefill in chunks), asks the proposer for each request's
draft and returns the step's :class:`~trimpass.spec.drafts.Drafts`; :meth:`PerRequest.keep_only`
drops the finished, aborted and preempted requests' indexes."""
from __future__ import annotations

from trimpass.spec.drafts import Drafts


def ints(tokens) -> list[int]:
    return tokens.tolist() if hasattr(tokens, "tolist") else [int(t) for t in tokens]


class PerRequest:
    """A subclass names its ``source``, builds a request's index (:meth:`fresh`: an object with
    ``extend(ids)``) and proposes from it (:meth:`propose`)."""
    source = ""

    def __init__(self):
        self.live: dict = {}  # request id -> its index
        self.expected: dict = {}  # request id -> the engine's length of it at the next step

    def fresh(self, rid, i: int, n: int, tenants):
        raise NotImplementedError

    def propose(self, rid, index, limit: int) -> tuple[list[int], int, list[float] | None]:
        raise NotImplementedError

    def draft(self, req_ids, lengths, tokens, emitted, limit: int, tenants=None) -> Drafts:
        """Per request ``req_ids[i]``: ``tokens(i, a, b)`` its tokens ``a:b`` in the engine,
        ``lengths[i]`` of them; ``emitted[i]`` the tokens it emitted this step, not yet among them
        (none: it drafts nothing); ``tenants[i]`` its tenant, where the proposer reads one. Drafts
        of at most ``limit`` tokens each."""
        rows, match, conf = [], [], []
        for i, rid in enumerate(req_ids):
            new = emitted[i] if i < len(emitted) else []
            if not len(new):
                rows.append([])
                match.append(0)
                continue
            index, n = self.live.get(rid), int(lengths[i])
            if index is None or self.expected.get(rid) != n:
                index = self.live[rid] = self.fresh(rid, i, n, tenants)
                index.extend(ints(tokens(i, 0, n)))
            index.extend(ints(new))
            self.expected[rid] = n + len(new)
            ids, m, p = self.propose(rid, index, limit)
            rows.append(ids)
            match.append(m if ids else 0)
            conf = None if p is None else conf + p
        return Drafts.of(rows, self.source, match, confidence=conf)

    def keep_only(self, req_ids) -> None:
        keep = set(req_ids)
        for rid in [r for r in self.live if r not in keep]:
            del self.live[rid]
            self.expected.pop(rid, None)

    def __len__(self) -> int:
        return len(self.live)
