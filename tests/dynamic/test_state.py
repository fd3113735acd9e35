"""The dynamic vocabulary's state: request rows, set semantics, eviction, reset, the learned core,
engine-bound rows, memory per row, and no host sync on the device path."""
import pytest
import torch

from trimpass import ops
from trimpass.config import TrimConfig, TrimpassError
from trimpass.dynamic.state import LEARN_EVERY, ActiveState
from trimpass.testing.nosync import no_host_sync


def _state(cap=8, V=50, keep=(), core=None, learn=0, rows=4, successors=0):
    st = ActiveState(TrimConfig(capacity=cap, keep=keep, core=core, learn_core=learn,
                                max_rows=rows, successors=successors).settings)
    st.build(V, "cpu")
    return st


def _active(st, row=0):
    return set(st.idx[row, :int(st.count[row])].tolist())


def _consistent(st):
    for r in range(st.count.shape[0]):
        ids = st.idx[r, :int(st.count[r])]
        assert ids.unique().numel() == ids.numel(), "an id holds two slots"


def test_admit_is_a_set_union_per_row():
    st = _state()
    st.admit(torch.tensor([[3, 7, 3, 9], [1, 1, 1, 1]]), None)
    assert _active(st, 0) == {3, 7, 9} and _active(st, 1) == {1}
    st.admit(torch.tensor([[9, 4], [2, 1]]), None)
    assert _active(st, 0) == {3, 7, 9, 4} and _active(st, 1) == {1, 2}
    assert _active(st, 2) == set(), "a row no batch position uses was written"
    _consistent(st)


def test_least_recently_seen_is_evicted_and_core_never():
    st = _state(cap=5, keep=[0], core=[49])
    assert _active(st) == {0, 49}
    st.admit(torch.tensor([[10, 11, 12], [1, 2, 3]]), None)  # full now: 0, 49, 10, 11, 12
    st.admit(torch.tensor([[10, 12], [1, 2]]), None)  # 11 is now least recently seen in row 0
    st.admit(torch.tensor([[20, 20], [4, 4]]), None)
    assert _active(st, 0) == {0, 49, 10, 12, 20}
    st.admit(torch.tensor([[21, 22], [5, 6]]), None)  # evicts 10 and 12 (both older than 20)
    assert _active(st, 0) == {0, 49, 20, 21, 22}
    assert int(st.count[0]) == 5
    _consistent(st)


def test_more_new_ids_than_capacity_keeps_count_bounded():
    st = _state(cap=6)
    st.admit(torch.arange(30, 45)[None], None)
    assert int(st.count[0]) == 6 and _active(st) <= set(range(30, 45))
    _consistent(st)


def test_position_zero_starts_a_request_in_its_row_only_and_reset_clears_all():
    st = _state(cap=8, keep=[5])
    st.admit(torch.tensor([[1, 2], [3, 4]]), None)
    st.admit(torch.tensor([[9, 9], [6, 6]]), torch.tensor([[0, 1], [7, 8]]))
    assert _active(st, 0) == {5, 9} and _active(st, 1) == {5, 3, 4, 6}
    st.reset()
    assert _active(st, 0) == {5} and _active(st, 1) == {5}
    _consistent(st)


def test_reset_before_the_first_call_is_a_no_op():
    st = ActiveState(TrimConfig().settings)
    st.reset()  # nothing built yet: must not raise
    assert st.V is None


def test_out_of_range_ids_and_too_large_batches_raise():
    st = _state(rows=2)
    with pytest.raises(ValueError, match=r"ids: token ids must be in \[0, 50\)"):
        st.admit(torch.tensor([[3, 50], [1, 2]]), None)
    with pytest.raises(ValueError, match=r"max_rows: a batch of 3 needs 3 request rows"):
        st.admit(torch.zeros(3, 1, dtype=torch.long), None)


