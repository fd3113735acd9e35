"""The model's own full LM head, applied eagerly to stored hidden states: what the fused loop
verifies with (:func:`trimpass.spec.verify.greedy` takes it as its ``head``). Its several-row
products run upcast where this CPU multiplies half precision slowly (:mod:`trimpass.hf.upcast`,
decided by :meth:`FullHead.calibrate`), and the final logit softcap applies where the config has
one."""
from __future__ import annotations

import torch

from trimpass.base import softcap
from trimpass.hf import upcast


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
        return softcap(self.product(h), self.cap)
