"""One pass of a Hugging Face causal LM's body over new ids, compiled: the fused loop's step. It
returns every row's hidden state, that of one row (a one-element tensor: the last real row of a
padded chunk, a graph input, not a constant) and, with a head, that row's logits (the graph
trimpass trims), softcapped where the config says so."""
from __future__ import annotations

import types

import torch

from trimpass.base import softcap
from trimpass.hf import decode_attention


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
        # Dynamo keeps at most recompile_limit (8) graphs per code object, and each step
        # instance compiles its own (prefill, decode): a code object per step, not per class
        code = Step.step.__code__.replace()
        self.forward = types.MethodType(types.FunctionType(code, globals(), "forward"), self)

    def step(self, ids, position_ids, row, cache):
        hs = self.body(input_ids=ids, position_ids=position_ids, past_key_values=cache,
                       use_cache=True).last_hidden_state[0]
        h = hs.index_select(0, row)
        if self.head is None:
            return hs, h, None
        return hs, h, softcap(self.head(h), self.cap)