def test_capacity_must_leave_room_beside_core():
    with pytest.raises(TrimpassError, match="capacity: 3 leaves no room"):
        TrimConfig(capacity=3, keep=[0, 1, 2], learn_core=0)
    with pytest.raises(TrimpassError, match="raise capacity, or lower learn_core"):
        TrimConfig(capacity=64, keep=[0, 1], learn_core=62)


def test_learned_core_is_the_most_frequent_earlier_input_and_fills_fresh_rows_only():
    st = _state(cap=8, keep=[7], learn=2)
    assert st.n_core == 3 and 7 not in st.learned.tolist()
    pos5 = torch.full((2, 1), 5)
    for ids in ([[4, 4, 9], [4, 11, 11]], [[9, 30, 4], [11, 2, 7]]):
        st.admit(torch.tensor(ids), pos5)
    st.rank()
    # counts: 4 x4, 11 x3, 9 x2 (7 is kept: never learned)
    assert set(st.learned.tolist()) == {4, 11}
    core_before = st.idx[1, :3].clone()
    st.admit(torch.tensor([[30], [2]]), torch.tensor([[0], [5]]))  # row 0 starts a new request
    assert _active(st, 0) == {7, 4, 11, 30}
    assert torch.equal(st.idx[1, :3], core_before)
    _consistent(st)


def test_learned_core_ranks_on_schedule_and_on_reset():
    st = _state(cap=16, learn=1)
    for k in range(1, LEARN_EVERY + 1):
        before = st.learned.clone()
        st.admit(torch.tensor([[42]]), None)
        assert int(st.learned[0]) == 42 if k == LEARN_EVERY else torch.equal(st.learned, before)
    st.freq[13] = 1e6
    st.reset()
    assert int(st.learned[0]) == 13 and 13 in _active(st)


def test_learned_core_keeps_learning_once_the_step_is_captured(monkeypatch):
    import trimpass.dynamic.state as state_mod
    st = _state(cap=16, learn=1)
    st.upkeep()  # before any capture: a no-op, the step ranks itself
    assert st._upkeeps == 0
    monkeypatch.setattr(state_mod, "_capturing", lambda t: True)  # as inside a CUDA-graph capture
    for _ in range(3 * LEARN_EVERY):
        st.admit(torch.tensor([[42]]), None)  # the counting is recorded, the ranking is not
    assert int(st.learned[0]) == 0 and st.captured
    for k in range(1, LEARN_EVERY + 1):  # what a loop calls once per replayed step
        st.upkeep()
        assert int(st.learned[0]) == (42 if k == LEARN_EVERY else 0)


def test_learned_core_starts_from_the_lowest_ids_outside_the_fixed_core():
    st = _state(cap=16, keep=[1], core=[0, 3], learn=4)
    assert sorted(st.learned.tolist()) == [2, 4, 5, 6]
    assert _active(st) == {0, 1, 2, 3, 4, 5, 6}


def test_successors_remember_what_followed_each_id_across_calls_and_requests():
    st = _state(cap=16, successors=2)
    rows = st.rows_of(2)
    (sp,) = st.policies  # the successors policy, the only one turned on
    got = sp.extra(torch.tensor([[3, 4, 3, 5], [8, 9, 9, 9]]), rows)
    # row 0 saw 3->4, 4->3, 3->5; row 1 saw 8->9, 9->9 (duplicate pairs in one call collapse)
    assert set(sp.succ[3].tolist()) == {4, 5} and sp.succ[4].tolist()[0] == 3
    assert sp.succ[8].tolist()[0] == 9 and 9 in sp.succ[9].tolist()
    assert got.shape == (2, 8) and {4, 5} <= set(got[0].tolist())
    got = sp.extra(torch.tensor([[7], [8]]), rows)  # the pair 5->7 spans calls
    assert sp.succ[5].tolist()[0] == 7 and set(got[1].tolist()) == {9, 8}
    st.admit(torch.tensor([[6], [6]]), torch.zeros(2, 1, dtype=torch.long))  # new requests
    assert int((sp.succ[7] == 6).sum()) == 0 and int((sp.succ[8] == 6).sum()) == 0
    assert sp.last[:2].tolist() == [6, 6]


