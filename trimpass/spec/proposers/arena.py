"""The suffix index's storage: :class:`Arena` holds texts (a request's own, or a tenant's earlier
outputs) end to end in one int32 array, each followed by a ``-1`` separator, with two hash chains
over it, as zlib finds matches: for every position, the previous position whose preceding 2 (and 8)
tokens hash alike. :meth:`Arena.candidates` walks a chain from the newest occurrence of the query's
last tokens and measures each candidate's match (how many tokens before it equal the query's tail,
up to ``depth``) in one vectorized comparison; :func:`vote` walks the continuations of the longest
matches forward, one token a step, taking the token most of them continue with and its share of
them as its estimated probability (a suffix tree's child count over node count). Everything it
holds is in numpy arrays, so :attr:`Arena.nbytes` is its size; a text is dropped by overwriting it
with separators (no match can cross one), and :meth:`Arena.compacted` rebuilds the arena from its
live texts, its chains built vectorized."""
from __future__ import annotations

import heapq

import numpy as np

from trimpass.spec.tree import DraftTree

ANCHORS = (8, 2)  # chain widths, most selective first: tokens a candidate must share to be walked
WALK = 64  # candidates walked per chain, newest first
_MULT = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93,
                  0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, 0x27D4EB2F165667C5, 0x94D049BB133111EB],
                 dtype=np.uint64)


