"""The fused loop's compiled steps as inductor's CUDA-graph trees would see them, read on CPU from
AOT autograd's metadata: every parameter and every mutated cache buffer a static input (a mutated
non-static input makes the tree skip the graph), and no more graphs than the one-token step and
the pass over many rows."""
import pytest
import torch

import trimpass
from tests.graph.test_hf import V
from tests.hf.test_selfdraft import MODELS
from trimpass.testing.capture import CaptureCheck


@pytest.mark.parametrize("name", ["gemma3", "llama"])
@pytest.mark.parametrize("speculate", [True, False], ids=["fused", "plain"])
def test_every_compiled_step_of_the_loop_is_capturable(name, speculate):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    cc = CaptureCheck()
    for n in (7, 260):  # another cache size (a granule is 256): the length stays symbolic
        trimpass.generate(model, torch.randint(0, V, (1, n)), 12, gamma=4, confidence=0.0,
                          lookup=False, speculate=speculate, inner=cc, learn_core=64)
    assert len(cc.graphs) == 2, [g.graph.meta.get("trimpass") for g in cc.graphs]
    assert cc.problems() == []
    for g in cc.graphs:
        assert g.mutated and g.parameters, "the check saw no cache write or no weight"
