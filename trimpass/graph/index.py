"""The active-id providers the rewrite asks for ``(idx, count)`` nodes: one interface, two modes.

:class:`Index` is what :func:`trimpass.graph.rewrite.rewrite` calls: ``nodes`` inserts the nodes
that give the head its active ids, ``before_head`` may add work before each rewritten head, and
``admit_only`` handles a graph piece that looks tokens up but has no head, and ``full_head`` may
replace the full-vocabulary head op (the dynamic mode's escape path). :class:`StaticIndex` registers
a fixed id list as buffers of the rewritten module. :class:`DynamicIndex` splices the drafter's
:class:`~trimpass.dynamic.state.ActiveState` in: ``trimpass::admit`` at each token-id lookup (a
graph input named like a position, ``position_ids`` / ``cache_position`` / ``input_pos``, is passed
along so a row whose positions start at 0 starts a new request) and ``trimpass::active`` for the
rows the head reads; only the state's serial and its one-element ordering token enter the graph."""
from __future__ import annotations

import operator
import re

import torch
import torch.fx as fx
from torch._dynamo.source import ConstantSource

from trimpass.graph.match import Match, value

POSITION = re.compile(r"(cache_position|position_ids|input_pos|positions?)", re.IGNORECASE)


def register_static_buffer(gm: fx.GraphModule, name: str, tensor: torch.Tensor) -> None:
    """Register ``tensor`` as buffer ``name`` of ``gm``; on a Dynamo graph also give it a source,
    which AOT autograd requires of every registered buffer before it marks the graph's weights
    static."""
    gm.register_buffer(name, tensor)
    sources = getattr(gm, "_param_name_to_source", None)
    if sources is not None:
        sources[name] = ConstantSource(source_name=f"trimpass:{name}")


class Index:
    """The interface of an active-id provider (the base does nothing beyond ``nodes``)."""

    note = ""

    def nodes(self, gm: fx.GraphModule, before: fx.Node, m: Match, device):
        """Insert and return the ``(idx, count)`` nodes the head ops read."""
        raise NotImplementedError

    def before_head(self, graph: fx.Graph, head, weight, bias) -> None:
        """Work to insert before a rewritten head (none by default)."""

    def full_head(self, gm: fx.GraphModule, at: fx.Node, x, weight, bias, idx, count):
        """A node computing a full-vocabulary head in place of ``head_full``, or None (default)."""
        return None

    def admit_only(self, gm: fx.GraphModule, m: Match) -> bool:
        """A graph piece with token lookups and no head; return True if it was rewritten."""
        return False


class StaticIndex(Index):
    """A fixed vocabulary: ``idx``/``count`` registered as buffers of the rewritten module."""

    def __init__(self, settings):
        self.settings = settings

    def nodes(self, gm, before, m: Match, device):
        idx, count = self.settings.index(m.vocab_size, device)
        register_static_buffer(gm, "_trimpass_idx", idx)
        register_static_buffer(gm, "_trimpass_count", count)
        self.note = f"static vocabulary: {idx.numel()} ids"
        with gm.graph.inserting_before(before):
            return gm.graph.get_attr("_trimpass_idx"), gm.graph.get_attr("_trimpass_count")


def _position_input(gm: fx.GraphModule):
    for n in gm.graph.nodes:
        v = value(n)
        if (n.op == "placeholder" and POSITION.search(n.name) and isinstance(v, torch.Tensor)
                and not v.is_floating_point() and v.dim() >= 1):
            return n
    return None


def _batch(m: Match) -> int:
    for _, ids in m.embeddings:
        v = value(ids)
        if isinstance(v, torch.Tensor) and v.dim() >= 1:
            return int(v.shape[0]) if v.dim() >= 2 else 1
    for h in m.heads:
        v = value(h.x)
        if isinstance(v, torch.Tensor):
            return int(v.shape[0]) if v.dim() >= 3 else 1
    return 1


class DynamicIndex(Index):
    """The dynamic mode's provider, backed by one drafter's :class:`ActiveState`."""

    def __init__(self, state):
        self.state = state

    def _token(self, gm: fx.GraphModule, before: fx.Node) -> fx.Node:
        if not hasattr(gm, "_trimpass_token"):
            register_static_buffer(gm, "_trimpass_token", self.state.token)
        with gm.graph.inserting_before(before):
            return gm.graph.get_attr("_trimpass_token")

    def _admits(self, gm: fx.GraphModule, before: fx.Node, m: Match, device):
        """Insert an admit before each token lookup, each taking the token the one before gave;
        return the batch size and the last token (what ``active`` takes)."""
        B = _batch(m)
        self.state.build(m.vocab_size, device)
        self.state.check_batch(B)
        token, pos = self._token(gm, before), _position_input(gm)
        for lookup, ids in m.embeddings:  # in graph order, as match found them
            v = value(ids)
            if isinstance(v, torch.Tensor) and v.dim() >= 2 and int(v.shape[0]) != B:
                continue  # another batch size than the head's: not these rows
            with gm.graph.inserting_before(lookup):
                token = gm.graph.call_function(torch.ops.trimpass.admit.default,
                                               (token, ids, pos, self.state.serial))
        s = self.state.settings
        self.note = (f"dynamic vocabulary: batch {B}, capacity {s.capacity}, learned core "
                     f"{s.learn_core}, successors {s.successors}, admits at "
                     f"{len(m.embeddings)} token lookup(s); " +
                     (f"a row starts a new request when {pos.name} starts at 0" if pos is not None
                      else "no position input found: call trimpass.reset(draft) between requests"))
        return B, token

    def nodes(self, gm, before, m: Match, device):
        B, token = self._admits(gm, before, m, device)
        heads = {h.node for h in m.heads}
        at = next(n for n in gm.graph.nodes if n in heads)  # after every lookup's admit
        with gm.graph.inserting_before(at):
            got = gm.graph.call_function(torch.ops.trimpass.active.default, (
                token, B, self.state.settings.capacity, self.state.serial))
            return (gm.graph.call_function(operator.getitem, (got, 0)),
                    gm.graph.call_function(operator.getitem, (got, 1)))

    def admit_only(self, gm, m: Match) -> bool:
        before = next(n for n in gm.graph.nodes if n.op != "placeholder")
        v = value(m.embeddings[0][1])
        self._admits(gm, before, m, v.device if isinstance(v, torch.Tensor) else "cpu")
        gm.graph.lint()
        gm.recompile()
        return True

    def full_head(self, gm, at, x, weight, bias, idx, count):
        """With the escape path on, ``head_full_escape``: the head, then the escape path."""
        if self.state.settings.escape is None:
            return None
        w = value(weight)
        if isinstance(w, torch.Tensor) and self.state.proxy is not None:
            self.state.proxy.reserve(int(w.shape[0]), int(w.shape[1]), w.dtype, w.device)
        with gm.graph.inserting_before(at):
            return gm.graph.call_function(torch.ops.trimpass.head_full_escape.default, (
                x, weight, bias, idx, count, self.state.serial))

    def before_head(self, graph: fx.Graph, head, weight, bias) -> None:
        """Insert the periodic full-vocabulary refresh (opt-in) before a rewritten head."""
        if self.state.settings.refresh_every <= 0:
            return
        token = next(n for n in graph.nodes if n.op == "get_attr" and n.target ==
                     "_trimpass_token")
        with graph.inserting_before(head.node):
            graph.call_function(torch.ops.trimpass.refresh.default,
                                (token, head.x, weight, bias, self.state.serial))
