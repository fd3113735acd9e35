"""What the fused loop keeps of a round of drafts: the full head over the stored hidden states in
one batched product, its greedy decisions made invariant to how many rows that product had, and
speculative sampling's accept / resample rule.

Row invariance of decisions: a batched head product may round a row differently from the one-row
product plain decoding computes (this CPU: bit-identical in bf16 for Gemma-3's head, up to 1.4e-6
apart in fp32; ``docs/fused.md``). Only the argmax matters, so a row whose top two
logits lie closer than :func:`tolerance` is computed again alone; every other row's argmax cannot
change between the two products. Speculative sampling: a drafted ``x ~ q`` is kept with probability
``min(1, p(x) / q(x))``; at the first rejection the token is drawn from ``(p - q)+`` normalized,
which makes every emitted token distributed as ``p`` whatever ``q`` is.
"""
from __future__ import annotations

import torch

from trimpass.hf import upcast

# A rounding bound between a one-row and a several-row product of the same row, in units of the
# dtype's eps times the logit's size: 2 ulps where the output is rounded to 16 bits; in fp32
# 256 eps, 20x the largest difference measured (fp32 accumulation order, not output rounding).
ULPS = {torch.bfloat16: 2.0, torch.float16: 2.0, torch.float32: 256.0, torch.float64: 256.0}


class FullHead:
    """``model``'s own LM head (and its final logit softcap, where the config has one), applied
    eagerly to stored hidden states ``[k, d]``; several rows upcast where that measures faster
    (:mod:`trimpass.hf.upcast`, after :meth:`calibrate`)."""

    def __init__(self, model):
        head = model.get_output_embeddings()
        self.weight, self.bias = head.weight, getattr(head, "bias", None)
        self.cap = getattr(model.config, "final_logit_softcapping", None) or 0.0
        self.product = upcast.Linear(self.weight, self.bias)

    def calibrate(self) -> bool:
        """Measure whether several rows run faster upcast on this machine; returns the choice."""
        return self.product.calibrate()

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        z = self.product(h)
        return torch.tanh(z / self.cap) * self.cap if self.cap else z


def tolerance(top: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """How far apart two logits of size ``|top|`` may come out of two products of one row."""
    return ULPS.get(dtype, 256.0) * torch.finfo(dtype).eps * top.float().abs().clamp(min=1.0)


def greedy(head: FullHead, h: torch.Tensor,
           drafted: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """The full head's argmax for each row of ``h`` [k, d], as the one-row product of that row gives
    it; returns (ids [k], rows computed again alone). One host read when k > 1. With ``drafted``
    (the tokens rows ``0 .. len(drafted) - 1`` verify), only the rows a round keeps are exact: those
    up to the first that disagrees with its draft (a near-tie past it is not computed again: its
    token is never emitted, and a one-row product costs about a whole head's weight read)."""
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


def agreed(ids: torch.Tensor, drafted: torch.Tensor) -> int:
    """How many leading drafted tokens equal the target's ``ids``."""
    k = min(drafted.shape[0], ids.shape[0])
    return int(torch.ne(ids[:k], drafted[:k]).cumsum(0).eq(0).sum())


def speculative(p: torch.Tensor, q: torch.Tensor, drafted: torch.Tensor,
                generator: torch.Generator | None = None) -> tuple[int, int | None]:
    """Speculative sampling over ``k`` drafted ids: ``p``, ``q`` [k, V] the target's and the
    drafter's probabilities at each drafted position, ``drafted`` [k] the ids drawn from ``q``.
    Returns (accepted n, the token drawn from ``(p - q)+`` at row n, or None if all were kept).
    One host read."""
    rows = torch.arange(drafted.shape[0], device=drafted.device)
    px, qx = p[rows, drafted], q[rows, drafted]
    u = torch.rand(px.shape, device=p.device, dtype=p.dtype, generator=generator)
    kept = u * qx < px  # u < p/q without dividing by a q that rounds to 0
    n = int(kept.logical_not().cumsum(0).eq(0).sum())
    if n == drafted.shape[0]:
        return n, None
    residual = (p[n] - q[n]).clamp(min=0)
    if float(residual.sum()) <= 0:  # p == q where x was drawn: it is kept with probability 1
        residual = p[n]
    return n, int(torch.multinomial(residual, 1, generator=generator))
