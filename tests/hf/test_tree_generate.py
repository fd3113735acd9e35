"""Draft trees in :func:`trimpass.generate`: where a tenant's earlier outputs continue one context
two ways, the suffix index drafts both, one pass (an ancestors-only mask through the loop's own
cache, sliding-window layers included) verifies them, and the branch a chain would have missed is
kept (counted in that very call) while the output stays the plain greedy one; with chains the same
call keeps no branch. Sampled, the trees' rounds run and every token stays in the vocabulary; the
sampled rule's distribution is tested in tests/spec/test_tree.py and tests/hf/test_rounds.py. A bad
tree setting is refused before any compute."""
import numpy as np
import pytest
import torch

import trimpass
from tests.graph.test_hf import V
from tests.hf.test_fused import FAST, WINDOW, _decode
from trimpass.hf.fused import FusedLoop

N = 40


def _model(name: str, monkeypatch):
    # the whole tree verified whatever its measured cost (a loaded machine's timings would cut
    # the side branch, and this tests the pass, not the pricing: tests/hf/test_costs.py)
    monkeypatch.setattr(FusedLoop, "_size", lambda self, tree: len(tree))
    torch._dynamo.reset()
    torch.manual_seed(5)
    model = WINDOW[name]().eval()
    model.generation_config.eos_token_id = None  # every request runs its N tokens
    return model


def _two_ways(model, ids, tenant: str) -> torch.Tensor:
    """The tenant's earlier outputs: the greedy reply, then one that leaves it at a token halfway
    (newer: a chain follows it, and the target rejects it there)."""
    want = _decode(model, ids, N)
    trimpass.generate(model, ids, N, gamma=4, lookup=False, tenant=tenant, **FAST)
    reply = want[0, ids.shape[1]:].tolist()
    j = N // 2
    other = reply[:j] + [(reply[j] + 1) % V] + [(t + 3) % V for t in reply[j + 1:]]
    model._trimpass_suffix[False].add(tenant, np.asarray(other))
    return want


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_a_branch_a_chain_misses_is_verified_in_one_pass_and_kept_losslessly(name, monkeypatch):
    model = _model(name, monkeypatch)
    ids = torch.randperm(V)[:12].unsqueeze(0)
    want = _two_ways(model, ids, "c")
    assert torch.equal(_two_ways(model, ids, "t"), want)
    chains = trimpass.generate(model, ids, N, gamma=1, lookup=False, tenant="c", tree=False,
                               **FAST)
    assert torch.equal(chains, want) and trimpass.stats(model)["branch_kept"] == 0
    trees = trimpass.generate(model, ids, N, gamma=1, lookup=False, tenant="t", **FAST)
    s = trimpass.stats(model)
    assert torch.equal(trees, want)
    assert s["tree_rounds"] >= 1 and s["branch_kept"] >= 1, s  # kept off the main path


def test_sampled_trees_run_and_draw_from_the_vocabulary(monkeypatch):
    model = _model("llama", monkeypatch)
    ids = torch.randperm(V)[:12].unsqueeze(0)
    _two_ways(model, ids, "t")
    torch.manual_seed(0)
    out = trimpass.generate(model, ids, N, gamma=4, lookup=False, tenant="t", do_sample=True,
                            temperature=0.7, **FAST)
    assert out.shape == (1, 12 + N) and int(out.max()) < V  # a sampled reply parts from the index
    s = trimpass.stats(model)
    assert s["rounds"] >= 1


@pytest.mark.parametrize("tree, match", [({"size": 0}, "tree size"),
                                         ({"size": 100}, "rolls back at most 64 rows"),
                                         ({"depth": "2"}, "tree depth")])
def test_a_bad_tree_is_refused_before_any_compute(tree, match, monkeypatch):
    model = _model("llama", monkeypatch)
    monkeypatch.setattr(trimpass, "_fused_loop", lambda *a: pytest.fail("compiled"))
    with pytest.raises(ValueError, match=match):
        trimpass.generate(model, torch.zeros(1, 4, dtype=torch.long), 8, tree=tree, **FAST)