def _hashes(tokens: np.ndarray, width: int, bits: int) -> np.ndarray:
    """For each position ``i`` of ``tokens`` (``i >= width``): a ``bits``-bit hash of the ``width``
    tokens before it; -1 where fewer precede it or a separator is among them."""
    n = len(tokens)
    out = np.full(n, -1, dtype=np.int64)
    if n <= width:
        return out
    acc = np.zeros(n - width, dtype=np.uint64)
    bad = np.zeros(n - width, dtype=bool)
    with np.errstate(over="ignore"):
        for j in range(width):
            window = tokens[j:n - width + j]
            bad |= window < 0
            acc += window.astype(np.uint64) * _MULT[j]
        h = (acc * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(64 - bits)
    out[width:] = np.where(bad, -1, h.astype(np.int64))
    return out


class Arena:
    """Texts end to end in one array (``-1`` after each), hash-chained for matching. ``capacity``:
    tokens it holds before it grows (an append past it doubles it; :meth:`reserve` sets it)."""

    def __init__(self, capacity: int = 256):
        self.capacity = max(int(capacity), 16)
        self.bits = max(10, (self.capacity - 1).bit_length())
        self.tokens = np.full(self.capacity, -1, dtype=np.int32)
        self.prev = {w: np.full(self.capacity, -1, dtype=np.int32) for w in ANCHORS}
        self.head = {w: np.full(1 << self.bits, -1, dtype=np.int32) for w in ANCHORS}
        self.used = 0  # positions written (texts and separators)
        self.dead = 0  # positions of dropped texts
        self.starts: list[int] = []  # each text's first position, in order
        self.keys: list = []  # each text's key (None: dropped)

    @property
    def nbytes(self) -> int:
        return self.tokens.nbytes + sum(a.nbytes for a in (*self.prev.values(),
                                                           *self.head.values()))

    @staticmethod
    def bytes_for(capacity: int) -> int:
        """The bytes of an arena of ``capacity`` tokens (what :attr:`nbytes` will read)."""
        capacity = max(int(capacity), 16)
        return capacity * 4 * (1 + len(ANCHORS)) + (1 << max(10, (capacity - 1).bit_length())) \
            * 4 * len(ANCHORS)

    @property
    def live(self) -> int:
        return self.used - self.dead

    def open(self, key) -> None:
        """Start a text (its tokens come by :meth:`extend`); ``key`` names it for :meth:`drop`."""
        if self.starts and self.used and self.tokens[self.used - 1] >= 0:
            self._append(np.array([-1], dtype=np.int32))
        self.starts.append(self.used)
        self.keys.append(key)

    def extend(self, ids) -> None:
        """Append tokens to the open text."""
        ids = np.asarray(ids, dtype=np.int32).reshape(-1)
        if len(ids):
            self._append(ids)

    def close(self) -> None:
        """End the open text with a separator."""
        if self.used and self.tokens[self.used - 1] >= 0:
            self._append(np.array([-1], dtype=np.int32))

    def _append(self, ids: np.ndarray) -> None:
        if self.used + len(ids) > self.capacity:
            self._grow(max(2 * self.capacity, self.used + len(ids) + 1))
        a = self.used
        self.tokens[a:a + len(ids)] = ids
        self.used += len(ids)
        self._chain(a + 1, self.used + 1)  # position a was chained with the last append

    def _chain(self, a: int, b: int) -> None:
        """Chain positions ``a .. b-1`` (each hashed by the tokens before it) onto the chains."""
        b = min(b, self.capacity)
        for w in ANCHORS:
            lo = max(a - w, 0)
            self._link(w, np.arange(a, b), _hashes(self.tokens[lo:b], w, self.bits)[a - lo:])

    def _link(self, w: int, pos: np.ndarray, h: np.ndarray) -> None:
        """Positions ``pos`` (ascending, newer than every chained one) with hashes ``h`` put at
        the heads of their chains: within a bucket each points to the one before it, the first
        to the bucket's old head."""
        keep = h >= 0
        pos, h = pos[keep], h[keep]
        if not len(pos):
            return
        order = np.argsort(h, kind="stable")
        pos, h = pos[order], h[order]
        prev, head = self.prev[w], self.head[w]
        first = np.ones(len(pos), dtype=bool)
        first[1:] = h[1:] != h[:-1]
        prev[pos[~first]] = pos[:-1][~first[1:]]
        prev[pos[first]] = head[h[first]]
        last = np.ones(len(pos), dtype=bool)
        last[:-1] = first[1:]
        head[h[last]] = pos[last]

    def reserve(self, capacity: int) -> None:
        """Room for ``capacity`` tokens in all (never less than it holds)."""
        if capacity > self.capacity:
            self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        """Room for ``capacity`` tokens: the arrays extended where the hash table keeps its size,
        else everything re-placed and rechained."""
        if max(10, (capacity - 1).bit_length()) == self.bits:
            more, clipped = capacity - self.capacity, self.used == self.capacity
            self.tokens = np.concatenate([self.tokens, np.full(more, -1, dtype=np.int32)])
            for w in ANCHORS:
                self.prev[w] = np.concatenate([self.prev[w], np.full(more, -1, dtype=np.int32)])
            self.capacity = capacity
            if clipped:  # the end position, past the old arrays, is chained now
                self._chain(self.used, self.used + 1)
            return
        written, used, starts, keys, dead = (self.tokens[:self.used].copy(), self.used,
                                             self.starts, self.keys, self.dead)
        self.__init__(capacity)
        self.tokens[:used] = written
        self.used, self.starts, self.keys, self.dead = used, starts, keys, dead
        self._chain_all()

    def drop(self, key) -> int:
        """Overwrite the text named ``key`` with separators; the positions it held (0: none)."""
        if key not in self.keys:
            return 0
        i = self.keys.index(key)
        a = self.starts[i]
        b = self.starts[i + 1] if i + 1 < len(self.starts) else self.used
        self.tokens[a:b] = -1
        self.keys[i] = None
        self.dead += b - a
        return b - a

    def texts(self) -> list:
        """``(key, tokens)`` of every live text, oldest first."""
        out = []
        for i, key in enumerate(self.keys):
            if key is None:
                continue
            b = self.starts[i + 1] if i + 1 < len(self.starts) else self.used
            seq = self.tokens[self.starts[i]:b]
            out.append((key, seq[seq >= 0]))
        return out

    @classmethod
    def compacted(cls, texts: list, capacity: int | None = None) -> Arena:
        """An arena holding ``texts`` (``(key, tokens)``) alone, its chains built vectorized."""
        total = sum(len(t) + 1 for _, t in texts)
        arena = cls(capacity or total + 1)
        if total > arena.capacity:
            raise ValueError(f"arena: {total} tokens do not fit a capacity of {arena.capacity}")
        pos = 0
        for key, seq in texts:
            arena.starts.append(pos)
            arena.keys.append(key)
            arena.tokens[pos:pos + len(seq)] = seq
            pos += len(seq) + 1  # the separator, already -1
        arena.used = pos
        arena._chain_all()
        return arena

    def _chain_all(self) -> None:
        """Every chain rebuilt at once."""
        for w in ANCHORS:
            self.prev[w][:] = -1
            self.head[w][:] = -1
        self._chain(1, self.used + 1)

    def candidates(self, tail: np.ndarray, depth: int, end_excluded: int | None = None):
        """Positions whose preceding tokens match the end of ``tail`` (int32, its last ``depth``
        tokens matter), with each match's length, from the most selective chain that has any;
        ``end_excluded``: a position never offered (the query's own end in its own text)."""
        for w in ANCHORS:
            if len(tail) < w:
                continue
            h = _hashes(np.concatenate([tail[-w:], tail[-1:]]), w, self.bits)[w]
            found, p = [], int(self.head[w][h]) if h >= 0 else -1
            prev = self.prev[w]
            for _ in range(WALK + 1):  # the newest WALK positions (the excluded one aside)
                if p < 0 or len(found) == WALK:
                    break
                if p != end_excluded:
                    found.append(p)
                p = int(prev[p])
            if not found:
                continue
            at = np.asarray(found, dtype=np.int64)
            lengths = self.match_lengths(at, tail, depth)
            ok = lengths >= w
            if ok.any():
                return at[ok], lengths[ok]
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)

    def match_lengths(self, at: np.ndarray, tail: np.ndarray, depth: int) -> np.ndarray:
        """For each position in ``at``: how many tokens before it equal ``tail``'s last ones (at
        most ``depth``)."""
        d = min(depth, len(tail))
        back = at[:, None] - 1 - np.arange(d)[None, :]
        want = tail[::-1][:d]
        eq = (back >= 0) & (self.tokens[np.maximum(back, 0)] == want[None, :])
        return np.cumprod(eq, axis=1).sum(axis=1)


