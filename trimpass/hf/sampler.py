"""The fused loop's sampling distributions: the target's as ``model.generate`` samples it
(temperature, top-k, top-p, in that order, in fp32, through Hugging Face's own logits warpers)
and the drafter's (the temperature-scaled trimmed softmax)."""
from __future__ import annotations

import torch

from trimpass.spec.config import Sampling


class Sampler:
    """The target's and the drafter's probabilities for one sampling setting."""

    def __init__(self, temperature, top_k, top_p):
        from transformers import (
            LogitsProcessorList,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )
        self.t = float(temperature)
        self.k, self.p = top_k, top_p
        self.top_k, self.top_p = top_k is not None, top_p is not None and top_p < 1
        warpers = [TemperatureLogitsWarper(self.t)] if self.t != 1.0 else []
        warpers += [TopKLogitsWarper(top_k)] if top_k is not None else []
        warpers += [TopPLogitsWarper(top_p)] if top_p is not None and top_p < 1 else []
        self.warpers = LogitsProcessorList(warpers)

    @classmethod
    def of(cls, sampling: Sampling) -> Sampler | None:
        """The sampler of a setting, None for greedy decoding."""
        if not sampling.do_sample:
            return None
        return cls(sampling.temperature, sampling.top_k, sampling.top_p)

    def target(self, z: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.warpers(None, z.float()), dim=-1)

    def draft(self, z: torch.Tensor) -> torch.Tensor:
        return torch.softmax(z.float() / self.t, dim=-1)

    def values(self, vocab: int) -> torch.Tensor:
        """(temperature, top-k, top-p) as the loop's round graphs read them (:func:`trimpass.hf.
        rounds.warped`): a warper that is off takes a value that changes nothing."""
        return torch.tensor([self.t, vocab if self.k is None else min(self.k, vocab),
                             self.p if self.top_p else 1.0])
