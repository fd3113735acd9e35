"""trimpass.dynamic.escape: the proxy follows weight changes; the head stays exact on every active
id and on every id the escape path adds, -inf elsewhere; the added ids are the proxy's best outside
the set and join only their own request's row; a near-full-rank proxy recovers the full argmax the
set missed; the device path has no host sync; bad settings are clear errors."""
import pytest
import torch

from trimpass import ops
from trimpass.config import Escape, TrimConfig, TrimpassError
from trimpass.dynamic.escape import BLOCK, Proxy, confidence, max_prob, top_ids
from trimpass.dynamic.state import ActiveState
from trimpass.testing.nosync import no_host_sync

V, D = 300, 24


def _state(rank=8, k=5, gate=0.999, cap=32, rows=3, slots=512):
    st = ActiveState(TrimConfig(capacity=cap, learn_core=0, max_rows=rows,
                                escape=Escape(rank=rank, topk=k, gate=gate,
                                              slots=slots)).settings)
    st.build(V, "cpu")
    return st


def _row(st, r):
    return set(st.idx[r, :int(st.count[r])].tolist())


def _step(st, x, w, ids):
    """One decode step through the real ops: admit the batch's ids, read the rows, head + escape."""
    B = ids.shape[0]
    torch.ops.trimpass.admit(st.token, ids, None, st.serial)
    idx, count = torch.ops.trimpass.active(st.token, B, st.settings.capacity, st.serial)
    out = torch.ops.trimpass.head_full_escape(x, w, None, idx, count, st.serial)
    return out, idx, count


def test_proxy_follows_in_place_changes_and_load_state_dict():
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(D, V, bias=False)
    p = Proxy(6).of(lin.weight)
    first = p.proj.clone()
    with torch.no_grad():
        lin.weight.mul_(2.0)
    p.of(lin.weight)
    torch.testing.assert_close(p.proj.float(), 2 * first.float(), rtol=2e-2, atol=1e-2)
    lin.load_state_dict({"weight": torch.randn(V, D, generator=g)})
    p.of(lin.weight)
    torch.testing.assert_close(p.proj, Proxy(6).of(lin.weight.detach().clone()).proj)


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_head_is_exact_on_active_and_escaped_ids_and_rows_stay_apart(kernel):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(V, D, generator=g)
    x = 0.05 * torch.randn(3, 1, D, generator=g)  # modest logits: every row is unsure
    st = _state(k=5, gate=0.9)
    proxy = Proxy(8).of(w)  # each row's ids are the proxy's own two best: the escape must skip them
    ids = torch.stack([proxy.scores(x[r, -1][None])[0].float().topk(2).indices for r in range(3)])
    with ops.use_kernel(kernel):
        out, idx, count = _step(st, x, w, ids)
    full = x @ w.T
    for r in range(3):
        finite = set(torch.isfinite(out[r, -1]).nonzero().flatten().tolist())
        before = set(idx[r, :int(count[r])].tolist())
        added = finite - before
        assert before <= finite and len(added) == 5, (r, before, finite)
        assert _row(st, r) == finite  # the escaped ids joined this request's row only ...
        fin = sorted(finite)
        torch.testing.assert_close(out[r, -1, fin], full[r, -1, fin], rtol=1e-4, atol=1e-4)
        proxy = st.proxy.of(w).scores(x[r, -1][None]).float()[0]
        proxy[sorted(before)] = float("-inf")
        assert added == set(proxy.topk(5).indices.tolist())  # ... and are the proxy's best
    assert int(st.fired) == 3


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_a_full_row_skips_the_path_and_a_row_with_room_takes_ids(kernel):
    g = torch.Generator().manual_seed(6)
    w = torch.randn(V, D, generator=g)
    x = 0.05 * torch.randn(2, 1, D, generator=g)  # both rows unsure
    st = _state(k=5, gate=0.9, cap=8, rows=2)
    ids = torch.tensor([list(range(10, 18)), [20] * 7 + [21]])  # row 0 fills its 8 slots
    with ops.use_kernel(kernel):
        out, idx, count = _step(st, x, w, ids)
    assert _row(st, 0) == set(range(10, 18)) and int(st.count[0]) == 8
    assert set(torch.isfinite(out[0, -1]).nonzero().flatten().tolist()) == set(range(10, 18))
    assert len(_row(st, 1)) == 2 + 5 and int(st.fired) == 1


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_an_empty_row_escapes_on_both_gates(kernel):
    """A row with no active id (a drafter fed hidden states, no token lookup, before any feedback)
    has no trimmed distribution at all: it is as unsure as can be and takes the proxy's ids."""
    g = torch.Generator().manual_seed(9)
    w = torch.randn(V, D, generator=g)
    x = torch.randn(2, 1, D, generator=g)
    st = _state(k=5, gate=0.5, rows=2)
    with ops.use_kernel(kernel):
        idx, count = torch.ops.trimpass.active(st.token, 2, st.settings.capacity, st.serial)
        assert count.tolist() == [0, 0]
        out = torch.ops.trimpass.head_full_escape(x, w, None, idx, count, st.serial)
    full = x @ w.T
    for r in range(2):
        fin = torch.isfinite(out[r, -1]).nonzero().flatten()
        assert len(fin) == 5 and _row(st, r) == set(fin.tolist())
        torch.testing.assert_close(out[r, -1, fin], full[r, -1, fin], rtol=1e-4, atol=1e-4)
    assert int(st.fired) == 2


