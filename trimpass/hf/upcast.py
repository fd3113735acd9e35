"""Products over several rows, where the CPU has no half-precision GEMM.

On a CPU without AVX-512 (this project's AMD EPYC VM: AVX2 only), torch multiplies bf16 or fp16
matrices in a naive loop whose cost grows with every row: Gemma-3-270M's head (262,144 x 640,
bf16) took 68 ms for one row, 541 ms for 8 and 1,090 ms for 16, where fp32 runs a real GEMM; its
body over 16 rows 371-467 ms against 64-100 ms for one. The fused loop runs several rows at a
time (a prompt's chunks, a lookup verification, the full head over a round), so there
:class:`Linear` (the full head) and :func:`rewrite_rows` (every linear of a compiled graph over
several rows, as the custom op ``trimpass::upcast_linear``; :class:`RowsBackend` runs it before
the inner compiler) upcast each weight in chunks of ``CHUNK`` rows (a few MB of fp32 that stay in
cache beside the product) and multiply in fp32: 118 ms for the head's 16 rows, 124-141 ms for the
body's. Which way is faster is measured on this machine (:meth:`Linear.calibrate`, :func:`faster`),
never assumed: on a CPU with AMX or AVX-512 BF16 the native product wins and nothing changes;
``TRIMPASS_UPCAST`` forces either way. One row always takes the native product, plain decoding's
own computation. Both ways accumulate in fp32 and round once, so they differ by at most one ulp,
a rounding difference of the kind two products of one row already have; the greedy rule computes
every near-tie row of the head again alone (:func:`trimpass.spec.verify.greedy`).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from trimpass import measure

CHUNK = 2048  # weight rows upcast at a time: 5 MB of fp32 for a 640-wide head
ROWS = 8  # the product timed for the choice: a typical verification
HALF = (torch.bfloat16, torch.float16)


def forced() -> bool | None:
    """``TRIMPASS_UPCAST``: ``0`` never upcasts, ``1`` always does (half-precision CPU weights);
    unset or empty, the measured choice."""
    value = os.environ.get("TRIMPASS_UPCAST", "")
    if value not in ("", "0", "1"):
        raise ValueError(f"TRIMPASS_UPCAST: 0 (never upcast), 1 (always) or unset (measure), "
                         f"got {value!r}")
    return None if value == "" else value == "1"


@torch.no_grad()
def upcast_linear(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  chunk: int = CHUNK) -> torch.Tensor:
    """``F.linear(h, weight, bias)`` computed in fp32, ``chunk`` weight rows at a time, rounded to
    ``h``'s dtype once at the end. Inference only (no gradient)."""
    if chunk < 1:
        raise ValueError(f"chunk: weight rows per upcast, an int >= 1, got {chunk!r}")
    x = h.float()
    out = torch.empty(*h.shape[:-1], weight.shape[0], dtype=torch.float32, device=h.device)
    flat = out.view(-1, weight.shape[0])
    buf = torch.empty(min(chunk, weight.shape[0]), weight.shape[1], dtype=torch.float32,
                      device=weight.device)
    for start in range(0, weight.shape[0], chunk):
        w = buf[:min(chunk, weight.shape[0] - start)].copy_(weight[start:start + chunk])
        torch.mm(x.reshape(-1, x.shape[-1]), w.t(), out=flat[:, start:start + w.shape[0]])
    if bias is not None:
        out += bias.float()
    return out.to(h.dtype)


class Linear:
    """``F.linear`` with ``weight`` and ``bias``, several rows upcast where that is measured
    faster. ``upcast``: None until :meth:`calibrate` (the native product until then), False for
    a weight that is not half precision on a CPU (nothing to measure)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias
        self.upcast = None if weight.device.type == "cpu" and weight.dtype in HALF else False

    def calibrate(self, tries: int = 3) -> bool:
        """Time both products at ``ROWS`` rows (:func:`trimpass.measure.faster`) and keep the
        faster; returns whether several rows are upcast."""
        if self.upcast is not None:
            return self.upcast
        if forced() is not None:
            self.upcast = forced()
            return self.upcast
        h = torch.randn(ROWS, self.weight.shape[1], generator=torch.Generator().manual_seed(0))
        h = h.to(self.weight.dtype)
        self.upcast = measure.faster(lambda: upcast_linear(h, self.weight, self.bias),
                                     lambda: F.linear(h, self.weight, self.bias), tries)
        return self.upcast

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        if self.upcast and h.dim() == 2 and h.shape[0] > 1:
            return upcast_linear(h, self.weight, self.bias)
        return F.linear(h, self.weight, self.bias)


@torch.library.custom_op("trimpass::upcast_linear", mutates_args=())
def _upcast_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return upcast_linear(x, weight, bias)


@_upcast_op.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


_faster: dict[torch.dtype, bool] = {}


def faster(dtype: torch.dtype, size: int = 1024) -> bool:
    """Whether ``ROWS`` rows of a ``size`` x ``size`` product of ``dtype`` run faster upcast on
    this CPU (measured once per process and dtype; False for a dtype that is not half)."""
    if dtype not in HALF:
        return False
    if forced() is not None:
        return forced()
    if dtype not in _faster:
        lin = Linear(torch.randn(size, size, generator=torch.Generator().manual_seed(1)).to(dtype))
        _faster[dtype] = lin.calibrate()
    return _faster[dtype]


def _value(node):
    return node.meta.get("example_value", node.meta.get("val")) if hasattr(node, "meta") else None


def rewrite_rows(gm: torch.fx.GraphModule, head: tuple | None = None
                 ) -> tuple[torch.fx.GraphModule, int]:
    """``gm`` with every linear over more than one row (or a symbolic row count) of a half-precision
    CPU weight computed by ``trimpass::upcast_linear``, where :func:`faster` measured that faster,
    except a weight of shape ``head`` (the LM head: trimpass's pass rewrites it, and must find
    it); returns the graph and how many linears changed (0: the graph itself, unchanged)."""
    todo = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in (torch._C._nn.linear, F.linear):
            continue
        x, w = (_value(a) for a in node.args[:2])
        if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor) \
                or (head is not None and tuple(w.shape) == tuple(head)):
            continue
        rows = x.shape[:-1]
        single = all(isinstance(n, int) for n in rows) and int(torch.Size(rows).numel()) <= 1
        if not single and w.device.type == "cpu" and w.dtype in HALF and faster(w.dtype):
            todo.append(node)
    for node in todo:
        args = list(node.args) + [node.kwargs.get("bias")] * (3 - len(node.args))
        with gm.graph.inserting_after(node):
            new = gm.graph.call_function(torch.ops.trimpass.upcast_linear.default, tuple(args[:3]))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    if todo:
        gm.graph.lint()
        gm.recompile()
    return gm, len(todo)


class RowsBackend:
    """A Dynamo backend: :func:`rewrite_rows` (``head``: the LM head's weight shape, left alone),
    then ``inner``; ``rewritten`` counts the linears changed in every graph it compiled."""

    def __init__(self, inner, head: tuple):
        self.inner, self.head, self.rewritten = inner, tuple(head), 0

    def __call__(self, gm, example_inputs, **kwargs):
        gm, n = rewrite_rows(gm, self.head)
        self.rewritten += n
        return self.inner(gm, example_inputs, **kwargs)
