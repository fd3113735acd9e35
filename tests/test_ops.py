"""The registered ops: both kernels against F.linear, opcheck, torch.compile, the CPU cache, bad
input."""
import pytest
import torch
import torch.nn.functional as F

from tests.conftest import assert_close_rel
from trimpass import compact, ops

KERNELS = ["torch", "triton"]


def _head(V=1009, d=96, K=123, dtype=torch.float32, bias=False):
    w = (torch.randn(V, d) / d**0.5).to(dtype)
    b = torch.randn(V).to(dtype) if bias else None
    idx = torch.randperm(V)[:K]
    return w, b, idx, torch.tensor([K], dtype=torch.int32)


def _full_ref(x, w, b, idx, scale=1.0, softcap=0.0):
    z = ops.softcap(F.linear(x.double(), w.double(), None if b is None else b.double()) * scale,
                    softcap)
    out = torch.full_like(z, float("-inf"))
    out[..., idx] = z[..., idx]
    return out


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 96), (3, 5, 96)])
def test_head_full_equals_full_head_on_active_ids(kernel, dtype, shape):
    w, b, idx, count = _head(dtype=dtype, bias=True)
    x = torch.randn(shape).to(dtype)
    with ops.use_kernel(kernel):
        out = ops.head_full(x, w, b, idx, count, 0.5, 3.0)
    assert out.shape == (*shape[:-1], w.shape[0]) and out.dtype == dtype
    assert_close_rel(out, _full_ref(x, w, b, idx, 0.5, 3.0), dtype)


@pytest.mark.parametrize("kernel", KERNELS)
def test_head_compact_and_topk_map_back_to_full_ids(kernel):
    w, b, idx, count = _head()
    x = torch.randn(4, 96)
    with ops.use_kernel(kernel):
        compact_logits = ops.head_compact(x, w, b, idx, count)
        values, ids = ops.head_topk(x, w, b, idx, count, 5)
    ref = _full_ref(x, w, b, idx)
    assert_close_rel(compact_logits, ref[:, idx], torch.float32)
    ref_values, ref_ids = ref.topk(5, dim=-1)
    assert torch.equal(ids, ref_ids)
    assert_close_rel(values, ref_values, torch.float32)


@pytest.mark.parametrize("kernel", KERNELS)
def test_per_row_ids_with_device_count(kernel):
    V, d, cap = 701, 64, 50
    w = torch.randn(V, d) / 8
    idx = torch.stack([torch.randperm(V)[:cap] for _ in range(3)])
    count = torch.tensor([50, 20, 3])
    x = torch.randn(3, 2, d)
    with ops.use_kernel(kernel):
        full = ops.head_full(x, w, None, idx, count)
        values, ids = ops.head_topk(x, w, None, idx, count, 3)
    for g, n in enumerate(count.tolist()):
        assert_close_rel(full[g], _full_ref(x[g], w, None, idx[g, :n]), torch.float32)
        assert torch.equal(ids[g], _full_ref(x[g], w, None, idx[g, :n]).topk(3, dim=-1).indices)


def test_scatter_full_ignores_stale_slots_past_count():
    idx = torch.tensor([[5, 2, 7, 2]])  # slot 3 past the count holds a stale duplicate of id 2
    vals = torch.tensor([[[1.0, 2.0, 3.0, 9.0]]])
    out = ops.scatter_full(vals, idx, torch.tensor([3]), 8, float("-inf"))
    expect = torch.full((1, 1, 8), float("-inf"))
    expect[0, 0, [5, 2, 7]] = torch.tensor([1.0, 2.0, 3.0])
    assert torch.equal(out, expect)


@pytest.mark.parametrize("kernel", KERNELS)
def test_opcheck(kernel):
    w, b, idx, count = _head(V=211, d=32, K=17, bias=True)
    x = torch.randn(2, 3, 32)
    with ops.use_kernel(kernel):
        torch.library.opcheck(ops.head_full, (x, w, b, idx, count, 1.0, 0.0))
        torch.library.opcheck(ops.head_compact, (x, w, None, idx, count, 2.0, 0.0))
        torch.library.opcheck(ops.head_topk, (x, w, b, idx, count, 4, 1.0, 0.0))
    c = torch.randn(2, 17)
    torch.library.opcheck(ops.scatter_full, (c, idx, count, 211, float("-inf")))
    torch.library.opcheck(ops.mask_inactive, (c, idx, torch.tensor([9]), 0.0))


def test_triton_kernel_runs_through_the_op_under_inductor():
    w, b, idx, count = _head(V=509, d=64, K=77)
    x = torch.randn(3, 64)

    def step(x, w, idx, count):
        return ops.head_full(torch.tanh(x), w, None, idx, count) * 2.0

    compiled = torch.compile(step, backend="inductor", fullgraph=True)
    with ops.use_kernel("triton"):
        before = ops.calls["head_full"]
        out = compiled(x, w, idx, count)
        assert ops.calls["head_full"] == before + 1
    assert_close_rel(out, _full_ref(torch.tanh(x), w, None, idx) * 2.0, torch.float32)


