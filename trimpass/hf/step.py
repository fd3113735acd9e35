"""One pass of a Hugging Face causal LM's body over new ids at its cache's position, compiled: the
fused loop's step. The positions are read from the cache's position tensor on the device
(:class:`~trimpass.hf.buckets.LoopCache`), never passed from the host; a position past the
model's last (a padding row's) is clamped for the position embeddings alone. It returns every row's
hidden state, the last row's and, with a head, that row's logits (the graph trimpass trims),
softcapped where the config says so."""
from __future__ import annotations

import types

import torch

from trimpass.base import softcap
from trimpass.hf import buckets, decode_attention


def own_code(module: torch.nn.Module, fn, name: str) -> None:
    """Bind ``fn`` (a function of the class) to ``module`` as ``name`` with a code object of its
    own: Dynamo keeps at most recompile_limit (8) graphs per code object, and each instance
    compiles its own graphs, so a code object per instance, not per class."""
    code = types.FunctionType(fn.__code__.replace(), fn.__globals__, name, fn.__defaults__)
    setattr(module, name, types.MethodType(code, module))


class Step(torch.nn.Module):
    """``model``'s body (its own attention, :mod:`trimpass.hf.decode_attention`) and, with
    ``head``, its LM head."""

    def __init__(self, model, head: bool):
        super().__init__()
        config = decode_attention.copy_config(model.config)  # its own attention, not the model's
        self.body = decode_attention.rebind(getattr(model, model.base_model_prefix),
                                            decode_attention.configs(model.config, config))
        self.head = model.get_output_embeddings() if head else None
        self.cap = float(getattr(model.config, "final_logit_softcapping", None) or 0.0)
        context = buckets.context_of(model)
        self.last = (context - 1) if context is not None else (1 << 62)
        own_code(self, Step.step, "forward")  # each step compiles its own (prefill, decode)

    def step(self, ids, cache):
        n = ids.shape[1]
        positions = (cache.pos + torch.arange(n, device=ids.device)).clamp(max=self.last)
        hs = self.body(input_ids=ids, position_ids=positions.unsqueeze(0), past_key_values=cache,
                       use_cache=True).last_hidden_state[0]
        h = hs[n - 1:]
        if self.head is None:
            return hs, h, None
        return hs, h, softcap(self.head(h), self.cap)
