"""The budget policies name the depths a proposal may draft, decided before drafting, and cut by
keyword arguments only (the timings are easy to swap by position, so a positional call is a
TypeError)."""
import pytest
import torch

from trimpass.spec.control.policies import POLICIES, make


@pytest.mark.parametrize("name, depths", [("dcut", (0, 1, 2, 3, 4)), ("all-or-nothing", (0, 4)),
                                          ("fixed", (2,)), ("off", (4,)), ("none", ())])
def test_each_policy_names_its_depths(name, depths):
    assert set(POLICIES) == {"dcut", "all-or-nothing", "fixed", "off", "none"}
    p = make({"policy": name, **({"gamma": 2} if name == "fixed" else {})}, 4)
    assert p.depths(4) == depths


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_cut_called_positionally_is_a_type_error(name):
    p = make({"policy": name, **({"gamma": 2} if name == "fixed" else {})}, 4)
    with pytest.raises(TypeError, match="positional argument"):
        p.keep(torch.ones(2, 2), lambda b, t: 1.0, 0.0)
    got = p.keep(conf=torch.ones(2, 2, dtype=torch.float64), cost=lambda b, t: 1.0, draft_time=0.0)
    assert got.tolist() == [2, 2]  # free verification: every confident token is kept
