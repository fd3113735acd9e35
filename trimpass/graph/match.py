"""Find LM heads in an FX graph by structure: a projection onto the vocabulary reaching the output.

A head is ``F.linear`` / ``nn.Linear`` / ``matmul`` / ``mm`` / ``addmm`` / ``@`` whose weight is a
graph input or attribute of shape ``[V, d]`` (used directly, or transposed for the matmul forms),
where V is the vocabulary size: the largest embedding table's row count when the graph looks tokens
up, else the configured size, else the largest such projection. Its logits may flow through an
epilogue trimpass can compute on a subset of columns — element-wise ops with scalars or operands
constant along the vocabulary axis (temperature, soft-capping, casts), indexing of leading axes,
stacking of several heads — into the graph's output or into ``argmax`` / ``topk`` / ``softmax`` /
``log_softmax`` over the last axis. Anything else feeding on the logits disqualifies the head,
with the reason recorded. Module names are never consulted.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn.functional as F

LINEAR_FNS = {F.linear, torch._C._nn.linear}
MATMUL_FNS = {operator.matmul, torch.matmul, torch.mm}
MATMUL_METHODS = {"matmul", "mm", "__matmul__"}
EMBEDDING_FNS = {F.embedding, torch.embedding}
POINTWISE_FNS = {operator.mul, operator.truediv, operator.add, operator.sub, operator.neg,
                 torch.mul, torch.div, torch.true_divide, torch.add, torch.sub, torch.neg,
                 torch.tanh, torch.clamp}
POINTWISE_METHODS = {"mul", "div", "true_divide", "add", "sub", "neg", "tanh", "float", "half",
                     "bfloat16", "double", "to", "type_as", "contiguous", "clone", "clamp",
                     "__mul__", "__truediv__", "__add__", "__sub__"}
MIN_INFERRED_V = 256  # a projection narrower than this (or than 2*d) is not taken for a vocabulary
CASTS = {"float", "half", "bfloat16", "double", "to", "type_as", "contiguous", "clone"}
SOFTMAX = {F.softmax: "prob", torch.softmax: "prob", F.log_softmax: "logprob",
           torch.log_softmax: "logprob", "softmax": "prob", "log_softmax": "logprob"}
ARGMAX = {torch.argmax, "argmax"}
TOPK = {torch.topk, "topk"}
STACK = {torch.stack, torch.cat}


def value(node) -> object:
    """The example value Dynamo (or the caller) recorded for a node, if any."""
    if not isinstance(node, fx.Node):
        return node
    for key in ("example_value", "val"):
        if key in node.meta:
            return node.meta[key]
    return None


def _shape(node):
    v = value(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def node_target(node: fx.Node):
    """A call node's function or method name; None for any other node."""
    return node.target if node.op == "call_function" else (
        node.target if node.op == "call_method" else None)


@dataclass
class Head:
    node: fx.Node  # produces the logits [..., V]
    x: fx.Node  # the head's input activations [..., d]
    weight: fx.Node | str  # a [V, d] graph input / attribute, or "module.weight" for call_module
    bias: fx.Node | str | None
    name: str = ""
    stored_t: bool = False  # the graph holds W as a transposed [d, V] view (e.g. a folded W.T)


@dataclass
class Match:
    vocab_size: int | None
    heads: list[Head] = field(default_factory=list)
    chain: list[fx.Node] = field(default_factory=list)  # epilogue nodes, topological order
    kinds: dict = field(default_factory=dict)  # node -> "logit" | "prob" | "logprob"
    sinks: list[fx.Node] = field(default_factory=list)  # argmax / topk nodes
    embeddings: list[tuple] = field(default_factory=list)  # (lookup node, its token-ids node)
    skipped: list[tuple[str, str]] = field(default_factory=list)


def _is_param(node, gm: fx.GraphModule) -> bool:
    return isinstance(node, fx.Node) and node.op in ("placeholder", "get_attr")


def _transposed_source(node) -> fx.Node | None:
    """If ``node`` is ``W.T`` / ``W.t()`` / ``W.transpose(0, 1)`` / ``W.permute(1, 0)``, return
    W."""
    if not isinstance(node, fx.Node):
        return None
    t, a = node_target(node), node.args
    if t is getattr and len(a) == 2 and a[1] in ("T", "mT"):
        return a[0]
    if t in ("t", torch.t) and len(a) == 1:
        return a[0]
    if t in ("transpose", torch.transpose) and len(a) == 3 and {a[1], a[2]} in ({0, 1}, {-1, -2},
                                                                                {0, -1}, {1, -2}):
        return a[0]
    if t in ("permute", torch.permute):
        dims = a[1:] if len(a) == 3 else (a[1] if len(a) == 2 else None)
        if tuple(dims or ()) in ((1, 0), (-1, -2)):
            return a[0]
    return None


