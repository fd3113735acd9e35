"""The Triton trimmed-head kernel against its pure-torch reference: under TRITON_INTERPRET=1 on CPU
tensors (CI), or on a CUDA device when run with TRITON_INTERPRET=0 where one is present."""
import os

import pytest
import torch

from tests.conftest import assert_close_rel
from trimpass.kernels.trimmed_head import (
    CONFIGS,
    prune_configs,
    trimmed_head,
    trimmed_head_reference,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available() \
    else "cuda"


def _inputs(G, M, K, d, dtype, V=1531, cap=None, gen=None):
    cap = cap or K
    x = torch.randn(G, M, d, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(V, d, generator=gen) / d**0.5).to(DEVICE, dtype)
    idx = torch.stack([torch.randperm(V, generator=gen)[:cap] for _ in range(G)]).to(DEVICE)
    return x, w, idx


def _t(values, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def _nan(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def _assert_matches(out, ref, dtype):
    """NaN (the poison: never written) exactly where the reference has it; the rest close."""
    assert torch.equal(torch.isnan(out), torch.isnan(ref)), "written / unwritten entries differ"
    inf = float("inf")
    assert_close_rel(out.nan_to_num(0.0, inf, -inf), ref.nan_to_num(0.0, inf, -inf), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "m{BLOCK_M}k{BLOCK_K}d{BLOCK_D}".format(
    **c.kwargs) + f"w{c.num_warps}s{c.num_stages}")
def test_every_config_matches_reference(config, dtype):
    """Each autotune config, pinned, on fresh inputs sized to leave a partial block on every axis:
    two row blocks, a full group and one whose count ends inside the first block of ids (so whole
    programs start past the count), a hidden size that ends inside a block; bias, scale, softcap."""
    bm, bk, bd = (config.kwargs[k] for k in ("BLOCK_M", "BLOCK_K", "BLOCK_D"))
    gen = torch.Generator().manual_seed(bm * 7919 + bk * 31 + bd + 3 * DTYPES.index(dtype))
    R, CAP, d = bm + 3, bk + 5, bd + 7
    x, w, idx = _inputs(2, R, CAP, d, dtype, gen=gen)
    bias = torch.randn(w.shape[0], generator=gen).to(DEVICE, dtype)
    count = _t([CAP, bk - 3], torch.int32)
    kw = dict(scale=0.9, softcap=3.0)

    def run(**mode):
        shape = (2, R, w.shape[0]) if mode.get("scatter") else (2, R, CAP)
        out = _nan(shape, dtype)  # poisoned: unwritten entries stay NaN
        trimmed_head(x, w, idx, count, bias, **kw, **mode, out=out, config=config)
        ref = trimmed_head_reference(x, w, idx, count, bias, **kw, **mode, out=torch.full_like(
            out, float("nan")))
        _assert_matches(out, ref, dtype)
        return out

    filled = run()
    assert torch.isneginf(filled[1, :, bk - 3:]).all()
    assert torch.isnan(run(fill_tail=False)[1, :, bk - 3:]).all(), "wrote past the count"
    scattered = run(scatter=True)
    assert (~torch.isnan(scattered[1])).sum() == R * (bk - 3), "scatter wrote an inactive column"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [63, 640])
@pytest.mark.parametrize("K", [1, 127, 1000])
@pytest.mark.parametrize("M", [1, 3, 7])
def test_compact_matches_reference(M, K, d, dtype):
    x, w, idx = _inputs(1, M, K, d, dtype)
    count = _t([K], torch.int32)
    out = _nan((1, M, K), dtype)  # poisoned: unwritten entries fail
    trimmed_head(x, w, idx, count, out=out)
    assert_close_rel(out, trimmed_head_reference(x, w, idx, count), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_count_is_honoured_per_group(dtype):
    x, w, idx = _inputs(3, 5, 200, 65, dtype, cap=200)
    count = _t([200, 77, 1])
    out = _nan((3, 5, 200), dtype)
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
    bias = torch.randn(w.shape[0]).to(DEVICE, dtype)
    count = _t([129, 100])
    out = trimmed_head(x, w, idx, count, bias, scale=1.7, softcap=2.5)
    ref = trimmed_head_reference(x, w, idx, count, bias, scale=1.7, softcap=2.5)
    assert_close_rel(out, ref, dtype)
    active = out[0].float()
    assert active.abs().max() < 2.5 and active.abs().max() > 1.0  # the cap bit, and did not zero


@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_writes_only_active_columns(dtype):
    x, w, idx = _inputs(2, 3, 300, 64, dtype, V=997)
    count = _t([300, 41])
    out = torch.full((2, 3, 997), float("-inf"), dtype=dtype, device=DEVICE)
    trimmed_head(x, w, idx, count, out=out, scatter=True)
    ref = torch.full_like(out, float("-inf"))
    trimmed_head_reference(x, w, idx, count, out=ref, scatter=True)
    assert_close_rel(out, ref, dtype)
    assert torch.isfinite(out[1]).sum() == 3 * 41


def _kept(rows, dtype):
    bucket = 1 << max(0, rows - 1).bit_length()
    return prune_configs(CONFIGS, {"M_BUCKET": bucket, "x_ptr": torch.empty(0, dtype=dtype)})


def _tf32(t):
    """``t`` with its float32 mantissas cut to TF32's 10 bits."""
    return (t.view(torch.int32) & ~0x1FFF).view(torch.float32)


@pytest.mark.parametrize("M", [1, 20])
def test_fp32_logits_are_fp32_exact_not_tf32(M):
    """Every config the autotuner may pick for fp32 matches a float64 reference to 1e-5 of the
    largest logit (sums of fp32 products; d = 1,024). The control shows the bound separates: the
    same logits from TF32-rounded operands miss it (NVIDIA's default for an fp32 tl.dot)."""
    gen = torch.Generator().manual_seed(M)
    x, w, idx = _inputs(1, M, 64, 1024, torch.float32, V=500, gen=gen)
    count = _t([64], torch.int32)
    exact = x[0].double() @ w[idx[0]].double().T

    def err(z):
        return float((z.double() - exact).abs().max() / exact.abs().max())

    assert err(_tf32(x[0]) @ _tf32(w[idx[0]]).T) > 1e-5, "control: TF32 passes the bound"
    for config in _kept(M, torch.float32):
        out = trimmed_head(x, w, idx, count, config=config)
        assert err(out[0]) < 1e-5, f"{config}: relative error {err(out[0]):.1e}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 4, 16])
def test_one_request_keeps_every_sm_of_an_h200_working(M, dtype):
    """One request (one id group) with 3,000 live ids: every config the autotuner may pick for
    up to 16 rows gives at least 132 programs (an H200's SMs) work, not just a grid that size
    (programs past the count exit at once)."""
    for c in _kept(M, dtype):
        working = -(-3000 // c.kwargs["BLOCK_K"]) * -(-M // c.kwargs["BLOCK_M"])
        assert working >= 132, f"{c}: {working} working programs at K = 3,000, M = {M}"


def test_every_config_can_be_picked():
    """No dead entry in CONFIGS: each is kept for some row count and dtype."""
    kept = {str(c) for M in (1, 2, 16, 32, 64, 128) for dt in DTYPES for c in _kept(M, dt)}
    assert [str(c) for c in CONFIGS if str(c) not in kept] == []


def test_a_hot_launch_skips_checks_and_tuner_and_matches_reference(monkeypatch):
    """The second launch of one signature goes straight to the config the tuner picked; a launch
    of another signature (here more rows) is checked and tuned again."""
    from trimpass.kernels import trimmed_head as th
    gen = torch.Generator().manual_seed(11)
    x, w, idx = _inputs(1, 3, 37, 45, torch.float32, gen=gen)
    count = _t([29], torch.int32)
    th.trimmed_head(x, w, idx, count, out=_nan((1, 3, 37), torch.float32))  # checked, tuned
    tuned, checks = [], []
    tune, check = th._tuned_launch, th.check_launch
    monkeypatch.setattr(th, "_tuned_launch", lambda grid, *a: tuned.append(grid) or tune(grid, *a))
    monkeypatch.setattr(th, "check_launch", lambda *a: checks.append(a) or check(*a))
    for _ in range(2):
        out = _nan((1, 3, 37), torch.float32)
        th.trimmed_head(x, w, idx, count, out=out)
        _assert_matches(out, trimmed_head_reference(x, w, idx, count), torch.float32)
    assert tuned == [] and checks == []
    x5 = torch.randn(1, 5, 45, generator=gen).to(DEVICE)
    _assert_matches(th.trimmed_head(x5, w, idx, count),
                    trimmed_head_reference(x5, w, idx, count), torch.float32)
    assert len(tuned) == 1 and len(checks) == 1