def test_cpu_cache_is_incremental_and_follows_weight_updates():
    compact.clear()
    w, _, idx, count = _head(V=500, d=32, K=40)
    x = torch.randn(1, 32)
    ops.head_compact(x, w, None, idx, count)
    assert compact.rows_gathered() == 40
    idx[[3, 17]] = torch.tensor([499, 498]) if 499 not in idx else torch.tensor([0, 1])
    out = ops.head_compact(x, w, None, idx, count)
    assert compact.rows_gathered() == 42, "only the two changed slots should be re-gathered"
    assert_close_rel(out, _full_ref(x, w, None, idx)[:, idx], torch.float32)
    with torch.no_grad():
        w.mul_(-3.0)  # in place: same storage, new version
    out = ops.head_compact(x, w, None, idx, count)
    assert_close_rel(out, _full_ref(x, w, None, idx)[:, idx], torch.float32)


@pytest.mark.parametrize("G", [1, 3])
def test_cpu_cache_follows_ids_changed_in_place_in_the_same_buffer(G):
    """The same id buffer object, edited in place between calls (as the dynamic state does), and
    a count that grows: every call reads the ids afresh."""
    compact.clear()
    V, d, cap = 400, 16, 30
    w = torch.randn(V, d)
    idx = torch.stack([torch.randperm(V)[:cap] for _ in range(G)])
    idx = idx[0] if G == 1 else idx
    count = torch.full((G,), 10, dtype=torch.int32)
    x = torch.randn(G, 1, d) if G > 1 else torch.randn(1, d)
    for step in range(4):
        out = ops.head_full(x, w, None, idx, count)
        for g in range(G):
            ids = (idx if G == 1 else idx[g])[:int(count[g])]
            assert_close_rel(out if G == 1 else out[g], _full_ref(x if G == 1 else x[g], w, None,
                                                                  ids), torch.float32)
        flat = idx.view(-1)
        flat[step] = torch.arange(V)[~torch.isin(torch.arange(V), flat)][0]  # a new id
        count += 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("threads", [1, 2])
def test_filled(dtype, threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        like = torch.zeros(1, dtype=dtype)
        for fill in (float("-inf"), 0.0, -1.5):
            out = ops.filled((3, 1001), fill, like)
            assert out.dtype == dtype and torch.equal(out, torch.full((3, 1001), fill, dtype=dtype))
            assert torch.get_num_threads() == threads, "the thread count was not restored"
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_head_full_groups_with_empty_and_full_counts(idx_dtype):
    V, d, cap = 301, 16, 9
    w = torch.randn(V, d)
    idx = torch.stack([torch.randperm(V)[:cap] for _ in range(3)]).to(idx_dtype)
    count = torch.tensor([0, cap, 4], dtype=torch.int32)
    x = torch.randn(3, 2, d)
    out = ops.head_full(x, w, None, idx, count)
    for g, n in enumerate(count.tolist()):
        assert_close_rel(out[g], _full_ref(x[g], w, None, idx[g, :n].long()), torch.float32)
    one = ops.head_full(x[:1, :1], w, None, idx[2], count[2:])  # the one-group fast path
    assert_close_rel(one[0], _full_ref(x[0, :1], w, None, idx[2, :4].long()), torch.float32)


def test_cpu_cache_follows_inference_mode_weights():
    compact.clear()
    with torch.inference_mode():  # no version counter: the rows cannot be trusted between calls
        w, _, idx, count = _head(V=300, d=16, K=20)
        x = torch.randn(1, 16)
        ops.head_full(x, w, None, idx, count)
        w.mul_(-2.0)
        out = ops.head_full(x, w, None, idx, count)
    assert_close_rel(out, _full_ref(x, w, None, idx), torch.float32)


BAD = [
    (dict(x=torch.randn(2, 31)), ValueError, "hidden sizes differ"),
    (dict(x=torch.randn(2, 32, dtype=torch.float64)), TypeError, "dtypes differ"),
    (dict(w=torch.randn(32, 100).T), ValueError, "weight: must be contiguous"),
    (dict(idx=torch.arange(5.0)), TypeError, "idx: token ids must be int32 or int64"),
    (dict(idx=torch.empty(0, dtype=torch.long)), ValueError, "idx: expected a non-empty"),
    (dict(idx=torch.arange(5, device="meta")), ValueError, "idx: on meta"),
    (dict(count=torch.tensor([1.0])), TypeError, "count: must be an int32"),
    (dict(count=torch.tensor([1, 2])), ValueError, "count: expected 1 element"),
    (dict(x=torch.randn(2, 32).half(), w=torch.randn(100, 32)), TypeError, "dtypes differ"),
]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bad,exc,msg", BAD)
def test_bad_input_raises_before_launch(kernel, bad, exc, msg):
    args = dict(x=torch.randn(2, 32), w=torch.randn(100, 32), idx=torch.arange(5),
                count=torch.tensor([5]))
    args.update(bad)
    before = sum(ops.calls.values())
    with ops.use_kernel(kernel), pytest.raises(exc, match=msg):
        ops.head_full(args["x"], args["w"], None, args["idx"], args["count"])
    assert sum(ops.calls.values()) == before


def test_topk_k_out_of_range():
    with pytest.raises(ValueError, match="k: must be in"):
        ops.head_topk(torch.randn(1, 8), torch.randn(20, 8), None, torch.arange(4),
                      torch.tensor([4]), 5)
