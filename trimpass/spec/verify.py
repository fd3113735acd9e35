"""Verification: which drafted tokens the target keeps, and its own token after them. The one place
the acceptance rule is computed: the fused loop, the reference chain and tree loops and the
training losses' simulations call it.

Greedy: a drafted token is kept while it is the target's argmax. Row invariance of decisions: a
batched head product may round a row differently from the one-row product plain decoding computes
(this CPU: bit-identical in bf16 for Gemma-3's head, up to 1.4e-6 apart in fp32;
``docs/fused.md``). Only the argmax matters, so a row whose top two logits lie closer than
:func:`tolerance` is computed again alone; every other row's argmax cannot change between the two
products. Speculative sampling: a drafted ``x ~ q`` is kept with probability ``min(1, p(x) /
q(x))`` (:func:`kept`); at the first rejection the token is drawn from ``(p - q)+`` normalized,
which makes every emitted token distributed as ``p`` whatever ``q`` is. A lookup draft has no
distribution: its ``q`` is a point mass on the drafted id (:func:`point_mass`), so ``x`` is kept
with probability ``p(x)``.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

# A rounding bound between a one-row and a several-row product of the same row, in units of the
# dtype's eps times the logit's size: 2 ulps where the output is rounded to 16 bits; in fp32
# 256 eps, 20x the largest difference measured (fp32 accumulation order, not output rounding).
ULPS = {torch.bfloat16: 2.0, torch.float16: 2.0, torch.float32: 256.0, torch.float64: 256.0}


def tolerance(top: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """How far apart two logits of size ``|top|`` may come out of two products of one row."""
    return ULPS.get(dtype, 256.0) * torch.finfo(dtype).eps * top.float().abs().clamp(min=1.0)


def agreed(ids, drafted) -> int:
    """How many leading drafted tokens equal the target's ``ids`` (tensors, or host lists)."""
    if isinstance(ids, list):
        return next((i for i, (a, b) in enumerate(zip(ids, drafted, strict=False)) if a != b),
                    min(len(ids), len(drafted)))
    k = min(drafted.shape[0], ids.shape[0])
    return int(torch.ne(ids[:k], drafted[:k]).cumsum(0).eq(0).sum())


