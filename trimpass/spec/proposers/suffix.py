"""The suffix index: drafts from the longest earlier occurrence of a request's recent text, with
counts. Per request, its own prompt and output (:class:`SuffixProposer`, one
:class:`~trimpass.spec.proposers.arena.Arena` per live request, rebuilt from the engine's tokens
where they are not the ones it expects); across requests, the earlier outputs of **the same tenant
only** (:class:`SuffixStore`: one arena per tenant, one byte cap over all of them, the least
recently used outputs evicted first). A draft follows the continuations of the longest matches (up
to ``depth`` tokens), each token the one most of them continue with, its share its estimated
probability, until their product falls below ``min_prob`` (ArcticInference's suffix decoding
rule); the drafts carry those probabilities and the match length, which the controller prices
(:mod:`trimpass.spec.control.prices`). A store shared across tenants is opt-in (``share``)."""
from __future__ import annotations

import bisect
import math
from collections import OrderedDict

import numpy as np

from trimpass.spec.config import SuffixConfig, check_tenant
from trimpass.spec.proposers.arena import Arena, tree_vote, vote
from trimpass.spec.proposers.requests import PerRequest
from trimpass.spec.tree import DraftTree

SHARED = "*"  # the one arena's key where tenants share
HEADROOM = 0.75  # evicting stops once the live texts fit this share of the cap


