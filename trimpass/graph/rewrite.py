"""The pass: a pure ``GraphModule -> GraphModule`` function that splices the trimmed-head ops in.

The input graph is copied, never edited. Each matched head becomes ``head_compact`` over the
active ids; its epilogue (temperature, soft-capping, casts, leading-axis indexing, softmax) then
runs on the compact logits, and only at the exits does a V-sized tensor appear again:
``scatter_full`` into the graph's output (``-inf`` for logits and log-probabilities, 0 for
probabilities), or ``argmax`` / ``topk`` over the compact logits with positions mapped back to
full-vocabulary ids. Slots past the device-side count are masked before any reduction, so an
inactive id never wins and never becomes finite. A head whose logits go straight to the output
uses the fused ``head_full`` kernel. The ids come from an :class:`~trimpass.graph.index.Index`
provider (a static list, or the dynamic state's ops).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from trimpass import ops
from trimpass.config import TrimpassError
from trimpass.graph.index import Index, StaticIndex
from trimpass.graph.match import (
    ARGMAX,
    CASTS,
    SOFTMAX,
    STACK,
    Match,
    find_heads,
    node_target,
    tensor_of,
)

NEG_INF = float("-inf")
KEEPS_INF = CASTS | STACK | {operator.getitem}  # ops under which a -inf slot stays -inf


@dataclass
class Report:
    """What the pass did to one graph."""
    vocab_size: int | None = None
    rewritten: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    note: str = ""

    def __str__(self) -> str:
        lines = [f"vocabulary size: {self.vocab_size}"]
        lines += [f"  rewritten: {n}" for n in self.rewritten]
        lines += [f"  skipped:   {n}: {why}" for n, why in self.skipped]
        if self.note:
            lines.append(f"  note: {self.note}")
        return "\n".join(lines)


def _argmax_ids(values: torch.Tensor, idx: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    return ops.map_ids(values.argmax(-1, keepdim=keepdim), idx)


def _topk_ids(values: torch.Tensor, idx: torch.Tensor, k: int, sorted: bool = True):
    v, pos = values.topk(k, -1, True, sorted)
    return v, ops.map_ids(pos, idx)


SOURCES = "_param_name_to_source"  # what AOT autograd requires of a graph it treats as Dynamo's
DYNAMO_ATTRS = (SOURCES, "_source_to_user_stacks")


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule over a copy of ``gm``'s graph (node metadata shared, ``gm`` untouched).

    A graph from Dynamo keeps what AOT autograd reads to tell it from an exported one: the
    parameter-to-source map and each placeholder's ``_dynamo_source``. Without them AOT autograd
    marks only registered buffers static, so CUDA-graph trees re-record or copy every weight."""
    graph = fx.Graph()
    val_map: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, val_map)
    graph.output(out)
    new = fx.GraphModule(gm, graph)
    new.meta.update(getattr(gm, "meta", {}))
    if "dynamo_compile_id" not in new.meta:
        return new
    missing = [] if hasattr(gm, SOURCES) else [SOURCES]
    missing += [n.name for n in gm.graph.find_nodes(op="placeholder")
                if not hasattr(n, "_dynamo_source")]
    if missing:
        raise TrimpassError(
            f"gm: a Dynamo graph without {', '.join(missing)}; trimpass needs Dynamo's metadata "
            "to keep weights static under CUDA graphs. Pass the graph Dynamo gave the backend, "
            "or copy these attributes onto a graph you changed before trimpass sees it")
    for a in DYNAMO_ATTRS:
        if hasattr(gm, a):
            setattr(new, a, dict(getattr(gm, a)))
    for old in gm.graph.find_nodes(op="placeholder"):
        val_map[old]._dynamo_source = old._dynamo_source
    return new


def _ref_node(graph: fx.Graph, ref, before: fx.Node):
    if isinstance(ref, str):  # a parameter of a call_module Linear
        with graph.inserting_before(before):
            return graph.get_attr(ref)
    return ref


