"""The fused loop's compiled graphs as inductor's CUDA-graph trees would see them, read on CPU from
AOT autograd's metadata: every parameter, every mutated cache buffer and every mutated round
buffer a static input (a mutated non-static input makes the tree skip the graph), no 0-d input
that is not a static buffer (a Python number made a tensor per call), no graph break (each graph
compiles with ``fullgraph=True``), and a fixed set of graphs whatever the prompt: the body's
one-token step, its pass over many rows and its pass over a draft tree, and the rounds' graphs
(keep, accept, walk, token)."""
import pytest
import torch

import trimpass
from tests.graph.test_hf import V
from tests.hf.test_selfdraft import MODELS
from trimpass.testing.capture import CaptureCheck


def _embeds(g) -> bool:
    return any(n.target is torch.nn.functional.embedding for n in g.graph.graph.nodes)


def _graph_breaks() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


@pytest.mark.parametrize("name", ["gemma3", "llama"])
@pytest.mark.parametrize("speculate", [True, False], ids=["fused", "plain"])
def test_every_compiled_graph_of_the_loop_is_capturable(name, speculate):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    cc = CaptureCheck()
    prompt = torch.randint(0, V, (1, 7))
    for ids in (prompt, prompt.repeat(1, 40)):  # another cache size, and lookup rounds
        for sample in (False, True):
            trimpass.generate(model, ids, 24, gamma=4, do_sample=sample, speculate=speculate,
                              inner=cc, learn_core=64)
    graphs = len(cc.graphs)
    assert cc.problems() == []
    assert _graph_breaks() == 0
    body = [g for g in cc.graphs if _embeds(g)]  # the body's steps
    assert len(body) == 2 + speculate, "the one-token step, the pass over many rows and the " \
        "tree pass of the free drafts, no more"
    for g in body:
        assert g.mutated and g.parameters, "the check saw no cache write or no weight"
    rounds = [g for g in cc.graphs if g not in body]
    assert rounds and all(g.mutated for g in rounds), "a round graph writes its buffers"
    trimpass.generate(model, torch.randint(0, V, (1, 300)), 24, gamma=4, speculate=speculate,
                      inner=cc, learn_core=64)
    assert len(cc.graphs) == graphs, "a new prompt length compiled a graph"


def test_the_check_flags_a_0d_input_built_per_call():
    cc = CaptureCheck()
    f = torch.compile(lambda x, n: x * n, backend=cc, fullgraph=True)
    f(torch.randn(3), torch.tensor(2.0))
    assert any("0-d inputs that are not static" in p for p in cc.problems())