def greedy(head: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor,
           drafted: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """The target's argmax for each row of ``h`` [k, d] (``head``: hidden states to logits), as
    the one-row product of that row gives it; returns (ids [k], rows computed again alone). One
    host read when k > 1. With ``drafted`` (the tokens rows ``0 .. len(drafted) - 1`` verify), only
    the rows a round keeps are exact: those up to the first that disagrees with its draft (a
    near-tie past it is not computed again: its token is never emitted, and a one-row product
    costs about a whole head's weight read)."""
    z = head(h)
    if h.shape[0] == 1:
        return z.argmax(-1), 0
    top = z.topk(2, dim=-1)
    ids = top.indices[:, 0].clone()
    close = (top.values[:, 0].float() - top.values[:, 1].float()) <= tolerance(top.values[:, 0],
                                                                               z.dtype)
    again = 0
    for j in close.nonzero().flatten().tolist():
        if drafted is not None and j > agreed(ids, drafted):
            break
        ids[j] = head(h[j:j + 1]).argmax(-1)[0]
        again += 1
    return ids, again


def greedy_round(head, h: torch.Tensor, drafted: torch.Tensor) -> tuple[list[int], int, int]:
    """A greedy round over ``k`` drafted ids verified by ``h`` [k or k + 1, d] (row j: the state
    that predicts drafted[j]; a row past them predicts the token after them all): (the emitted
    ids, the kept count n, rows computed again alone). Emits the kept drafts, then the target's own
    token where there is a row for it."""
    target, again = greedy(head, h, drafted)
    n = agreed(target, drafted)
    tail = [int(target[n])] if n < target.shape[0] else []
    return drafted[:n].tolist() + tail, n, again


def kept(p_x: torch.Tensor, q_x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Speculative sampling's rule for a drafted ``x`` with uniform ``u``: kept where ``u < p(x) /
    q(x)``, computed without dividing by a ``q(x)`` that rounds to 0."""
    return u * q_x < p_x


def accepted(keep: torch.Tensor) -> torch.Tensor:
    """The kept prefix's length along the last dimension of a kept mask."""
    return keep.long().cumprod(-1).sum(-1)


def race(p: torch.Tensor) -> torch.Tensor:
    """A draw from each row of ``p`` [R, V] (not necessarily normalized) with no host sync, as
    gpt-fast samples: the argmax of ``p / E`` for ``E ~ Exp(1)`` (the first of independent
    exponential clocks of rates ``p``); what the loop's graphs sample with, never
    ``multinomial``."""
    return (p / torch.empty_like(p).exponential_(1)).argmax(-1)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The distribution a rejection draws from, unnormalized and without a host read: ``(p -
    q)+``, or ``p`` where that is zero everywhere (the draft was then kept with probability 1)."""
    r = (p - q).clamp(min=0)
    return torch.where(r.sum(-1, keepdim=True) > 0, r, p)


def point_mass(drafted: torch.Tensor, V: int, dtype=torch.float32) -> torch.Tensor:
    """A lookup draft's ``q`` [k, V]: all its mass on each drafted id."""
    return torch.nn.functional.one_hot(drafted, V).to(dtype)


def speculative(p: torch.Tensor, q: torch.Tensor, drafted: torch.Tensor,
                generator: torch.Generator | None = None) -> tuple[int, int | None]:
    """Speculative sampling over ``k`` drafted ids: ``p``, ``q`` [k, V] the target's and the
    drafter's probabilities at each drafted position, ``drafted`` [k] the ids drawn from ``q``.
    Returns (accepted n, the token drawn from ``(p - q)+`` at row n, or None if all were kept).
    One host read."""
    rows = torch.arange(drafted.shape[0], device=drafted.device)
    u = torch.rand(drafted.shape, device=p.device, dtype=p.dtype, generator=generator)
    n = int(accepted(kept(p[rows, drafted], q[rows, drafted], u)))
    if n == drafted.shape[0]:
        return n, None
    return n, residual_sample(p[n], q[n], generator)


def residual_sample(p: torch.Tensor, q: torch.Tensor,
                    generator: torch.Generator | None = None) -> int:
    """The token after a rejection: drawn from ``(p - q)+`` normalized (``p`` itself where ``p <=
    q`` everywhere: the drafted token was then kept with probability 1)."""
    residual = (p - q).clamp(min=0)
    if float(residual.sum()) <= 0:
        residual = p
    return int(torch.multinomial(residual, 1, generator=generator))


def sampled_round(p: torch.Tensor, q: torch.Tensor, drafted: torch.Tensor,
                  generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """A sampled round: ``p`` [k or k + 1, V] the target's probabilities (a row past the drafts:
    the token after them all), ``q`` [k, V] the drafter's. (The emitted ids, the kept count n.)"""
    k = drafted.shape[0]
    n, fix = speculative(p[:k], q, drafted, generator)
    if fix is None and p.shape[0] > k:
        fix = int(torch.multinomial(p[k], 1, generator=generator))
    return drafted[:n].tolist() + ([fix] if fix is not None else []), n


def greedy_walk(children: dict, target_next: Callable[[int], int], limit: int) -> list[int]:
    """Greedy verification of a draft tree: from the root (node 0) follow the target's own token
    (``target_next(node)``) while the tree has that child (``children[(node, token)]``), at most
    ``limit`` tokens; the first token the tree lacks is the target's own and ends the walk."""
    out, node = [], 0
    while len(out) < limit:
        t = target_next(node)
        out.append(t)
        node = children.get((node, t))
        if node is None:
            break
    return out


def walk(ids: torch.Tensor, parent: torch.Tensor, anc: torch.Tensor, depth: torch.Tensor,
         target: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft tree's verification on the device, without a host read: rows ``ids`` [R] (row 0
    the root), each row's ``parent`` (the root's: anything), ``anc`` [R, R] (ancestors and
    itself), ``depth`` [R], the target's token at each row ``target`` [R] (its argmax, or a draw
    from its distribution) and which rows are ``real`` (not padding). A node is kept where its
    token is its parent's target token and every ancestor was kept; with distinct siblings at
    most one node per depth is. Returns the deepest kept row (a 1-element tensor) and the
    accepted path's rows by depth [R] (past its end: row 0). Sampled, this is SpecInfer's
    recursive rejection over siblings for point-mass drafts (:func:`siblings`): the first token
    after each kept node is the target's own draw."""
    R = ids.shape[0]
    rows = torch.arange(R, device=ids.device)
    match = ((ids == target[parent.clamp(min=0)]) & real) | (rows == 0)
    kept = ~(anc & ~match[None, :]).any(1)
    best = (depth * kept).argmax().view(1)  # a 1-element index: a 0-d one is read on the host
    path = (anc.index_select(0, best) & (depth[None, :] == rows[:, None])).long().argmax(1)
    return best, path


def siblings(p: torch.Tensor, drafts: list, generator: torch.Generator | None = None):
    """SpecInfer's recursive rejection over the children of one node: ``p`` [V] the target's
    distribution there, ``drafts`` each child's ``(token, q)`` (``q`` [V] the distribution its
    token was drawn from; a point mass for a deterministic draft). Each child in turn is kept with
    probability ``min(1, r(x) / q(x))``, ``r`` starting at ``p`` and after each rejection ``(r -
    q)+`` normalized; returns (the kept child's index, None), or (None, a token drawn from ``r``)
    when every child was rejected. The emitted token is distributed as ``p`` (a reference)."""
    r = p.double() / p.sum()
    for i, (x, q) in enumerate(drafts):
        q = q.double()
        u = torch.rand((), generator=generator, dtype=torch.float64)
        if float(u * q[x]) < float(r[x]):
            return i, None
        r = (r - q).clamp(min=0)
        r = r / r.sum() if float(r.sum()) > 0 else p.double() / p.sum()
    return None, int(torch.multinomial(r, 1, generator=generator))
