"""One pass of a Hugging Face causal LM's body over new ids at its cache's position, compiled: the
fused loop's step. The positions are read from the cache's position tensor on the device
(:class:`~trimpass.hf.buckets.LoopCache`), never passed from the host; a position past the
model's last (a padding row's) is clamped for the position embeddings alone. It returns every row's
hidden state, the last row's and, with a head, that row's logits (the graph trimpass trims),
softcapped where the config says so. :meth:`Step.tree` is a pass over a draft tree's rows: each row
at the position of its depth, seeing the cache's text and its own ancestors (its masks built on the
device from the position tensor, one per layer type where the model has sliding-window layers)."""
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
        cfg = model.config.get_text_config(decoder=True)
        sliding = "sliding_attention" in (getattr(cfg, "layer_types", None) or ())
        self.window = int(cfg.sliding_window) if sliding else None
        own_code(self, Step.step, "forward")  # each step compiles its own (prefill, decode)
        own_code(self, Step.tree, "tree")

    def step(self, ids, cache):
        n = ids.shape[1]
        positions = (cache.pos + torch.arange(n, device=ids.device)).clamp(max=self.last)
        hs = self.body(input_ids=ids, position_ids=positions.unsqueeze(0), past_key_values=cache,
                       use_cache=True).last_hidden_state[0]
        h = hs[n - 1:]
        if self.head is None:
            return hs, h, None
        return hs, h, softcap(self.head(h), self.cap)

    def tree(self, ids, cache, depth, anc):
        """Every row's hidden state [R, d] of a pass over a tree's rows ``ids`` [1, R] written at
        ``pos + arange(R)``: row i at position ``pos + depth[i]``, seeing the keys before ``pos``
        and the rows ``anc[i]`` marks (its ancestors and itself; [R, R], nonzero: marked)."""
        R, pos, anc = ids.shape[1], cache.pos, anc != 0
        positions = (pos + depth).clamp(max=self.last)
        keys = torch.arange(cache.layers[0].keys.shape[2], device=ids.device)
        rel = keys - pos
        mine = anc.gather(1, rel.clamp(0, R - 1).expand(R, -1)) & (rel < R)
        seen = (rel < 0) | mine
        mask = seen[None, None]
        if self.window is not None:  # the model takes one mask per layer type
            near = keys[None, :] > positions[:, None] - self.window
            mask = {"full_attention": mask, "sliding_attention": (seen & near)[None, None]}
        return self.body(input_ids=ids, position_ids=positions.unsqueeze(0), attention_mask=mask,
                         past_key_values=cache, use_cache=True).last_hidden_state[0]
