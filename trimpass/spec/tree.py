"""A draft tree, engine-neutral: the tokens a round verifies in one pass when the drafters know more
than one continuation. Node ``i`` holds a token, its parent's index (``-1``: the root, the pending
token the pass starts from) and its ``share``, the drafter's estimate of its probability given its
parent (a suffix index's count share; 1 along a chain). A parent always comes before its children.
:meth:`DraftTree.valued` prices every node as the probability that verification reaches it, from
the source's measured acceptance by depth along its main path (the child of highest share at
each node) and the shares of the siblings beside it; :meth:`DraftTree.merged` joins two sources'
trees as a trie; :meth:`DraftTree.best_first` keeps the nodes worth the most, parents first, as
the rows of a pass (:meth:`DraftTree.rows`: tokens, depths, ancestors)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DraftTree:
    ids: list = field(default_factory=list)
    parents: list = field(default_factory=list)
    shares: list = field(default_factory=list)
    values: list = field(default_factory=list)  # P(verification reaches the node), once valued

    def __len__(self) -> int:
        return len(self.ids)

    @classmethod
    def chain(cls, ids, shares=None) -> DraftTree:
        ids = [int(t) for t in ids]
        return cls(ids, list(range(-1, len(ids) - 1)),
                   [1.0] * len(ids) if shares is None else [float(s) for s in shares])

    def add(self, token: int, parent: int, share: float) -> int:
        """A child ``token`` of ``parent`` (its index, if there already was one)."""
        for i in range(parent + 1, len(self.ids)):
            if self.parents[i] == parent and self.ids[i] == token:
                return i
        self.ids.append(int(token))
        self.parents.append(int(parent))
        self.shares.append(float(share))
        return len(self.ids) - 1

    def depths(self) -> list[int]:
        """Each node's depth (a child of the root: 1)."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def main_children(self) -> dict:
        """parent -> its child of highest share (the first such in node order)."""
        best: dict = {}
        for i, p in enumerate(self.parents):
            if p not in best or self.shares[i] > self.shares[best[p]]:
                best[p] = i
        return best

    def main(self) -> list[int]:
        """The main path's tokens: from the root, each node's child of highest share."""
        best, out, node = self.main_children(), [], -1
        while node in best:
            node = best[node]
            out.append(self.ids[node])
        return out

    def valued(self, accept) -> DraftTree:
        """Every node's value: the product, along its path, of ``accept[d - 1]`` (the source's
        measured P(depth d kept | depth d - 1 kept) on its main path) for a main child and, for
        a side child, of the rest ``1 - accept[d - 1]`` split between the siblings by their
        shares."""
        best, depth, values = self.main_children(), self.depths(), []
        for i, p in enumerate(self.parents):
            a = float(accept[min(depth[i], len(accept)) - 1])
            if best[p] == i:
                edge = a
            else:
                rest = 1.0 - self.shares[best[p]]
                edge = (1.0 - a) * min(1.0, self.shares[i] / rest) if rest > 0 else 0.0
            values.append(edge * (values[p] if p >= 0 else 1.0))
        self.values = values
        return self

    def merged(self, other: DraftTree) -> DraftTree:
        """A trie of both valued trees: a node both hold keeps the higher value."""
        out = DraftTree(list(self.ids), list(self.parents), list(self.shares), list(self.values))
        where: list[int] = []
        for i, p in enumerate(other.parents):
            j = out.add(other.ids[i], where[p] if p >= 0 else -1, other.shares[i])
            if j == len(out.values):
                out.values.append(other.values[i])
            else:
                out.values[j] = max(out.values[j], other.values[i])
            where.append(j)
        return out

    def best_first(self, size: int, depth: int) -> DraftTree:
        """The ``size`` nodes of highest value no deeper than ``depth``, in that order (a child's
        value never exceeds its parent's, so each parent stays before its children)."""
        deep = self.depths()
        order = sorted((i for i in range(len(self.ids)) if deep[i] <= depth),
                       key=lambda i: (-self.values[i], deep[i], i))
        kept, index = [], {}
        for i in order:
            if len(kept) == size:
                break
            if self.parents[i] < 0 or self.parents[i] in index:
                index[i] = len(kept)
                kept.append(i)
        p = [index[self.parents[i]] if self.parents[i] >= 0 else -1 for i in kept]
        return DraftTree([self.ids[i] for i in kept], p, [self.shares[i] for i in kept],
                         [self.values[i] for i in kept])

    def prefix(self, n: int) -> DraftTree:
        """The first ``n`` nodes (parents come first: a tree)."""
        return DraftTree(self.ids[:n], self.parents[:n], self.shares[:n], self.values[:n])

    def confidences(self) -> list[float]:
        """The values as a chain's confidences (each over the one before), so that a chain's
        pricing (its cumulative products) reads each node's value: for best-first nodes."""
        out, last = [], 1.0
        for v in self.values:
            out.append(v / last if last > 0 else 0.0)
            last = v
        return out

    def rows(self, token: int) -> tuple[list[int], list[int], list[list[bool]]]:
        """A pass over the pending ``token`` and the nodes: each row's token, depth and which
        rows are its ancestors or itself (row 0: the root)."""
        ids, depth = [int(token)] + self.ids, [0] + self.depths()
        anc = [[False] * (len(ids)) for _ in ids]
        anc[0][0] = True
        for i, p in enumerate(self.parents, start=1):
            anc[i] = list(anc[p + 1])
            anc[i][i] = True
        return ids, depth, anc
