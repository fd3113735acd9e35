"""EAGLE-2-style tree drafting with greedy verification, cache-less and batch 1 (any drafter).

Each round grows a draft tree: at every depth the drafter scores the current frontier's paths in
one batched call, each frontier node proposes its top-``topk`` children, and the ``topk`` children
with the highest cumulative log-probability become the next frontier, until ``depth`` levels or
``budget`` tree tokens. The target then scores every root-to-leaf path in one batched call, and the
walk from the root follows the target's argmax while the tree has that child; the first token it
lacks is the target's own. Every emitted token is the target's greedy choice: lossless.
"""
from __future__ import annotations

import functools
import time

import torch

from trimpass.loops.chain import logits_of
from trimpass.loops.stats import LoopStats
from trimpass.measure import Stopwatch
from trimpass.spec import verify


@torch.no_grad()
def generate(target, draft, ids: torch.Tensor, max_new: int, depth: int = 4, topk: int = 3,
             budget: int = 16) -> tuple[torch.Tensor, LoopStats]:
    st = LoopStats("tree")
    draft_call, target_call = Stopwatch(ms=st.draft_ms_each), Stopwatch(ms=st.target_ms_each)
    t0 = time.perf_counter()
    while st.emitted < max_new:
        parent, token, score = [-1], [None], [0.0]  # node 0 is the root (the last real token)
        frontier = [0]
        for _ in range(depth):
            if len(token) - 1 >= budget:
                break
            paths = torch.stack([torch.cat([ids[0], _path(ids, parent, token, f)])
                                 for f in frontier])
            lp = torch.log_softmax(draft_call(logits_of, draft, paths)[:, -1].double(), -1)
            vals, toks = lp.topk(topk, dim=-1)
            cand = sorted(((score[f] + float(v), f, int(t)) for f, vs, ts in
                           zip(frontier, vals, toks, strict=True)
                           for v, t in zip(vs, ts, strict=True)), reverse=True)
            frontier = []
            for s, f, t in cand[:min(topk, budget - (len(token) - 1))]:
                parent.append(f)
                token.append(t)
                score.append(s)
                frontier.append(len(token) - 1)
        leaves = [n for n in range(1, len(token)) if n not in parent] or [0]
        L = max(len(_path(ids, parent, token, n)) for n in leaves)
        batch = torch.stack([torch.cat([ids[0], _pad(_path(ids, parent, token, n), L)])
                             for n in leaves])
        tl = target_call(logits_of, target, batch)  # [leaves, S + L, V]
        children = {}
        for n in range(1, len(token)):
            children.setdefault((parent[n], token[n]), n)
        target_next = functools.partial(_target_next, tl, leaves, parent, ids.shape[1])
        out = verify.greedy_walk(children, target_next, max_new - st.emitted)
        st.rounds += 1
        st.drafted += len(token) - 1
        st.accepted += len(out) - 1
        st.emitted += len(out)
        st.per_round.append(len(out))
        ids = torch.cat([ids, ids.new_tensor([out])], dim=1)
    st.seconds = time.perf_counter() - t0
    return ids, st


def _target_next(tl, leaves, parent, S: int, node: int) -> int:
    """The target's own token after ``node``: its argmax at ``node``'s depth on a leaf's path."""
    leaf = next(i for i, n in enumerate(leaves) if _on_path(parent, n, node))
    depth = 0
    while node > 0:
        node, depth = parent[node], depth + 1
    return int(tl[leaf, S - 1 + depth].argmax())


def _path(ids, parent, token, n) -> torch.Tensor:
    toks = []
    while n > 0:
        toks.append(token[n])
        n = parent[n]
    return ids.new_tensor(toks[::-1])


def _pad(p: torch.Tensor, L: int) -> torch.Tensor:
    return torch.cat([p, p.new_zeros(L - p.numel())])


def _on_path(parent, leaf, node) -> bool:
    while leaf > 0 and leaf != node:
        leaf = parent[leaf]
    return leaf == node
