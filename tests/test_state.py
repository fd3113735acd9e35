"""The dynamic vocabulary's state and its admit op: set semantics, eviction, reset, no host sync."""
import pytest
import torch

import trimpass
from trimpass.config import TrimConfig
from trimpass.state import ActiveState


def _state(cap=8, V=50, B=2, keep=(), core=None, learn=0):
    st = ActiveState(TrimConfig(capacity=cap, keep=keep, core=core, learn_core=learn))
    return st, st.buffers(B, V, "cpu")


def _active(b, row=0):
    n = int(b["count"][row])
    return set(b["idx"][row, :n].tolist())


def _consistent(b, V):
    for r in range(b["count"].shape[0]):
        n = int(b["count"][r])
        ids = b["idx"][r, :n]
        assert len(set(ids.tolist())) == n, "an id holds two slots"
        assert torch.equal(b["slot"][r, ids].long(), torch.arange(n)), "slot map disagrees"
        assert int((b["slot"][r, :V] >= 0).sum()) == n, "stale entries in the slot map"


def test_admit_is_a_set_union_per_row():
    st, b = _state()
    st.admit(torch.tensor([[3, 7, 3, 9], [1, 1, 1, 1]]))
    assert _active(b, 0) == {3, 7, 9} and _active(b, 1) == {1}
    st.admit(torch.tensor([[9, 4], [2, 1]]))
    assert _active(b, 0) == {3, 7, 9, 4} and _active(b, 1) == {1, 2}
    _consistent(b, 50)


def test_least_recently_seen_is_evicted_and_core_never():
    st, b = _state(cap=5, keep=[0], core=[49])
    assert _active(b) == {0, 49}
    st.admit(torch.tensor([[10, 11, 12], [1, 2, 3]]))  # full now: 0, 49, 10, 11, 12
    st.admit(torch.tensor([[10, 12], [1, 2]]))  # 11 is now least recently seen in row 0
    st.admit(torch.tensor([[20, 20], [4, 4]]))
    assert _active(b, 0) == {0, 49, 10, 12, 20}
    st.admit(torch.tensor([[21, 22], [5, 6]]))  # evicts 10 and 12 (both older than 20)
    assert _active(b, 0) == {0, 49, 20, 21, 22}
    assert int(b["count"][0]) == 5
    _consistent(b, 50)


def test_more_new_ids_than_capacity_keeps_count_bounded():
    st, b = _state(cap=6, B=1)
    st.admit(torch.arange(30, 45)[None])
    assert int(b["count"][0]) == 6 and _active(b) <= set(range(30, 45))
    _consistent(b, 50)


def test_reset_on_position_zero_and_explicit():
    st, b = _state(cap=8, B=2, keep=[5])
    st.admit(torch.tensor([[1, 2], [3, 4]]))
    pos = torch.tensor([[0, 1], [7, 8]])  # row 0 starts a new request, row 1 continues
    torch.ops.trimpass.admit(*st.args(b), torch.tensor([[9, 9], [6, 6]]), pos, b["n_core"], None,
                             st.serial)
    assert _active(b, 0) == {5, 9} and _active(b, 1) == {5, 3, 4, 6}
    st.reset()
    assert _active(b, 0) == {5} and _active(b, 1) == {5}
    _consistent(b, 50)


def test_out_of_range_ids_raise():
    st, _ = _state()
    with pytest.raises(ValueError, match=r"ids: token ids must be in \[0, 50\)"):
        st.admit(torch.tensor([[3, 50], [1, 2]]))
    with pytest.raises(ValueError, match="no state for batch size 3"):
        st.admit(torch.zeros(3, 1, dtype=torch.long))


def test_capacity_must_leave_room_beside_core():
    with pytest.raises(ValueError, match="capacity: 3 leaves no room"):
        TrimConfig(capacity=3, keep=[0, 1, 2], learn_core=0)
    with pytest.raises(ValueError, match="raise capacity, or lower learn_core"):
        TrimConfig(capacity=64, keep=[0, 1], learn_core=62)


