"""The fused loop's sampling setting, as its round graphs read it: temperature, top-k and top-p,
applied in that order in fp32 as Hugging Face's logits warpers apply them
(:func:`trimpass.hf.rounds.warped` computes them on the device from :meth:`Sampler.values`,
tested equal to Hugging Face's own warpers); the drafter's distribution is the
temperature-scaled trimmed softmax."""
from __future__ import annotations

import torch

from trimpass.spec.config import Sampling


class Sampler:
    """One sampling setting: ``top_k``/``top_p`` say whether each warper applies."""

    def __init__(self, temperature, top_k, top_p):
        self.t = float(temperature)
        self.k, self.p = top_k, top_p
        self.top_k, self.top_p = top_k is not None, top_p is not None and top_p < 1

    @classmethod
    def of(cls, sampling: Sampling) -> Sampler | None:
        """The sampler of a setting, None for greedy decoding."""
        if not sampling.do_sample:
            return None
        return cls(sampling.temperature, sampling.top_k, sampling.top_p)

    def values(self, vocab: int) -> torch.Tensor:
        """(temperature, top-k, top-p) as the loop's round graphs read them (:func:`trimpass.hf.
        rounds.warped`): a warper that is off takes a value that changes nothing."""
        return torch.tensor([self.t, vocab if self.k is None else min(self.k, vocab),
                             self.p if self.top_p else 1.0])
