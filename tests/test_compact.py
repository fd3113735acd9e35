"""The CPU path's packed matmul (trimpass.compact.linear): used once the rows are stable, dropped
when they change, the same logits as the full head, and a plain matmul where packing fails."""
import pytest
import torch

from tests.conftest import assert_close_rel
from tests.test_ops import _full_ref, _head
from trimpass import compact, ops

needs_packing = pytest.mark.skipif(not compact.packing()["available"], reason="no oneDNN here")


@pytest.fixture
def packed_calls(monkeypatch):
    """Counts calls of the packed matmul; the timing choice is forced to the packed copy."""
    seen = []
    real = compact.packed_linear
    monkeypatch.setattr(compact, "packed_linear", lambda *a: seen.append(1) or real(*a))
    monkeypatch.setattr(compact, "packed_pays", lambda *a: True)
    compact.clear()
    yield seen
    compact.clear()


def _skip_unless_packs(dtype):
    """oneDNN packs bf16 only on some CPUs (AVX-512 BW/VL/DQ or AVX-NE-CONVERT): skip with its
    reason where this one does not."""
    if compact.pack(torch.ones(16, 8, dtype=dtype)) is None:
        pytest.skip(f"this CPU cannot pack {dtype}: {compact.packing()['failed'].get(str(dtype))}")


def _new_id(idx, V):
    return torch.arange(V)[~torch.isin(torch.arange(V), idx)][0]


@needs_packing
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_copy_serves_stable_rows_and_is_dropped_when_they_change(packed_calls, dtype,
                                                                         rows, bias):
    _skip_unless_packs(dtype)
    w, b, idx, count = _head(V=1013, d=80, K=211, dtype=dtype, bias=bias)
    x = torch.randn(rows, 80).to(dtype)
    for call in range(compact.PACK_AFTER + 3):
        assert_close_rel(ops.head_full(x, w, b, idx, count), _full_ref(x, w, b, idx), dtype)
        assert len(packed_calls) == max(0, call + 1 - compact.PACK_AFTER)
    idx[7] = _new_id(idx, w.shape[0])  # the same buffer, one id changed
    out = ops.head_full(x, w, b, idx, count)
    assert len(packed_calls) == 3, "the packed copy was used after its rows changed"
    assert_close_rel(out, _full_ref(x, w, b, idx), dtype)
    for _ in range(compact.PACK_AFTER):  # stable again: repacked with the new row
        out = ops.head_compact(x, w, b, idx, count)
    assert len(packed_calls) == 4
    assert_close_rel(out, _full_ref(x, w, b, idx)[:, idx], dtype)
    with torch.no_grad():
        w.mul_(-2.0)  # in place: a new version, a new cache entry
    assert_close_rel(ops.head_full(x, w, b, idx, count), _full_ref(x, w, b, idx), dtype)
    assert len(packed_calls) == 4


@needs_packing
def test_packed_choice_is_measured_per_row_count_bucket_and_kept():
    compact.clear()
    w, _, idx, count = _head(V=2003, d=64, K=500)
    for rows in (1, 3, 1, 4, 5):
        x = torch.randn(rows, 64)
        for _ in range(compact.PACK_AFTER + 2):
            assert_close_rel(ops.head_full(x, w, None, idx, count), _full_ref(x, w, None, idx),
                             torch.float32)
    (entry,) = compact._cache.values()
    assert set(entry.faster) == {1, 4, 8} and entry.packed is not None  # 3 and 4 share one
    compact.clear()


@pytest.mark.parametrize("where", ["pack", "run"])
def test_a_failing_pack_turns_packing_off_for_its_dtype_and_keeps_the_plain_matmul(monkeypatch,
                                                                                   where):
    def fail(*a):
        raise RuntimeError("no packed layout for this dtype")
    monkeypatch.setattr(compact, "_unpackable", {})
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    if where == "pack":
        monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", fail)
    else:
        monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", lambda w, m: w)
        monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", fail)
    compact.clear()
    w, _, idx, count = _head()
    x = torch.randn(2, w.shape[1])
    for _ in range(compact.PACK_AFTER + 2):
        assert_close_rel(ops.head_full(x, w, None, idx, count), _full_ref(x, w, None, idx),
                         torch.float32)
    assert "no packed layout" in compact.packing()["failed"]["torch.float32"]
    assert "torch.bfloat16" not in compact.packing()["failed"]
    w16, _, idx, count = _head(dtype=torch.bfloat16)  # another dtype still tries
    for _ in range(compact.PACK_AFTER + 1):
        ops.head_full(x.bfloat16(), w16, None, idx, count)
    assert "torch.bfloat16" in compact.packing()["failed"]
    compact.clear()
