"""The budget policies take keyword arguments only: the timings two of them take are easy to swap
by position, so a positional call is a TypeError."""
import pytest
import torch

from trimpass.budget.policies import POLICIES, make


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_policy_called_positionally_is_a_type_error(name):
    p = make({"policy": name, **({"gamma": 2} if name == "fixed" else {})}, 4)
    with pytest.raises(TypeError, match="positional argument"):
        p.skip(3, 4, None, 0.01, 0.02, 1.0)
    with pytest.raises(TypeError, match="positional argument"):
        p.stop(None, 1, 4, None, 0.01, 0.02, 0.0)
    with pytest.raises(TypeError, match="positional argument"):
        p.keep(torch.ones(2, 2), lambda b, t: 1.0, 0.0)
    assert p.skip(batch=3, gamma=4, cost=None, first_s=None, step_s=None,
                  accept_max=1.0) == (name == "none")
