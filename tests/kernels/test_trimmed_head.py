"""The Triton trimmed-head kernel against its pure-torch reference, under TRITON_INTERPRET=1."""
import pytest
import torch

from tests.conftest import assert_close_rel
from trimpass.kernels.trimmed_head import trimmed_head, trimmed_head_reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _inputs(G, M, K, d, dtype, V=1531, cap=None):
    cap = cap or K
    x = torch.randn(G, M, d).to(dtype)
    w = (torch.randn(V, d) / d**0.5).to(dtype)
    idx = torch.stack([torch.randperm(V)[:cap] for _ in range(G)])
    return x, w, idx


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [63, 640])
@pytest.mark.parametrize("K", [1, 127, 1000])
@pytest.mark.parametrize("M", [1, 3, 7])
def test_compact_matches_reference(M, K, d, dtype):
    x, w, idx = _inputs(1, M, K, d, dtype)
    count = torch.tensor([K], dtype=torch.int32)
    out = torch.full((1, M, K), float("nan"), dtype=dtype)  # poisoned: unwritten entries fail
    trimmed_head(x, w, idx, count, out=out)
    assert_close_rel(out, trimmed_head_reference(x, w, idx, count), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_count_is_honoured_per_group(dtype):
    x, w, idx = _inputs(3, 5, 200, 65, dtype, cap=200)
    count = torch.tensor([200, 77, 1], dtype=torch.int64)
    out = torch.full((3, 5, 200), float("nan"), dtype=dtype)
    trimmed_head(x, w, idx, count, out=out, fill_tail=False)
    for g, n in enumerate(count.tolist()):
        assert torch.isnan(out[g, :, n:]).all(), "entries past the count were written"
        assert not torch.isnan(out[g, :, :n]).any(), "entries before the count were not written"
    ref = trimmed_head_reference(x, w, idx, count, fill_tail=False, out=out.clone())
    assert_close_rel(out.nan_to_num(nan=-1e30), ref.nan_to_num(nan=-1e30), dtype)
    filled = trimmed_head(x, w, idx, count)
    assert torch.isneginf(filled[1, :, 77:]).all() and torch.isneginf(filled[2, :, 1:]).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_scale_softcap(dtype):
    x, w, idx = _inputs(2, 3, 129, 70, dtype)
    bias = torch.randn(w.shape[0]).to(dtype)
    count = torch.tensor([129, 100])
    out = trimmed_head(x, w, idx, count, bias, scale=1.7, softcap=2.5)
    ref = trimmed_head_reference(x, w, idx, count, bias, scale=1.7, softcap=2.5)
    assert_close_rel(out, ref, dtype)
    active = out[0].float()
    assert active.abs().max() < 2.5 and active.abs().max() > 1.0  # the cap bit, and did not zero


@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_writes_only_active_columns(dtype):
    x, w, idx = _inputs(2, 3, 300, 64, dtype, V=997)
    count = torch.tensor([300, 41])
    out = torch.full((2, 3, 997), float("-inf"), dtype=dtype)
    trimmed_head(x, w, idx, count, out=out, scatter=True)
    ref = torch.full_like(out, float("-inf"))
    trimmed_head_reference(x, w, idx, count, out=ref, scatter=True)
    assert_close_rel(out, ref, dtype)
    assert torch.isfinite(out[1]).sum() == 3 * 41