DEQUANT_FNS = {operator.mul, operator.sub, operator.truediv, torch.mul, torch.sub, torch.div}
DEQUANT_METHODS = {"float", "half", "bfloat16", "to", "type_as", "mul", "sub", "div",
                   "__mul__", "__sub__", "__truediv__"}


def _dequantized_source(node, gm, example_inputs) -> fx.Node | None:
    """If ``node`` dequantizes an integer weight inside the graph (casts and scale / zero-point
    arithmetic, e.g. ``wq.float() * scale``), return that integer weight's node, else None."""
    if _is_param(node, gm):
        w = tensor_of(node, gm, example_inputs)
        return node if isinstance(w, torch.Tensor) and not w.is_floating_point() else None
    if not isinstance(node, fx.Node) or not (
            node.target in DEQUANT_FNS if node.op == "call_function"
            else node_target(node) in DEQUANT_METHODS):
        return None
    return next((q for a in node.args if (q := _dequantized_source(a, gm, example_inputs))),
                None)


def linear_like(node: fx.Node, gm: fx.GraphModule, example_inputs=None) -> Head | None:
    """The (x, weight, bias) of a projection node, or None when it is not one."""
    t, a = node_target(node), node.args
    kw = node.kwargs
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        if isinstance(mod, torch.nn.Linear) and a:
            return Head(node, a[0], f"{node.target}.weight",
                        None if mod.bias is None else f"{node.target}.bias")
        return None
    if t in LINEAR_FNS and a:
        w = a[1] if len(a) > 1 else kw.get("weight")
        b = a[2] if len(a) > 2 else kw.get("bias")
        w = w if _is_param(w, gm) else _dequantized_source(w, gm, example_inputs)
        return Head(node, a[0], w, b) if _is_param(w, gm) else None
    if (t in MATMUL_FNS or t in MATMUL_METHODS) and len(a) == 2:
        w = _transposed_source(a[1])
        w = w if w is None or _is_param(w, gm) else _dequantized_source(w, gm, example_inputs)
        if _is_param(w, gm):
            return Head(node, a[0], w, None)
        wt = tensor_of(a[1], gm, example_inputs) if _is_param(a[1], gm) else None
        if isinstance(wt, torch.Tensor) and wt.dim() == 2 and wt.T.is_contiguous():
            return Head(node, a[0], a[1], None, stored_t=True)  # a constant already transposed
        return None
    if t in (torch.addmm, "addmm") and len(a) == 3:
        w = _transposed_source(a[2])
        return Head(node, a[1], w, a[0]) if _is_param(w, gm) else None
    return None


def tensor_of(ref, gm: fx.GraphModule, example_inputs=None):
    """The tensor (real or fake) behind a weight reference: placeholder, get_attr or module path."""
    if isinstance(ref, str):
        return gm.get_parameter(ref) if ref else None
    if ref is None:
        return None
    if ref.op == "get_attr":
        obj = gm
        for part in ref.target.split("."):
            obj = getattr(obj, part)
        return obj
    if ref.op == "placeholder" and example_inputs is not None:
        pos = [n for n in gm.graph.nodes if n.op == "placeholder"].index(ref)
        if pos < len(example_inputs) and isinstance(example_inputs[pos], torch.Tensor):
            return example_inputs[pos]
    return value(ref)


def _embeddings(gm, example_inputs) -> list[tuple[fx.Node, object]]:
    found = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in EMBEDDING_FNS and len(n.args) >= 2:
            ids, table = (n.args[0], n.args[1]) if n.target is F.embedding else (n.args[1],
                                                                                  n.args[0])
            found.append((n, ids, tensor_of(table, gm, example_inputs)))
        elif n.op == "call_module" and isinstance(gm.get_submodule(n.target), torch.nn.Embedding):
            found.append((n, n.args[0], gm.get_submodule(n.target).weight))
    return found


def _reaches_output(gm) -> set:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    seen, stack = set(), [out]
    while stack:
        n = stack.pop()
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                stack.append(a)
    return seen


def _last_dim_ok(n: fx.Node, dim) -> bool:
    shape = _shape(n)
    return dim == -1 or (shape is not None and dim == len(shape) - 1)


def _other_operand_ok(arg, chain: set) -> bool:
    """An operand beside the logits must be constant along the vocabulary axis."""
    if not isinstance(arg, fx.Node) or arg in chain:
        return True
    shape = _shape(arg)
    return shape is not None and (len(shape) == 0 or shape[-1] == 1)