def _erase_if_dead(graph: fx.Graph, nodes) -> None:
    for n in nodes:
        if isinstance(n, fx.Node) and n.op in ("call_function", "call_method") and not n.users:
            graph.erase_node(n)


def _replace_heads(gm: fx.GraphModule, m: Match, index: Index, idx, count, output: str,
                   kinds: dict) -> dict:
    """Step 1: each head becomes ``head_full`` (its logits go straight out) or ``head_compact``;
    return the compact logits nodes, whose slots past the count are already -inf."""
    graph = gm.graph
    out_node = next(n for n in graph.nodes if n.op == "output")
    clean = {}
    for h in m.heads:
        w = _ref_node(graph, h.weight, h.node)
        if h.stored_t:
            with graph.inserting_before(h.node):
                w = graph.call_function(torch.t, (w,))
        b = _ref_node(graph, h.bias, h.node)
        index.before_head(graph, h, w, b)
        direct = output == "full" and set(h.node.users) == {out_node}
        op = ops.head_full.default if direct else ops.head_compact.default
        with graph.inserting_before(h.node):
            new = (direct and index.full_head(gm, h.node, h.x, w, b, idx, count)) or \
                graph.call_function(op, (h.x, w, b, idx, count))
        new.meta.update({k: v for k, v in h.node.meta.items() if k not in ("val", "example_value")})
        old_args = list(h.node.args)
        h.node.replace_all_uses_with(new)
        graph.erase_node(h.node)
        _erase_if_dead(graph, old_args)
        if not direct:
            kinds[new] = "logit"
            clean[new] = True
    return clean


def _mask_before_softmax(graph: fx.Graph, m: Match, idx, count, kinds: dict, clean: dict) -> None:
    """Step 2: follow which epilogue values still hold -inf past the count; mask before any
    softmax whose input might not."""
    for n in m.chain:
        if n in clean or n.graph is not graph:
            continue
        if node_target(n) in SOFTMAX:
            src = n.args[0]
            if not clean.get(src):
                with graph.inserting_before(n):
                    masked = graph.call_function(ops.mask_inactive.default,
                                                 (src, idx, count, NEG_INF))
                n.replace_input_with(src, masked)
            clean[n] = True
        else:
            clean[n] = node_target(n) in KEEPS_INF and all(
                clean.get(a) for a in n.all_input_nodes if a in kinds)


def _rewrite_sinks(graph: fx.Graph, m: Match, idx, count, clean: dict) -> None:
    """Step 3: ``argmax`` / ``topk`` over compact values, positions mapped back to vocab ids."""
    for s in m.sinks:
        src = s.args[0]
        with graph.inserting_before(s):
            if not clean.get(src):
                src = graph.call_function(ops.mask_inactive.default, (src, idx, count, NEG_INF))
            if node_target(s) in ARGMAX:
                keepdim = s.kwargs.get("keepdim", s.args[2] if len(s.args) > 2 else False)
                new = graph.call_function(_argmax_ids, (src, idx, keepdim))
            else:
                k = s.args[1] if len(s.args) > 1 else s.kwargs["k"]
                sorted_ = s.kwargs.get("sorted", s.args[4] if len(s.args) > 4 else True)
                new = graph.call_function(_topk_ids, (src, idx, k, sorted_))
        s.replace_all_uses_with(new)
        graph.erase_node(s)


def _rewrite_exits(graph: fx.Graph, V: int, idx, count, output: str, kinds: dict) -> None:
    """Step 4: compact values leaving the graph become V-sized again (``output="full"``) or are
    masked past the count (``"compact"``)."""
    out_node = next(n for n in graph.nodes if n.op == "output")

    def exit_value(a):
        if not isinstance(a, fx.Node) or a not in kinds or a.graph is not graph:
            return a
        fill = 0.0 if kinds[a] == "prob" else NEG_INF
        with graph.inserting_before(out_node):
            if output == "full":
                return graph.call_function(ops.scatter_full.default, (a, idx, count, V, fill))
            return graph.call_function(ops.mask_inactive.default, (a, idx, count, fill))

    out_node.args = fx.node.map_aggregate(out_node.args, exit_value)


