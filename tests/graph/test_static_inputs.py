"""What CUDA-graph trees read from a rewritten graph, checked on CPU: every parameter static, the
op fed the parameter's own storage, no mutated non-static input, no graph break, and Dynamo
metadata the pass cannot keep refused at build time."""
import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import is_fake

import trimpass
from trimpass import ops
from trimpass.config import TrimConfig, TrimpassError
from trimpass.graph.index import StaticIndex
from trimpass.graph.rewrite import rewrite
from trimpass.testing.capture import CaptureCheck
from trimpass.testing.models import EagleDrafter, Transformer

V, D = 1031, 48
MODES = {
    "static": lambda cc: trimpass.backend(vocab=list(range(0, V, 3)), inner=cc),
    "dynamic": lambda cc: trimpass.backend(inner=cc),
}


def _eagle():
    torch.manual_seed(0)
    m = EagleDrafter(V, D).eval()
    return m, (torch.randint(0, V, (1, 7)), torch.randn(1, 7, D))


def _gpt_fast():
    torch.manual_seed(0)
    m = Transformer(V, D, layers=2).eval()
    m.setup_caches(1, 32)
    return m, (torch.randint(0, V, (1, 5)), torch.arange(5))


def _check(model, args, backend_of):
    torch._dynamo.reset()
    cc = CaptureCheck()
    compiled = torch.compile(model, backend=backend_of(cc), fullgraph=True)  # a break raises
    with torch.no_grad():
        out = compiled(*args)
    return cc, out


@pytest.mark.parametrize("make", [_eagle, _gpt_fast], ids=["eagle", "gpt-fast"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_parameter_stays_static(make, mode):
    model, args = make()
    plain, _ = _check(model, args, lambda cc: cc)
    trimmed, _ = _check(model, args, MODES[mode])
    assert len(trimmed.graphs) == 1 and trimmed.graphs[0].graph.meta["trimpass"].rewritten
    base, g = plain.graphs[0], trimmed.graphs[0]
    assert base.nonstatic_parameters == [] and base.parameters
    assert len(g.parameters) == len(base.parameters)
    assert g.nonstatic_parameters == [], g.problems()
    assert set(g.registered) <= set(g.static)  # the pass's own id buffers too
    assert g.nonstatic_mutated == [] and trimmed.problems() == []


@pytest.mark.parametrize("mode", sorted(MODES))
def test_op_reads_the_parameters_own_storage(mode, monkeypatch):
    model, args = _eagle()
    seen = []
    check = ops.check_head_args

    def spy(x, weight, *rest):
        if not is_fake(weight):  # the fake implementation checks too, while tracing
            seen.append(weight.untyped_storage().data_ptr())
        return check(x, weight, *rest)

    monkeypatch.setattr(ops, "check_head_args", spy)
    _, out = _check(model, args, MODES[mode])
    with torch.no_grad():
        ref = model(*args)[0]
    assert seen and set(seen) == {model.lm.weight.untyped_storage().data_ptr()}
    fin = torch.isfinite(out[0])
    assert fin.any() and torch.allclose(out[0][fin], ref[fin], atol=1e-5, rtol=1e-5)


class _Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lm = torch.nn.Linear(16, 257, bias=False)

    def forward(self, x):
        return self.lm(x)


def test_a_dynamo_graph_without_its_metadata_is_refused():
    gm = fx.symbolic_trace(_Head())
    for n in gm.graph.find_nodes(op="placeholder"):
        n.meta["val"] = torch.randn(1, 3, 16)
    gm.meta["dynamo_compile_id"] = "0/0"  # says Dynamo made it, but carries no sources
    with pytest.raises(TrimpassError, match=r"gm: a Dynamo graph without _param_name_to_source"):
        rewrite(gm, TrimConfig(vocab=list(range(0, 257, 2))), [torch.randn(1, 3, 16)])


class _TransposedHead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 257).T)  # [V, d] with column-major strides

    def forward(self, x):
        return torch.nn.functional.linear(x, self.w)


def test_a_non_contiguous_head_weight_is_refused_at_build_time():
    torch._dynamo.reset()
    be = trimpass.backend(vocab=list(range(0, 257, 2)), inner="aot_eager")
    compiled = torch.compile(_TransposedHead(), backend=be)
    with torch.no_grad(), pytest.raises(TrimpassError, match=r"weight: .* is not contiguous"):
        compiled(torch.randn(1, 3, 16))


def test_a_head_weight_of_another_dtype_than_its_input_is_refused():
    gm = fx.symbolic_trace(_Head())
    x = torch.randn(1, 3, 16, dtype=torch.bfloat16)
    with torch.no_grad(), pytest.raises(TrimpassError, match=r"weight: .* is torch.float32 on cpu "
                                                             r"but its input is torch.bfloat16"):
        rewrite(gm, TrimConfig(vocab=list(range(0, 257, 2))), [x])


def test_a_head_weight_on_another_device_than_its_input_is_refused():
    gm = fx.symbolic_trace(_Head())
    x = torch.empty(1, 3, 16, device="meta")  # any other device than the weight's (cpu)
    with torch.no_grad(), pytest.raises(TrimpassError, match=r"weight: .* on cpu but its input "
                                                             r"is torch.float32 on meta"):
        rewrite(gm, TrimConfig(vocab=list(range(0, 257, 2))), [x])


class _FloatIds(StaticIndex):
    """An id provider whose buffer holds floats: what a custom provider could get wrong."""

    def nodes(self, gm, before, m, device):
        idx, count = super().nodes(gm, before, m, device)
        gm._trimpass_idx = gm._trimpass_idx.float()
        return idx, count


def test_an_id_buffer_of_the_wrong_dtype_is_refused_at_build_time():
    gm = fx.symbolic_trace(_Head())
    config = TrimConfig(vocab=list(range(0, 257, 2)))
    with torch.no_grad(), pytest.raises(TrimpassError, match=r"idx: the active-id buffer "
                                                             r"_trimpass_idx is torch.float32"):
        rewrite(gm, config, [torch.randn(1, 3, 16)], index=_FloatIds(config.settings))