@pytest.mark.parametrize("kernel", ["torch", "triton"])  # the host gate and the device gate
def test_rows_above_the_gate_are_untouched(kernel):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(V, D, generator=g)
    x = torch.randn(2, 1, D, generator=g)
    hit = int((x[0, -1] @ w.T).argmax())
    flat = [i for i in range(10, 16) if i != hit]
    w[flat] *= 1e-3  # row 1's ids have near-equal logits: p_max ~ 1/6, below the gate
    st = _state(gate=0.5)
    with ops.use_kernel(kernel):
        out, idx, count = _step(st, x, w, torch.tensor([[hit] * len(flat), flat]))
    assert torch.isfinite(out[0, -1]).sum() == 1 and _row(st, 0) == {hit}  # p_max = 1: skipped
    assert torch.isfinite(out[1, -1]).sum() == len(flat) + 5 and len(_row(st, 1)) == len(flat) + 5
    assert int(st.fired) == 1


def test_a_good_proxy_recovers_the_argmax_the_active_set_missed():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(V, D, generator=g)
    misses = fixed = 0
    for _ in range(20):
        x = torch.randn(1, 1, D, generator=g)
        full = (x @ w.T)[0, -1]
        ids = torch.randint(0, V, (1, 6), generator=g)
        ids = ids[ids != int(full.argmax())][None]  # the set misses the full argmax
        plain = ActiveState(TrimConfig(capacity=32, learn_core=0, max_rows=1).settings)
        plain.build(V, "cpu")
        torch.ops.trimpass.admit(plain.token, ids, None, plain.serial)
        i0, c0 = torch.ops.trimpass.active(plain.token, 1, 32, plain.serial)
        miss = int(torch.ops.trimpass.head_full(x, w, None, i0, c0)[0, -1].argmax())
        st = _state(rank=D - 1, k=8, gate=0.9999, rows=1)
        out, _, _ = _step(st, x, w, ids)
        misses += miss != int(full.argmax())
        fixed += int(out[0, -1].argmax()) == int(full.argmax())
    assert misses == 20 and fixed >= 19, (misses, fixed)


def test_device_path_has_no_host_sync():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(V, D, generator=g)
    st = _state()
    with ops.use_kernel("triton"), no_host_sync():
        for _ in range(2):
            _step(st, 0.05 * torch.randn(2, 1, D, generator=g), w, torch.randint(0, V, (2, 2),
                                                                         generator=g))
    assert int(st.fired) == 4 and len(_row(st, 0)) > 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_confidence_is_the_trimmed_softmax_maximum_over_each_rows_own_ids(dtype):
    g = torch.Generator().manual_seed(7)
    last = (3 * torch.randn(3, V, generator=g)).to(dtype)
    idx = torch.stack([torch.randperm(V, generator=g)[:40] for _ in range(3)])
    count = torch.tensor([40, 7, 1], dtype=torch.int32)  # slots past a count hold stale ids
    want = [torch.softmax(last[r, idx[r, :int(count[r])]].double(), 0).max() for r in range(3)]
    got = confidence(last, idx, count)
    torch.testing.assert_close(got.double(), torch.stack(want), rtol=1e-5, atol=1e-6)
    assert got[2] == 1.0


@pytest.mark.parametrize("rows", [1, 3])
def test_head_op_hands_the_escape_the_confidence_of_each_rows_last_position(rows):
    g = torch.Generator().manual_seed(8)
    w = torch.randn(V, D, generator=g)
    x = torch.randn(rows, 2, D, generator=g) * torch.tensor([3.0, 0.05, 1.0][:rows])[:, None, None]
    st = _state(rows=rows)
    torch.ops.trimpass.admit(st.token, torch.randint(0, V, (rows, 9), generator=g), None,
                             st.serial)
    idx, count = torch.ops.trimpass.active(st.token, rows, st.settings.capacity, st.serial)
    out, last = ops.full_and_last(x if rows > 1 else x[0], w, None, idx, count, 1.0, 0.0)
    assert last.shape[0] == rows
    want = confidence(out.reshape(rows, -1, V)[:, -1], idx, count)
    torch.testing.assert_close(max_prob(last, count), want)
    assert rows == 1 or want.min() < 0.5 < want.max(), "rows both sides of the gate"


@pytest.mark.parametrize("cols", [2 * 64 * BLOCK + 1, 300 * BLOCK, 300 * BLOCK + 77, 1000])
@pytest.mark.parametrize("kind", ["distinct", "ties", "masked"])
def test_top_ids_holds_the_k_largest_values(cols, kind):
    g = torch.Generator().manual_seed(cols)
    s = torch.randn(3, cols, generator=g)
    if kind == "ties":  # few distinct values: the k-th largest is tied across many blocks
        s = s.mul(2).round()
    if kind == "masked":  # most columns -inf, as the active set's ids are
        s[:, torch.randperm(cols, generator=g)[:cols - 100]] = float("-inf")
        s[1, -5:] = 50.0  # the best ones in the tail past the last whole block
    with no_host_sync():
        got = top_ids(s, 64)
    assert got.shape == (3, 64) and got.dtype == torch.long
    want = s.topk(64, dim=1).values
    for r in range(3):
        assert len(set(got[r].tolist())) == 64, "a column picked twice"
        assert torch.equal(s[r, got[r]].sort(descending=True).values, want[r])