def check_heads(gm: fx.GraphModule, m: Match, example_inputs=None) -> torch.Tensor:
    """Refuse, before anything is rewritten, a head the op could only serve by copying its weight
    on every call; return the first head's weight (as the op receives it, ``[V, d]``)."""
    first = None
    for h in m.heads:
        w = tensor_of(h.weight, gm, example_inputs)
        if not isinstance(w, torch.Tensor):
            continue
        w = w.T if h.stored_t else w
        x = tensor_of(h.x, gm, example_inputs)
        first = w if first is None else first
        if not w.is_contiguous():
            raise TrimpassError(
                f"weight: head {h.name}'s weight [V, d] = {tuple(w.shape)} is not contiguous "
                f"(strides {w.stride()}), so the trimmed op would copy it on every call; make it "
                "contiguous once at setup, e.g. head.weight.data = head.weight.data.contiguous()")
        if isinstance(x, torch.Tensor) and (x.device != w.device or x.dtype != w.dtype):
            raise TrimpassError(
                f"weight: head {h.name}'s weight is {w.dtype} on {w.device} but its input is "
                f"{x.dtype} on {x.device}; move or cast the weight once at setup "
                "(model.to(device, dtype)) rather than in the step")
    return first


def check_ids(gm: fx.GraphModule, idx: fx.Node, count: fx.Node) -> None:
    """Refuse an id provider whose buffers the op cannot read as they are."""
    for name, node in (("idx", idx), ("count", count)):
        t = tensor_of(node, gm) if node.op == "get_attr" else None
        if isinstance(t, torch.Tensor) and t.dtype not in (torch.int32, torch.int64):
            raise TrimpassError(f"{name}: the active-id buffer {node.target} is {t.dtype}; "
                                "token ids and counts must be int32 or int64")


def apply(gm: fx.GraphModule, m: Match, index: Index, output: str = "full",
          example_inputs=None) -> None:
    """Rewrite ``gm`` in place along match ``m``, step by step."""
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    w = check_heads(gm, m, example_inputs)
    idx, count = index.nodes(gm, first, m, w.device)
    check_ids(gm, idx, count)
    kinds = dict(m.kinds)
    clean = _replace_heads(gm, m, index, idx, count, output, kinds)
    _mask_before_softmax(gm.graph, m, idx, count, kinds, clean)
    _rewrite_sinks(gm.graph, m, idx, count, clean)
    _rewrite_exits(gm.graph, m.vocab_size, idx, count, output, kinds)
    gm.graph.lint()
    gm.recompile()


def rewrite(gm: fx.GraphModule, config, example_inputs=None, index=None) -> fx.GraphModule:
    """Return a rewritten copy of ``gm`` (or ``gm`` itself when nothing matched) with a ``Report``
    in ``result.meta["trimpass"]``. Never changes the result of a graph it does not rewrite."""
    new = copy_graph_module(gm)
    m = find_heads(new, example_inputs, config.vocab_size)
    report = Report(m.vocab_size, skipped=list(m.skipped))
    index = index or StaticIndex(config.settings)
    if not m.heads:
        report.note = ("no LM head found: a [V, d] projection whose output reaches the graph's "
                       "output" if not m.skipped else "every candidate head was skipped")
        if m.embeddings and index.admit_only(new, m):  # a piece without the head still admits
            report.note += "; " + index.note
            new.meta["trimpass"] = report
            return new
        gm.meta["trimpass"] = report
        return gm
    apply(new, m, index, config.output, example_inputs)
    report.rewritten = [h.name for h in m.heads]
    report.note = index.note
    new.meta["trimpass"] = report
    return new
