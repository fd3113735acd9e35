"""Splices the dynamic mode's state into a graph: ``admit`` at each token-id lookup, and the state's
``idx``/``count`` buffers as the head's active ids.

The state's tensors are registered as buffers of every rewritten graph of one drafter (the same
tensor objects), so prefill, decode, recompiles and the pieces around a graph break all read and
update one state. A graph input named like a position (``position_ids``, ``cache_position``,
``input_pos``) is passed to ``admit``, which resets a row whose positions start at 0.
"""
from __future__ import annotations

import re

import torch
import torch.fx as fx

from trimpass.graph.match import Match, value

POSITION = re.compile(r"(cache_position|position_ids|input_pos|positions?)", re.IGNORECASE)
_BUFFERS = ("idx", "stamp", "count", "clock")
LEARN_EVERY = 32  # calls between re-rankings of the learned core: a top-k over V each time


def _position_input(gm: fx.GraphModule):
    for n in gm.graph.nodes:
        v = value(n)
        if (n.op == "placeholder" and POSITION.search(n.name) and isinstance(v, torch.Tensor)
                and not v.is_floating_point() and v.dim() >= 1):
            return n
    return None


class DynamicIndex:
    """The (idx, count) provider of the dynamic mode, backed by an :class:`ActiveState`."""

    def __init__(self, state):
        self.state = state
        self.note = ""

    def _batch(self, m: Match) -> int:
        for _, ids in m.embeddings:
            v = value(ids)
            if isinstance(v, torch.Tensor) and v.dim() >= 1:
                return int(v.shape[0]) if v.dim() >= 2 else 1
        for h in m.heads:
            v = value(h.x)
            if isinstance(v, torch.Tensor):
                return int(v.shape[0]) if v.dim() >= 3 else 1
        return 1

    def admit_only(self, gm: fx.GraphModule, m: Match) -> None:
        """A graph piece with token lookups but no head: admit there all the same."""
        before = next(n for n in gm.graph.nodes if n.op != "placeholder")
        v = value(m.embeddings[0][1])
        self.nodes(gm, before, m, v.device if isinstance(v, torch.Tensor) else "cpu")
        gm.graph.lint()
        gm.recompile()

    def nodes(self, gm: fx.GraphModule, before: fx.Node, m: Match, device):
        graph = gm.graph
        B = self._batch(m)
        buf = self.state.buffers(B, m.vocab_size, device)
        got = {}
        shared = dict(learned=self.state.learned)
        with graph.inserting_before(before):
            for name, t in [(n, buf[n]) for n in _BUFFERS] + list(shared.items()):
                gm.register_buffer(f"_trimpass_{name}", t)
                got[name] = graph.get_attr(f"_trimpass_{name}")
        learning, cfg = self.state.learned.numel() > 0, self.state.config
        pos = _position_input(gm)
        for lookup, ids in m.embeddings:
            v = value(ids)
            if isinstance(v, torch.Tensor) and v.dim() >= 2 and int(v.shape[0]) != B:
                continue  # another batch size than the head's: not this state's rows
            with graph.inserting_before(lookup):
                graph.call_function(torch.ops.trimpass.admit.default, tuple(
                    got[n] for n in _BUFFERS) + (ids, pos, buf["n_core"], got["learned"],
                                                 self.state.serial, cfg.successors))
                if learning:
                    graph.call_function(torch.ops.trimpass.learn.default, (
                        got["learned"], ids, LEARN_EVERY, self.state.serial))
        self.note = (f"dynamic vocabulary: batch {B}, capacity {self.state.config.capacity}, "
                     f"learned core {self.state.learned.numel()}, successors {cfg.successors}, "
                     f"admits at {len(m.embeddings)} token lookup(s); " +
                     (f"resets when {pos.name} starts at 0" if pos is not None else
                      "no position input found: call trimpass.reset(draft) between requests"))
        self.got, self.n_core = got, buf["n_core"]
        return got["idx"], got["count"]

    def before_head(self, graph: fx.Graph, head, weight, bias) -> None:
        """Insert the periodic full-vocabulary refresh before a rewritten head."""
        cfg = self.state.config
        if cfg.refresh_every <= 0:
            return
        with graph.inserting_before(head.node):
            graph.call_function(torch.ops.trimpass.refresh.default, (
                head.x, weight, bias, *(self.got[n] for n in _BUFFERS), self.n_core,
                cfg.refresh_every, min(cfg.refresh_topk, cfg.capacity - self.n_core),
                self.state.serial))