def test_engine_rows_follow_request_ids_and_are_never_shared():
    st = _state(cap=16, rows=3)
    st.bind(["a", "b"])
    st.admit(torch.tensor([[10, 11], [20, 21]]), None)
    st.bind(["b", "c"])  # a finished (its row stays taken until released); c joins
    st.admit(torch.tensor([[22], [30]]), None)
    ra, rb, rc = (st.requests[k] for k in "abc")
    assert len({ra, rb, rc}) == 3
    assert _active(st, rb) == {20, 21, 22} and _active(st, rc) == {30}
    assert _active(st, ra) == {10, 11}
    with pytest.raises(ValueError, match="max_rows: 4 live requests"):
        st.bind(["d"])
    st.release("a")
    st.bind(["d"], tokens={"d": [40, 41]})  # takes a's row, cleared, rebuilt from its tokens
    assert st.requests["d"] == ra and _active(st, ra) == {40, 41}
    st.release("b")
    st.bind(["b"], tokens={"b": [20, 21, 22]})  # a resumed request rebuilds its row
    assert _active(st, st.requests["b"]) == {20, 21, 22}


@pytest.mark.parametrize("successors", [0, 4])
def test_index_state_is_at_most_128_kb_per_row_at_capacity_4096(successors):
    st = ActiveState(TrimConfig(capacity=4096, max_rows=3, successors=successors).settings)
    st.build(262_144, "cpu")
    per_row = [st.idx, st.stamp, st.count[:, None], st.bound[:, None]]
    per_row += [p.last[:, None] for p in st.policies]  # the successors' last id per row
    assert len(per_row) == 4 + bool(successors)
    assert st.idx.shape[1] == 4096 + 1  # the scratch column
    assert sum(t[0].numel() * t.element_size() for t in per_row) == st.bytes_per_row() <= 128 * 1024


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_step_ops_compile_fullgraph_and_match_eager(kernel):
    def fresh():
        return _state(cap=16, V=50, rows=2)

    st, eager = fresh(), fresh()

    def step(ids, pos):
        token = torch.ops.trimpass.admit(st.token, ids, pos, st.serial)
        return torch.ops.trimpass.active(token, 2, 16, st.serial)

    compiled = torch.compile(step, backend="inductor", fullgraph=True)
    for t in range(12):
        ids = torch.randint(0, 50, (2, 3))
        pos = torch.full((2, 1), t % 5)
        with ops.use_kernel(kernel):
            idx, count = compiled(ids, pos)
        eager.admit(ids, pos)
        assert torch.equal(count, eager.count[:2]), f"step {t}: compiled count differs"
        for r in range(2):
            assert set(idx[r, :int(count[r])].tolist()) == _active(eager, r)


def test_device_path_has_no_host_sync():
    """The Triton path (what CUDA runs) forced under the interpreter, with a dispatch mode that
    fails on any host read of a tensor value or data-dependent shape."""
    st = _state(cap=16, V=50, rows=2, learn=4)
    with ops.use_kernel("triton"), no_host_sync():
        for t in range(3):
            torch.ops.trimpass.admit(st.token, torch.randint(0, 50, (2, 2)),
                                     torch.full((2, 1), t), st.serial)
            torch.ops.trimpass.active(st.token, 2, 16, st.serial)
    assert int(st.count[0]) > st.n_core


def test_no_host_sync_check_sees_the_cpu_paths_reads():
    st = _state(cap=16, V=50, rows=2)
    with ops.use_kernel("torch"), pytest.raises(Exception, match="host sync"), no_host_sync():
        torch.ops.trimpass.admit(st.token, torch.tensor([[1, 2]]), torch.zeros(1, 1), st.serial)
