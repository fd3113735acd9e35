"""The fused loop's rounds on the device: what follows each drafting step, the verification with
acceptance, rollback and sampling, and plain decoding's token, each one compiled graph over the
loop's persistent buffers (:class:`Buffers`), so that a round is graphs plus one packed read.

* :meth:`Rounds.keep` follows a drafting step (its hidden state and trimmed logits): the drafted
  token (the argmax, or a draw from the trimmed softmax by the exponential race,
  :func:`~trimpass.spec.verify.race`: no ``multinomial``), its confidence and, sampling, its
  distribution, written at row ``j`` of the round's buffers; the pending token becomes the drafted
  one; ``pos`` and ``j`` advance by one.
* :meth:`Rounds.accept` verifies a self-draft round's ``R`` rows with the full head: rows ``j < m``
  verify ``D[j]``, a row past them predicts the token after. Greedy: each row's argmax, kept while
  it equals its draft; a row whose top two logits lie closer than
  :func:`~trimpass.spec.verify.tolerance` is flagged for the host's recheck. Sampled: speculative
  sampling (:func:`~trimpass.spec.verify.kept`), the fix drawn from
  :func:`~trimpass.spec.verify.residual` by the exponential race. The rule is
  :mod:`trimpass.spec.verify`'s; these graphs compute it on the device. It sets the pending token,
  moves ``pos`` to the end of what it kept (a rollback) and returns one packed int64 tensor: the
  kept count, the depth where the drafter's confidence first dropped below ``confidence``, then per
  row the near-tie flag, the target's token and the drafted token.
* :meth:`Rounds.walk` verifies a draft tree's rows (a free draft's pass: a chain is a tree too):
  every row's target token (the argmax, or a draw from the target's distribution), a node kept
  where its token is its parent's target token and its parent was kept; the deepest kept node's
  path is the accepted one (siblings hold distinct tokens: at most one path), its keys and values
  moved to the positions after the pending token's in every layer, the rest left past ``pos``
  (rolled back). Sampled, each row draws its token independently and a node is kept where it
  equals its parent's draw: SpecInfer's recursive rejection over siblings whose drafts are point
  masses, every emitted token distributed as the target's (:func:`~trimpass.spec.verify.walk`).
* :meth:`Rounds.token` is plain decoding's (and the prefill's) token from one hidden state.

The target's distribution is Hugging Face's (temperature, top-k, top-p in that order, as its
logits warpers compute them) with the values in a tensor (:func:`warped`), so one graph serves
every sampling setting of a kind. Every method runs under ``fullgraph=True``; the loop compiles
them (:class:`trimpass.hf.fused.FusedLoop`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from trimpass.base import softcap
from trimpass.hf import upcast  # noqa: F401  (registers trimpass::upcast_linear)
from trimpass.hf.step import own_code
from trimpass.spec import verify
from trimpass.spec.verify import race

METHODS = ("keep", "accept", "walk", "token")


def warped(z: torch.Tensor, warp: torch.Tensor, top_k: bool, top_p: bool) -> torch.Tensor:
    """Hugging Face's temperature, top-k and top-p warpers over logits ``z`` [R, V] in fp32, with
    ``warp`` = (temperature, k, p) a tensor; ``top_k``/``top_p``: whether each applies."""
    z = z.float() / warp[0]
    if top_k:
        k = warp[1].long().clamp(1, z.shape[-1]) - 1
        kth = z.sort(-1, descending=True).values.gather(-1, k.expand(z.shape[0], 1))
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p:
        ascending, order = z.sort(-1)
        drop = ascending.softmax(-1).cumsum(-1) <= 1 - warp[2]
        drop[..., -1:] = False
        z = z.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return z


def _greedy(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax of logits ``z`` [R, V] and whether its top two lie within
    :func:`~trimpass.spec.verify.tolerance` (a near-tie the host computes again alone)."""
    top = z.topk(2, dim=-1)
    gap = top.values[:, 0].float() - top.values[:, 1].float()
    return top.indices[:, 0], (gap <= verify.tolerance(top.values[:, 0], z.dtype)).long()


class Buffers:
    """The loop's persistent device buffers (static addresses): the pending token ``tok``; per
    round of up to ``depth`` rows the hidden states ``H``, drafted ids ``D``, confidences ``C``,
    the drafter's distributions ``Q`` (sampling) and the row cursor ``j``; ``tree``: a free draft's
    pass of up to ``rows`` rows (a tree; a chain is one), packed (its node count, then per row its
    token, depth and parent, then the rows' ancestor matrix: :meth:`tree_views`); ``warp``
    (temperature, top-k, top-p) and ``confidence``."""

    def __init__(self, depth: int, width: int, vocab: int, rows: int, dtype, device,
                 confidence: float):
        def static(t):
            torch._dynamo.mark_static_address(t, guard=False)
            return t
        long = dict(dtype=torch.long, device=device)
        self.tok, self.j = static(torch.zeros(1, 1, **long)), static(torch.zeros((), **long))
        self.H = static(torch.zeros(depth, width, dtype=dtype, device=device))
        self.D = static(torch.zeros(depth, **long))
        self.C = static(torch.zeros(depth, device=device))
        self.Q = static(torch.zeros(depth, vocab, device=device))
        self.most = rows
        self.tree = static(torch.zeros(1 + 3 * rows + rows * rows, **long))
        self.warp = static(torch.tensor([1.0, vocab, 1.0], device=device))
        self.confidence = static(torch.tensor(float(confidence), device=device))


    def tree_views(self, S: int) -> tuple:
        """(node count [1], tokens [S], depths [S], parents [S], ancestors [S, S]) of a pass of
        ``S`` rows: contiguous views at fixed offsets of :attr:`tree`."""
        t, M = self.tree, self.most
        anc = t[1 + 3 * M:1 + 3 * M + S * S].view(S, S)
        return t[:1], t[1:1 + S], t[1 + M:1 + M + S], t[1 + 2 * M:1 + 2 * M + S], anc

    def pack_tree(self, m: int, ids: list, depth: list, parent: list, anc: list) -> None:
        """One host-to-device copy of a tree pass's rows (:meth:`tree_views`' layout)."""
        M, S = self.most, len(ids)
        host = torch.zeros(1 + 3 * M + M * M, dtype=torch.long)
        host[0] = m
        for k, v in enumerate((ids, depth, parent)):
            host[1 + k * M:1 + k * M + S] = torch.tensor(v, dtype=torch.long)
        host[1 + 3 * M:1 + 3 * M + S * S] = torch.tensor(anc, dtype=torch.long).view(-1)
        self.tree.copy_(host, non_blocking=True)