def _classify(user: fx.Node, src: fx.Node, chain: set, kinds: dict) -> tuple[str, str | None]:
    """How an epilogue user of logits node ``src`` is handled: ("chain"|"sink"|"output", reason)."""
    t = node_target(user)
    kind = kinds[src]
    if user.op == "output":
        return "output", None
    if t in SOFTMAX:
        dim = user.args[1] if len(user.args) > 1 else user.kwargs.get("dim")
        if kind != "logit" or not _last_dim_ok(user, dim):
            return "", "softmax not over the last axis, or applied twice"
        return "chain", None
    if t in ARGMAX or t in TOPK:
        pos = 2 if t in TOPK else 1
        dim = user.kwargs.get("dim", user.args[pos] if len(user.args) > pos else
                              (-1 if t in TOPK else None))
        if dim is None or not _last_dim_ok(src, dim) or user.kwargs.get("largest", True) is False:
            return "", "argmax/topk not over the last axis (or smallest-k)"
        return "sink", None
    if kind != "logit" and t not in CASTS:
        return "", "element-wise op after softmax (inactive ids would not stay 0)"
    if t in POINTWISE_FNS or t in POINTWISE_METHODS:
        if all(_other_operand_ok(a, chain) for a in user.args[1:]):
            return "chain", None
        return "", f"{user.name} mixes the logits with a tensor that varies along the vocabulary"
    if t is operator.getitem:
        idx = user.args[1]
        idx = idx if isinstance(idx, tuple) else (idx,)
        shape = _shape(src)
        if (Ellipsis not in idx and None not in idx and shape is not None
                and (len(idx) < len(shape) or idx[-1] == slice(None))
                and all(not isinstance(i, fx.Node) for i in idx)):
            return "chain", None
        return "", f"{user.name} indexes the vocabulary axis"
    if t in STACK:
        dim = user.args[1] if len(user.args) > 1 else user.kwargs.get("dim", 0)
        if all(a in chain for a in user.args[0]) and not _last_dim_ok(user, dim):
            return "chain", None
        return "", f"{user.name} joins logits with other tensors or along the vocabulary"
    what = t if isinstance(t, str) else getattr(t, "__name__", t)
    return "", f"the logits feed {user.name} ({what})"


def find_heads(gm: fx.GraphModule, example_inputs=None, vocab_size: int | None = None) -> Match:
    """Locate every rewritable LM head of ``gm`` with its epilogue; record why others were
    skipped."""
    embeds = _embeddings(gm, example_inputs)
    tables = [t for _, _, t in embeds if isinstance(t, torch.Tensor) and t.dim() == 2]
    V = max((t.shape[0] for t in tables), default=None) or vocab_size
    cands = []
    for n in gm.graph.nodes:
        h = linear_like(n, gm, example_inputs) if n.op in ("call_function", "call_method",
                                                            "call_module") else None
        w = tensor_of(h.weight, gm, example_inputs) if h else None
        w = w.T if h and h.stored_t and isinstance(w, torch.Tensor) else w
        if h and isinstance(w, torch.Tensor) and w.dim() == 2:
            cands.append((h, w))
    if V is None and cands:  # no lookup, no configured size: the widest vocabulary-like projection
        wide = [w for _, w in cands if w.shape[0] >= max(MIN_INFERRED_V, 2 * w.shape[1])]
        V = max((w.shape[0] for w in wide), default=None)
    m = Match(V)
    m.embeddings = [(n, ids) for n, ids, t in embeds
                    if isinstance(t, torch.Tensor) and t.shape[0] == V and isinstance(ids, fx.Node)]
    live = _reaches_output(gm)
    heads = []
    for h, w in cands:
        h.name = h.node.name
        if w.shape[0] != V:
            continue
        if h.node not in live:
            m.skipped.append((h.name, "its output does not reach the graph's output"))
        elif not w.is_floating_point():
            m.skipped.append((h.name, f"quantized head (weight dtype {w.dtype}): left unchanged"))
        elif torch.is_grad_enabled() and w.requires_grad:
            m.skipped.append((h.name, "the graph needs gradients (grad mode on and the head "
                                      "weight requires grad): left unchanged"))
        else:
            heads.append(h)
    while heads:  # grow the epilogue from all heads together; drop heads that reach a bad user
        chain = {h.node for h in heads}
        kinds = {h.node: "logit" for h in heads}
        order, sinks, bad = [], [], None
        for n in gm.graph.nodes:  # topological: every input is classified before its user
            srcs = [a for a in n.all_input_nodes if a in chain]
            if n in chain:
                order.append(n)
                continue
            if not srcs:
                continue
            how, reason = _classify(n, srcs[0], chain, kinds)
            if how == "chain":
                chain.add(n)
                order.append(n)
                kinds[n] = SOFTMAX.get(node_target(n), kinds[srcs[0]])
            elif how == "sink":
                sinks.append(n)
            elif how != "output":
                bad = (srcs[0], reason)
                break
        if bad is None:
            m.heads, m.chain, m.kinds, m.sinks = heads, order, kinds, sinks
            break
        culprits = [h for h in heads if _feeds(h.node, bad[0])]
        for h in culprits:
            m.skipped.append((h.name, bad[1]))
        heads = [h for h in heads if h not in culprits]
    return m


def _feeds(src: fx.Node, dst: fx.Node) -> bool:
    seen, stack = set(), [src]
    while stack:
        n = stack.pop()
        if n is dst:
            return True
        for u in n.users:
            if u not in seen:
                seen.add(u)
                stack.append(u)
    return False