class SuffixStore:
    """Earlier outputs by tenant, within ``max_bytes`` (every arena's own arrays counted).
    ``share``: every tenant reads and writes one arena (off: each its own)."""

    def __init__(self, max_bytes: int = SuffixConfig.max_bytes, share: bool = False):
        SuffixConfig(max_bytes=max_bytes, share=share)  # the same checks, the same messages
        self.max_bytes, self.share = max_bytes, share
        self.arenas: dict[str, Arena] = {}
        self.lru: OrderedDict = OrderedDict()  # (tenant key, text serial) -> None, oldest first
        self.serial, self.evicted = 0, 0

    def key(self, tenant: str) -> str:
        check_tenant(tenant)
        return SHARED if self.share else tenant

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arenas.values())

    def __len__(self) -> int:
        return len(self.lru)

    def arena(self, tenant: str) -> Arena | None:
        return self.arenas.get(self.key(tenant))

    def tenants(self) -> list[str]:
        return sorted(self.arenas)

    def clear(self, tenant: str | None = None) -> None:
        """Forget one tenant's outputs (None: every tenant's)."""
        keys = list(self.arenas) if tenant is None else [self.key(tenant)]
        for k in keys:
            self.arenas.pop(k, None)
        self.lru = OrderedDict((e, None) for e in self.lru if e[0] not in keys)

    def add(self, tenant: str, ids) -> None:
        """Keep one request's output for ``tenant``'s later requests (older outputs, of any
        tenant, leave first to stay within the cap; an output longer than the cap allows keeps its
        end)."""
        key = self.key(tenant)
        ids = np.asarray([int(t) for t in ids], dtype=np.int32)
        most = self._most_tokens()
        ids = ids[-most:] if most > 0 else ids[:0]
        if len(ids) < 2:
            return
        if self._fit(key, len(ids)) is None:
            self._evict(key, len(ids))
            if self._fit(key, len(ids), exact=True) is None:
                return  # the cap holds nothing more, even emptied
        self.serial += 1
        arena = self.arenas[key]
        arena.open(self.serial)
        arena.extend(ids)
        arena.close()
        self.lru[(key, self.serial)] = None

    def _most_tokens(self) -> int:
        """The longest text an arena within the cap holds alone."""
        n = self.max_bytes // (4 * 3)
        while n > 16 and Arena.bytes_for(n + 2) > self.max_bytes:
            n = int(n * 0.9)
        return n if Arena.bytes_for(n + 2) <= self.max_bytes else 0

    def _fit(self, key: str, n: int, exact: bool = False):
        """Make ``key``'s arena hold ``n`` more tokens within the cap, doubling it (``exact``:
        or compacting it to its live texts and them); the arena, or None where the cap does not
        allow it."""
        arena = self.arenas.get(key)
        if arena is not None and arena.used + n + 2 <= arena.capacity:
            return arena
        allowed = self.max_bytes - (self.nbytes - (arena.nbytes if arena is not None else 0))
        live = arena.live if arena is not None else 0
        for capacity in (self._grown(key, n), live + n + 2)[:1 + exact]:
            if Arena.bytes_for(capacity) > allowed:
                continue
            if arena is not None and not arena.dead and arena.used + n + 2 <= capacity:
                arena.reserve(capacity)
            else:
                texts = arena.texts() if arena is not None else []
                self.arenas[key] = Arena.compacted(texts, capacity)
            return self.arenas[key]
        return None

    def _grown(self, key: str, n: int) -> int:
        """The capacity ``key``'s arena grows to for ``n`` more tokens: a quarter more, at
        least."""
        arena = self.arenas.get(key)
        if arena is None:
            return max(n + 2, 256)
        return max(arena.capacity + arena.capacity // 4, arena.used + n + 2)

    def _evict(self, key: str, n: int) -> None:
        """The least recently used outputs dropped until the live texts and ``n`` more tokens fit
        :data:`HEADROOM` of the cap; every arena that lost one compacted."""
        def live_bytes():
            own = self.arenas.get(key)
            return sum(Arena.bytes_for(a.live) for k, a in self.arenas.items() if k != key) + \
                Arena.bytes_for((own.live if own is not None else 0) + n + 2)
        touched = set()
        while self.lru and live_bytes() > HEADROOM * self.max_bytes:
            (k, serial), _ = self.lru.popitem(last=False)
            self.arenas[k].drop(serial)
            self.evicted += 1
            touched.add(k)
        for k in touched:
            texts = self.arenas[k].texts()
            if texts:
                self.arenas[k] = Arena.compacted(texts)
            else:
                del self.arenas[k]

    def touch(self, key: str, arena: Arena, at: np.ndarray) -> None:
        """The texts holding positions ``at`` were drafted from: most recently used now."""
        for p in set(at.tolist()):
            i = bisect.bisect_right(arena.starts, p) - 1
            serial = arena.keys[i] if i >= 0 else None
            if serial is not None and (key, serial) in self.lru:
                self.lru.move_to_end((key, serial))


class SuffixProposer(PerRequest):
    """One own-text arena per live request of a batch, keyed by request id, beside its tenant's
    earlier outputs in ``store`` (None: own text alone), each request's tenant read from
    ``draft``'s ``tenants`` (else ``tenant``). :meth:`draft` returns the step's drafts (source
    ``"suffix"``, their estimated probabilities as confidences); :meth:`finish` keeps a finished
    request's output for its tenant; :meth:`keep_only` drops the arenas of requests that left the
    batch (a preempted one is rebuilt when it resumes; its prompt length and tenant stay)."""
    source = "suffix"

    def __init__(self, config: SuffixConfig, store: SuffixStore | None = None,
                 tenant: str = ""):
        check_tenant(tenant)
        super().__init__()
        self.config, self.store, self.default_tenant = config, store, tenant
        self.prompt: dict = {}  # request id -> its prompt's length (its output follows)
        self.tenant: dict = {}  # request id -> its tenant (None in ``draft``: the proposer's)
        self.found: dict = {}  # request id -> its last draft's candidates (for :meth:`tree`)

    def fresh(self, rid, i: int, n: int, tenants) -> Arena:
        self.tenant.setdefault(rid, self.default_tenant if tenants is None else tenants[i])
        self.prompt.setdefault(rid, n)
        own = Arena()
        own.open(rid)
        return own

    def propose(self, rid, own: Arena, limit: int) -> tuple[list[int], int, list[float]]:
        """(ids, match length, their probabilities) after ``own``'s text, from its own earlier
        text and its tenant's earlier outputs."""
        c, tenant = self.config, self.tenant[rid]
        tail = own.tokens[max(0, own.used - c.depth):own.used]
        found = [(own, *own.candidates(tail, c.depth, end_excluded=own.used), 1)]
        key = self.store.key(tenant) if self.store is not None else None
        theirs = self.store.arenas.get(key) if key is not None else None
        if theirs is not None:
            found.insert(0, (theirs, *theirs.candidates(tail, c.depth), 0))
        longest = max((int(L.max()) for _, _, L, _ in found if len(L)), default=0)
        self.found[rid] = []
        if longest < c.min_match:
            return [], 0, []
        most = min(c.tokens, limit)
        if c.factor is not None:
            most = min(most, max(1, math.ceil(c.factor * longest)))
        sources = self.found[rid] = [(a, at[L == longest], per) for a, at, L, per in found]
        ids, probs = vote(sources, most, c.min_prob)
        if ids and theirs is not None and len(sources[0][1]):
            self.store.touch(key, theirs, sources[0][1])
        return ids, longest, probs

    def tree(self, rid, size: int, depth: int) -> DraftTree:
        """Request ``rid``'s last draft as a tree of up to ``size`` tokens, none deeper than
        ``depth``: every continuation of its longest matches, best-first by estimated
        probability (:func:`~trimpass.spec.proposers.arena.tree_vote`)."""
        return tree_vote(self.found.get(rid) or [], size, depth, self.config.min_prob)

    def keep_only(self, req_ids) -> None:
        super().keep_only(req_ids)
        for rid in [r for r in self.found if r not in self.live]:
            del self.found[rid]

    def finish(self, rid, output=None) -> None:
        """Request ``rid`` finished: its ``output`` (None: the arena's text past its prompt)
        kept for its tenant; its arena dropped."""
        own = self.live.get(rid)
        if output is None and own is not None:
            output = own.tokens[self.prompt.get(rid, 0):own.used]
        if self.store is not None and output is not None and rid in self.tenant:
            self.store.add(self.tenant[rid], output)
        for d in (self.live, self.expected, self.prompt, self.tenant, self.found):
            d.pop(rid, None)