class Rounds(torch.nn.Module):
    """``model``'s full head (and its final logit softcap) with the round's graphs; ``upcast``:
    several rows' head products in fp32 (:mod:`trimpass.hf.upcast`)."""

    def __init__(self, model):
        super().__init__()
        head = model.get_output_embeddings()
        self.head = head
        self.cap = float(getattr(model.config, "final_logit_softcapping", None) or 0.0)
        self.upcast = False
        for name in METHODS:
            own_code(self, getattr(Rounds, name), name)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        W, b = self.head.weight, getattr(self.head, "bias", None)
        if self.upcast and h.shape[0] > 1:
            return softcap(torch.ops.trimpass.upcast_linear(h, W, b), self.cap)
        return softcap(F.linear(h, W, b), self.cap)

    def keep(self, h, z, buf_H, buf_D, buf_C, buf_Q, j, tok, pos, warp, sampled: bool):
        if sampled:
            q = torch.softmax(z.float() / warp[0], dim=-1)
            t, conf = race(q), q.amax(-1)
            buf_Q.index_copy_(0, j.view(1), q)
        else:
            t, conf = z.argmax(-1), torch.softmax(z, -1, dtype=torch.float32).amax(-1)
        buf_H.index_copy_(0, j.view(1), h)
        buf_D.index_copy_(0, j.view(1), t)
        buf_C.index_copy_(0, j.view(1), conf)
        tok.copy_(t.view(1, 1))
        pos.add_(1)
        j.add_(1)

    def accept(self, H, D, C, Q, m, tok, pos, j, warp, confidence, sampled: bool, top_k: bool,
               top_p: bool):
        """The rows came from drafting steps: ``pos`` is already past them, ``m = R``."""
        R = H.shape[0]
        rows = torch.arange(R, device=H.device)
        z = self.logits(H)
        if sampled:
            p = torch.softmax(warped(z, warp, top_k, top_p), dim=-1)
            qx = Q.gather(1, D.view(R, 1))[:, 0]
            keep = verify.kept(p.gather(1, D.view(R, 1))[:, 0], qx, torch.rand(R, device=H.device))
            ties = torch.zeros(R, dtype=torch.long, device=H.device)
        else:
            ids, ties = _greedy(z)
            keep = ids == D
        n = verify.accepted(keep & (rows < m))
        at = n.clamp(max=R - 1).view(1)  # a 1-element index: a 0-d one is read on the host
        if sampled:
            q_n = Q[at]
            ids = race(verify.residual(p[at], q_n)).expand(R)
        tail = n < R
        emitted = n + tail.long()
        last = torch.where(tail, ids[at], D[R - 1:])
        tok.copy_(last.view(1, 1))
        pos.add_(emitted - R)
        j.zero_()
        low = C < confidence
        stop = torch.where(low.any(), low.long().argmax() + 1, R + 1)
        return torch.cat([n.view(1), stop.view(1), ties, ids, D])

    def walk(self, H, ids, parent, anc, depth, m, kv: list, tok, pos, warp, sampled: bool,
             top_k: bool, top_p: bool):
        """Verify a tree pass's ``R`` rows (row 0 the pending token at ``pos``, rows ``1..m`` the
        nodes, the rest padding; ``H`` their hidden states, ``ids`` their tokens): keep the deepest
        accepted path, move its keys and values in ``kv`` (every layer's) to ``pos + 0..n``, set
        the pending token and ``pos``. Returns the kept count, the deepest kept row, the path's
        rows by depth, then per row the near-tie flag and the target's token."""
        R = H.shape[0]
        rows = torch.arange(R, device=H.device)
        z = self.logits(H)
        if sampled:
            ids_t = race(torch.softmax(warped(z, warp, top_k, top_p), dim=-1))
            ties = torch.zeros(R, dtype=torch.long, device=H.device)
        else:
            ids_t, ties = _greedy(z)
        best, path = verify.walk(ids, parent, anc != 0, depth, ids_t, rows <= m)
        n = depth.index_select(0, best)
        src, dst = pos + path, pos + rows
        for t in kv:
            t.index_copy_(2, dst, t.index_select(2, src))
        tok.copy_(ids_t.index_select(0, best).view(1, 1))
        pos.add_(n[0] + 1)
        return torch.cat([n, best, path, ties, ids_t])

    def token(self, h, tok, pos, warp, sampled: bool, top_k: bool, top_p: bool,
              advance: bool):
        """The full head's token from one hidden state ``h`` [1, d] (greedy or a draw from the
        target's distribution), made the pending token; ``advance``: ``pos`` moves past the row
        that ``h`` came from (plain decoding), else stays (the prompt's last row)."""
        z = self.logits(h)
        t = race(torch.softmax(warped(z, warp, top_k, top_p), -1)) if sampled else z.argmax(-1)
        tok.copy_(t.view(1, 1))
        if advance:
            pos.add_(1)
        return t