def vote(sources: list, limit: int, min_prob: float) -> tuple[list[int], list[float]]:
    """Up to ``limit`` tokens continuing the candidates of ``sources`` (``(arena, positions,
    period)``: ``period`` > 0 wraps a continuation that reaches the arena's end back by that many
    positions, the text repeating itself): each step the token most candidates continue with
    (ties: the newest), its share of the still-agreeing candidates its probability; stops where
    the product of probabilities falls below ``min_prob``. Returns the ids and their
    probabilities (each given the ones before)."""
    ids, probs, cum = [], [], 1.0
    live = [(a, np.asarray(p, dtype=np.int64), per) for a, p, per in sources if len(p)]
    for step in range(limit):
        tally = _tally(live, step)
        if tally is None:
            break
        vals, ((token, p), *_) = tally
        if cum * p < min_prob:
            break
        cum *= p
        ids.append(token)
        probs.append(p)
        live = [(a, at[v == token], per) for (a, at, per), v in zip(live, vals, strict=True)]
    return ids, probs


def tree_vote(sources: list, size: int, depth: int, min_prob: float) -> DraftTree:
    """:func:`vote`'s continuations as a tree, best-first by estimated probability (SuffixDecoding's
    tree): from the root, the next node is always the most probable continuation not yet taken
    (its probability: the product of count shares along its path), while it stays at or above
    ``min_prob``; at most ``size`` nodes, none deeper than ``depth``. A node's share is its count
    over its parent's candidates; of equal counts the newest comes first."""
    tree, deep = DraftTree(), {-1: 0}
    live = [(a, np.asarray(p, dtype=np.int64), per) for a, p, per in sources if len(p)]
    heap, serial = [(-1.0, 0, -2, -1, 1.0, live)], 1  # (-probability, order, parent, token, ...)
    while heap and len(tree) < size:
        neg, _, parent, token, share, live = heapq.heappop(heap)
        node = -1 if parent == -2 else tree.add(token, parent, share)
        step = deep[node] = 0 if node < 0 else deep[parent] + 1
        if step >= depth:
            continue
        tally = _tally(live, step)
        if tally is None:
            continue
        vals, children = tally
        for t, share in children:
            p = -neg * share
            if p < min_prob:
                break
            kept = [(a, at[v == t], per) for (a, at, per), v in zip(live, vals, strict=True)]
            heapq.heappush(heap, (-p, serial, node, t, share, kept))
            serial += 1
    return tree


def _tally(live: list, step: int):
    """Each source's tokens ``step`` after its candidates, and the tokens they hold, most common
    first (of equally common, the newest first), each with its share of the candidates (those
    that end count too); None where none continues."""
    vals = _continuations(live, step)
    every = np.concatenate(vals) if vals else np.zeros(0, dtype=np.int64)
    good = every[every >= 0]
    if not len(good):
        return None
    uniq, counts = np.unique(good, return_counts=True)
    tied = uniq[counts == counts.max()]
    first = int(tied[0]) if len(tied) == 1 else _newest(tied, vals, live)
    order = sorted(range(len(uniq)), key=lambda j: (-counts[j], int(uniq[j]) != first))
    return vals, [(int(uniq[j]), float(counts[j]) / len(every)) for j in order]


def _continuations(live: list, step: int) -> list:
    """Per source the token ``step`` places after each candidate (-1 past its text)."""
    vals = []
    for arena, at, period in live:
        idx = at + step
        if period:
            idx = at + step % np.maximum(arena.used - at, 1)
        ok = idx < arena.used
        vals.append(np.where(ok, arena.tokens[np.minimum(idx, arena.capacity - 1)], -1))
    return vals


def _newest(tied: np.ndarray, vals: list, sources: list) -> int:
    """Of equally counted tokens, the one continuing the newest candidate (the last source first:
    the request's own text is passed last)."""
    for (_, at, _), v in zip(reversed(sources), reversed(vals), strict=True):
        hit = np.isin(v, tied)
        if hit.any():
            return int(v[np.flatnonzero(hit)[np.argmax(at[hit])]])
    return int(tied[0])
