"""What inductor's CUDA-graph trees would decide about a compiled graph, read on any device.

:class:`CaptureCheck` is a Dynamo backend callable (pass it as trimpass's ``inner``, or on its
own as the untrimmed baseline). It runs AOT autograd as inductor would and records, per graph,
what ``cudagraph_trees`` reads from AOT's metadata: the static input indices (copied into the
graph's pool on every replay when missing), the mutated inputs that are not static (a skip), the
positions of the parameters Dynamo lifted into placeholders, and the tensors on another device
than the graph's weights (a CPU tensor is a skip). The graph then runs eagerly, so the check is
as cheap as ``aot_eager`` and needs no GPU.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx


@dataclass
class GraphInputs:
    """One graph's inputs as AOT autograd hands them to the inner compiler."""
    registered: list[int]  # the graph module's own parameters and buffers (lifted first)
    parameters: list[int]  # placeholders Dynamo marked static (the module's parameters)
    static: list[int] = field(default_factory=list)
    mutated: list[int] = field(default_factory=list)
    devices: set = field(default_factory=set)
    scalars: list[int] = field(default_factory=list)  # 0-d inputs that are not static
    graph: fx.GraphModule | None = None

    @property
    def nonstatic_parameters(self) -> list[int]:
        return sorted(set(self.parameters) - set(self.static))

    @property
    def nonstatic_mutated(self) -> list[int]:
        return sorted(set(self.mutated) - set(self.static))

    def problems(self) -> list[str]:
        """Why CUDA-graph trees would copy weights or skip this graph (empty when neither)."""
        out = []
        if self.nonstatic_parameters:
            out.append(f"{len(self.nonstatic_parameters)} of {len(self.parameters)} parameter "
                       "inputs are not static (copied on every replay)")
        if self.nonstatic_mutated:
            out.append(f"mutated inputs that are not static: {self.nonstatic_mutated}")
        if self.scalars:
            out.append(f"0-d inputs that are not static buffers (built per call from a Python "
                       f"number, or a view): {self.scalars}")
        if len(self.devices) > 1:
            out.append(f"tensors on several devices: {sorted(map(str, self.devices))}")
        return out


def _lifted_count(gm: fx.GraphModule) -> int:
    return (len(dict(gm.named_parameters(remove_duplicate=False)))
            + len(dict(gm.named_buffers(remove_duplicate=False))))


def _static_placeholders(gm: fx.GraphModule, offset: int) -> list[int]:
    return [offset + i for i, n in enumerate(gm.graph.find_nodes(op="placeholder"))
            if n.meta.get("tensor_dict", {}).get("_dynamo_static_input_type")]


def _devices(gm: fx.GraphModule) -> set:
    out = set()
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            out.add(v.device)
    return out


class CaptureCheck:
    """A Dynamo backend that records a :class:`GraphInputs` per compiled graph."""

    def __init__(self):
        self.graphs: list[GraphInputs] = []

    def __call__(self, gm: fx.GraphModule, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        n = _lifted_count(gm)
        rec = GraphInputs(list(range(n)), _static_placeholders(gm, n), graph=gm)
        self.graphs.append(rec)

        def forward_compiler(fw: fx.GraphModule, inputs):
            meta = torch._guards.TracingContext.get().fw_metadata
            rec.static = list(meta.static_input_indices)
            rec.mutated = list(meta.mutated_inp_runtime_indices)
            rec.devices = _devices(fw)
            rec.scalars = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)
                           and x.dim() == 0 and i not in rec.static]
            return make_boxed_func(fw.forward)

        return aot_autograd(fw_compiler=forward_compiler)(gm, example_inputs)

    def problems(self) -> list[str]:
        """Every graph's :meth:`GraphInputs.problems`, prefixed by the graph's number."""
        return [f"graph {i}: {p}" for i, g in enumerate(self.graphs) for p in g.problems()]
