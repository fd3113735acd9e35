"""One ragged record of a step's drafts: flat ids with per-request counts and offsets, source and
match length; built from per-request rows, read back per request, and refused when its parts do
not agree."""
import pytest
import torch

from trimpass.spec.drafts import Drafts


def test_rows_go_in_and_come_back_out():
    d = Drafts.of([[5, 6, 7], None, [], [9]], "lookup", [3, 0, 0, 1])
    assert d.ids == (5, 6, 7, 9) and d.counts == (3, 0, 0, 1) and d.offsets == (0, 3, 3, 3)
    assert d.source == ("lookup", "none", "none", "lookup") and len(d) == 4
    assert [d.row(i) for i in range(4)] == [[5, 6, 7], [], [], [9]]
    assert d.per_request() == [([5, 6, 7], 3), None, None, ([9], 1)]
    assert torch.equal(d.tensor(0), torch.tensor([5, 6, 7]))
    assert Drafts.empty(3).per_request() == [None] * 3


def test_mixed_sources_and_confidences():
    d = Drafts.of([[1, 2], [3]], ["self", "lookup"], [0, 2], confidence=[0.9, 0.5, 1.0])
    assert d.source == ("self", "lookup") and d.confidence == (0.9, 0.5, 1.0)


@pytest.mark.parametrize("kw,msg", [
    (dict(ids=(1, 2), counts=(1,), source=("self",), match=(0,)), "do not add up"),
    (dict(ids=(1,), counts=(1,), source=("self", "self"), match=(0,)), "one entry per request"),
    (dict(ids=(1,), counts=(1,), source=("tree",), match=(0,)), "source must be one of"),
    (dict(ids=(1,), counts=(1,), source=("self",), match=(0,), confidence=(0.1, 0.2)),
     "one confidence per drafted id"),
])
def test_parts_that_disagree_are_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        Drafts(**kw)