@pytest.mark.parametrize("kw,match", [(dict(rank=0), "escape.rank"),
                                      (dict(rank=-1), "escape.rank"),
                                      (dict(topk=0), "escape.topk"),
                                      (dict(gate=0.0), "escape.gate"),
                                      (dict(gate=1.0), "escape.gate"),
                                      (dict(gate=True), "escape.gate")])
def test_bad_settings_are_clear_errors(kw, match):
    with pytest.raises(TrimpassError, match=match):
        Escape(**kw)
    with pytest.raises(TrimpassError, match="escape: a dynamic-mode setting"):
        TrimConfig(vocab=[1, 2], escape=Escape(rank=8))
    with pytest.raises(TrimpassError, match="escape: must be a trimpass.config.Escape or None"):
        TrimConfig(escape=16)


@pytest.mark.parametrize("kw,match", [(dict(escape_rank=-1), "escape_rank"),
                                      (dict(escape_topk=0), "escape_topk"),
                                      (dict(escape_gate=1.0), "escape_gate"),
                                      (dict(vocab=[1, 2], escape_rank=8), "escape_rank")])
def test_the_flat_names_still_check_and_warn(kw, match):
    with pytest.warns(DeprecationWarning, match=match), pytest.raises(TrimpassError, match=match):
        TrimConfig(**kw)


def test_the_flat_names_fold_into_escape():
    with pytest.warns(DeprecationWarning, match=r"escape=Escape\(rank=8, gate=0.9\)"):
        cfg = TrimConfig(escape_rank=8, escape_gate=0.9)
    assert cfg.settings.escape == Escape(rank=8, topk=64, gate=0.9)
    with pytest.warns(DeprecationWarning, match="escape=None to turn the path off"):
        assert TrimConfig(escape_rank=0).settings.escape is None
    assert TrimConfig().settings.escape == Escape(rank=16, topk=64, gate=0.5)
    assert TrimConfig(escape=None).settings.escape is None


def test_rank_at_least_d_is_a_clear_error():
    st = _state(rank=D)
    with pytest.raises(ValueError, match="escape.rank"):
        _step(st, torch.randn(1, 1, D), torch.randn(V, D), torch.tensor([[1]]))


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_escaped_ids_take_free_slots_only_and_never_evict(kernel):
    g = torch.Generator().manual_seed(5)
    w = torch.randn(V, D, generator=g)
    st = _state(k=5, gate=0.9, cap=8, rows=1)
    ctx = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with ops.use_kernel(kernel):
        for step in range(3):
            out, _, _ = _step(st, 0.05 * torch.randn(1, 1, D, generator=g), w,
                              ctx if step == 0 else ctx[:, :1])
            fin = set(torch.isfinite(out[0, -1]).nonzero().flatten().tolist())
            assert {1, 2, 3, 4, 5, 6} <= fin and len(fin) <= 8  # capacity holds, context stays
    assert {1, 2, 3, 4, 5, 6} <= _row(st, 0) and len(_row(st, 0)) == 8
    torch.ops.trimpass.admit(st.token, torch.tensor([[7, 8]]), None, st.serial)  # full: evicts
    assert _row(st, 0) == {1, 2, 3, 4, 5, 6, 7, 8}  # the escaped ids, never the request's own


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_escaped_ids_a_row_keeps_stay_within_slots_and_the_newest_replace_the_earliest(kernel):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(V, D, generator=g)
    ctx = torch.tensor([[1, 2, 3]])
    for slots, bound in ((12, 3 + 12), (None, 64)):
        st = _state(k=5, gate=0.999, cap=64, rows=1, slots=slots)
        sizes, wrote = [], set()
        with ops.use_kernel(kernel):
            for step in range(20):  # unsure on every step: the path fires each time
                out, _, _ = _step(st, torch.randn(1, 1, D, generator=g), w,
                                  ctx if step == 0 else ctx[:, :1])
                wrote |= set(torch.isfinite(out[0, -1]).nonzero().flatten().tolist())
                row = _row(st, 0)
                assert {1, 2, 3} <= row  # the request's own ids stay
                sizes.append(len(row))
        assert max(sizes) == bound  # bounded by slots, or, unbounded, by the capacity
        if slots is not None:
            assert len(wrote - {1, 2, 3}) > 3 * slots  # replaced, not frozen: new ids keep coming
            assert int(st.fired) >= 15


def test_slots_is_checked():
    with pytest.raises(TrimpassError, match=r"escape.slots: escaped ids a row keeps"):
        Escape(slots=-1)
    assert Escape(slots=None).slots is None and Escape().slots == 512
