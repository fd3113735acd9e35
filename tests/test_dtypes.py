"""The dtype choice over given CPU flags: native bf16 (AMX or AVX-512 BF16) picks bf16 without
measuring; without it, a several-row bf16 product measured slower than fp32 picks fp32 and one no
slower keeps bf16; oneDNN capped below bf16 is not trusted; CUDA keeps bf16; ``--dtype`` overrides,
with a warning for bf16 on a CPU without native bf16."""
import pytest
import torch

from trimpass import dtypes

AVX2 = {"avx2": True, "avx512_f": False, "avx512_bf16": False, "amx_bf16": False}


def _never():
    raise AssertionError("measured although the flags decide")


@pytest.mark.parametrize("flag,label", [("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX-512 BF16")])
def test_native_bf16_picks_bf16_without_measuring(flag, label):
    c = dtypes.fast("cpu", {**AVX2, flag: True}, measure=_never, isa="")
    assert c.dtype == torch.bfloat16 and c.native_bf16 and label in c.why


def test_without_native_bf16_an_emulated_product_picks_fp32():
    c = dtypes.fast("cpu", AVX2, measure=lambda: (0.9, 0.3), isa="")
    assert c.dtype == torch.float32 and not c.native_bf16
    assert "no native bf16" in c.why and "x3.0" in c.why


def test_without_native_bf16_a_product_no_slower_keeps_bf16():
    c = dtypes.fast("cpu", AVX2, measure=lambda: (0.3, 0.3), isa="")
    assert c.dtype == torch.bfloat16 and "but an 8-row bf16 product" in c.why


def test_onednn_capped_below_bf16_is_measured_not_trusted():
    flags = {**AVX2, "avx512_bf16": True}
    c = dtypes.fast("cpu", flags, measure=lambda: (0.8, 0.3), isa="avx2")
    assert c.dtype == torch.float32 and "capped by ONEDNN_MAX_CPU_ISA=avx2" in c.why
    assert dtypes.fast("cpu", flags, measure=_never, isa="AVX512_CORE_AMX").dtype == torch.bfloat16


def test_cuda_keeps_bf16():
    assert dtypes.fast("cuda", AVX2, measure=_never).dtype == torch.bfloat16


def test_resolve_auto_explicit_and_the_warning():
    slow = lambda device: dtypes.fast(device, AVX2, measure=lambda: (0.9, 0.3), isa="")  # noqa
    dtype, line, warning = dtypes.resolve("auto", "cpu", slow)
    assert dtype == torch.float32 and line.startswith("dtype fp32 (auto: no native bf16")
    assert warning is None
    dtype, line, warning = dtypes.resolve("bf16", "cpu", slow)
    assert dtype == torch.bfloat16 and "slow path" in warning and "--dtype fp32" in warning
    assert dtypes.resolve("fp32", "cpu", slow)[0] == torch.float32
    native = lambda device: dtypes.fast(device, {**AVX2, "amx_bf16": True}, _never, "")  # noqa
    assert dtypes.resolve("bfloat16", "cpu", native)[2] is None
    with pytest.raises(ValueError, match="--dtype: expected auto, bf16 or fp32, got 'fp16'"):
        dtypes.resolve("fp16", "cpu", native)


def test_the_measurement_times_both_dtypes():
    bf16_ms, fp32_ms = dtypes.several_rows_ms(reps=2)
    assert bf16_ms > 0 and fp32_ms > 0