def test_learned_core_is_the_most_frequent_earlier_input_and_fills_fresh_rows_only():
    st, b = _state(cap=8, V=50, B=2, keep=[7], learn=2)
    assert b["n_core"] == 3 and 7 not in st.learned.tolist()
    pos0, pos5 = torch.zeros(2, 1, dtype=torch.long), torch.full((2, 1), 5)
    for ids in ([[4, 4, 9], [4, 11, 11]], [[9, 30, 4], [11, 2, 7]]):
        ids = torch.tensor(ids)
        torch.ops.trimpass.admit(*st.args(b), ids, pos5, b["n_core"], st.learned, st.serial)
        torch.ops.trimpass.learn(st.learned, ids, 1, st.serial)
    # counts: 4 x4, 11 x3, 9 x2 (7 is kept: never learned)
    assert set(st.learned.tolist()) == {4, 11}
    core_before = b["idx"][:, :3].clone()
    fresh = torch.tensor([[0], [5]])  # row 0 starts a new request, row 1 goes on
    torch.ops.trimpass.admit(*st.args(b), torch.tensor([[30], [2]]), fresh, b["n_core"],
                             st.learned, st.serial)
    assert _active(b, 0) == {7, 4, 11, 30}
    assert torch.equal(b["idx"][1, :3], core_before[1])
    _consistent(b, 50)


def test_learned_core_ranks_on_schedule_and_on_reset():
    st, b = _state(cap=16, V=50, B=1, learn=1)
    every = 3
    for k in range(1, every + 1):
        before = st.learned.clone()
        torch.ops.trimpass.learn(st.learned, torch.tensor([[42]]), every, st.serial)
        assert int(st.learned[0]) == 42 if k == every else torch.equal(st.learned, before)
    st.freq[13] = 100.0
    st.reset()
    assert int(st.learned[0]) == 13 and 13 in _active(b)


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_admit_compiles_fullgraph_without_host_sync(kernel):
    from trimpass import ops
    st, b = _state(cap=16, B=2)

    def step(ids, pos):
        torch.ops.trimpass.admit(*st.args(b), ids, pos, 0, None, st.serial)
        return b["count"] + 0

    compiled = torch.compile(step, backend="inductor", fullgraph=True)
    eager_st, eb = _state(cap=16, B=2)
    for t in range(12):
        ids = torch.randint(0, 50, (2, 3))
        pos = torch.full((2, 1), t)
        with ops.use_kernel(kernel):
            compiled(ids, pos)
        torch.ops.trimpass.admit(*eager_st.args(eb), ids, pos, 0, None, eager_st.serial)
    for k in ("slot", "idx", "count"):  # the last column of slot/idx is scratch
        a, e = (b[k], eb[k]) if k == "count" else (b[k][:, :-1], eb[k][:, :-1])
        assert torch.equal(a, e), f"compiled admission differs from eager on {k}"


def test_learned_core_starts_from_the_lowest_ids_outside_the_fixed_core():
    st, b = _state(cap=16, V=50, B=1, keep=[1], core=[0, 3], learn=4)
    assert sorted(st.learned.tolist()) == [2, 4, 5, 6]
    assert _active(b) == {0, 1, 2, 3, 4, 5, 6}


def test_successors_remember_what_followed_each_id_across_calls_and_requests():
    st = ActiveState(TrimConfig(capacity=16, learn_core=0, successors=2))
    b = st.buffers(2, 50, "cpu")
    got = st.follow(torch.tensor([[3, 4, 3, 5], [8, 9, 9, 9]]), torch.zeros(2, 1, dtype=torch.long))
    # row 0 saw 3->4, 4->3, 3->5; row 1 saw 8->9, 9->9 (duplicate pairs in one call collapse)
    assert set(st.succ[3].tolist()) == {4, 5} and st.succ[4].tolist()[0] == 3
    assert st.succ[8].tolist()[0] == 9 and 9 in st.succ[9].tolist()
    assert got.shape == (2, 8) and {4, 5} <= set(got[0].tolist())
    got = st.follow(torch.tensor([[7], [8]]), torch.full((2, 1), 4))  # the pair 5->7 spans calls
    assert st.succ[5].tolist()[0] == 7 and set(got[1].tolist()) == {9, 8}
    st.follow(torch.tensor([[6], [6]]), torch.zeros(2, 1, dtype=torch.long))  # new requests
    assert int((st.succ[7] == 6).sum()) == 0 and int((st.succ[8] == 6).sum()) == 0
    assert b["last"].tolist() == [6, 6]
