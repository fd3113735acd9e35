"""The dtype a device runs speculative decoding fastest in, and why. On CUDA, bf16. On a CPU, bf16
only where its products of several rows are native: with AMX or AVX-512 BF16 a verification of 5
rows costs about what one row does, while without them (AVX2) oneDNN emulates bf16 and several-row
products run slower than in fp32 (the real Gemma-3-270M's fused loop measured x1.22 the plain
target in bf16 against x4.52 in fp32 on such a CPU). A CPU whose flags show neither is measured:
a several-row bf16 product no slower than fp32's keeps bf16. ``ONEDNN_MAX_CPU_ISA`` set below
AVX512_CORE_BF16 hides the native path from oneDNN, so the flags are not trusted then. The demo
and the benches take ``--dtype auto`` (their default) through :func:`resolve` and :func:`settle`."""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

NATIVE_BF16 = {"amx_bf16": "AMX-BF16", "avx512_bf16": "AVX-512 BF16"}
# oneDNN's ISA caps (ONEDNN_MAX_CPU_ISA) that still include a native bf16 dot product
BF16_ISAS = ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16",
             "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512",
             "AVX10_2_512_AMX_2", "ALL", "DEFAULT", "")
NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32,
         "float32": torch.float32}


@dataclass(frozen=True)
class Choice:
    dtype: torch.dtype
    why: str
    native_bf16: bool  # bf16 products of several rows run natively (or measured no slower)

    @property
    def name(self) -> str:
        return "bf16" if self.dtype == torch.bfloat16 else "fp32"


def several_rows_ms(rows: int = 8, d: int = 640, n: int = 2048, reps: int = 20) -> tuple:
    """(bf16 ms, fp32 ms): the best of ``reps`` ``[rows, d] @ [n, d]^T`` products, one thread,
    about 50 ms in all (a verification's shape at Gemma-3-270M's width)."""
    def best(dtype) -> float:
        x, w = torch.randn(rows, d, dtype=dtype), torch.randn(n, d, dtype=dtype)
        torch.nn.functional.linear(x, w)
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            torch.nn.functional.linear(x, w)
            times.append(time.perf_counter() - t)
        return 1e3 * min(times)

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return best(torch.bfloat16), best(torch.float32)
    finally:
        torch.set_num_threads(before)


def fast(device: str | torch.device = "cpu", capabilities: dict | None = None,
         measure: Callable[[], tuple] = several_rows_ms, isa: str | None = None) -> Choice:
    """The dtype ``device`` runs speculative decoding fastest in. ``capabilities``: the CPU's
    flags (default ``torch.cpu.get_capabilities()``); ``measure``: ``() -> (bf16 ms, fp32 ms)``
    of a several-row product, called only when the flags do not decide; ``isa``: oneDNN's cap
    (default ``$ONEDNN_MAX_CPU_ISA``)."""
    if torch.device(device).type == "cuda":
        return Choice(torch.bfloat16, "CUDA: bf16 tensor cores", True)
    caps = torch.cpu.get_capabilities() if capabilities is None else capabilities
    native = [label for flag, label in NATIVE_BF16.items() if caps.get(flag)]
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "") if isa is None else isa
    capped = isa.upper() not in BF16_ISAS
    if native and not capped:
        return Choice(torch.bfloat16, f"this CPU has native bf16 ({', '.join(native)})", True)
    if native:
        flags = f"native bf16 ({', '.join(native)}) capped by ONEDNN_MAX_CPU_ISA={isa}"
    else:
        flags = "no native bf16 (neither AMX-BF16 nor AVX-512 BF16)"
    bf16_ms, fp32_ms = measure()
    seen = f"an 8-row bf16 product took {bf16_ms:.3f} ms against {fp32_ms:.3f} in fp32"
    if bf16_ms <= fp32_ms:
        return Choice(torch.bfloat16, f"{flags}, but {seen}", True)
    return Choice(torch.float32, f"{flags}: several-row bf16 products are emulated ({seen}, "
                  f"x{bf16_ms / fp32_ms:.1f})", False)


def resolve(name: str, device: str | torch.device = "cpu",
            choice: Callable[..., Choice] = fast) -> tuple[torch.dtype, str, str | None]:
    """``--dtype NAME`` (``auto``, ``bf16``/``bfloat16`` or ``fp32``/``float32``) on ``device``:
    (the dtype, a line saying which and why, a warning or None). An explicit bf16 on a CPU without
    native bf16 runs, with a warning naming the slow path and the faster fp32."""
    if name != "auto" and name not in NAMES:
        raise ValueError(f"--dtype: expected auto, bf16 or fp32, got {name!r}")
    if name != "auto" and NAMES[name] == torch.float32:
        return torch.float32, "dtype fp32 (--dtype)", None
    best = choice(device)
    if name == "auto":
        return best.dtype, f"dtype {best.name} (auto: {best.why}; --dtype overrides)", None
    warning = None if best.native_bf16 else (
        f"--dtype bf16 on this CPU takes the slow path: {best.why}; --dtype fp32 (the default "
        "here) is faster")
    return torch.bfloat16, "dtype bf16 (--dtype)", warning


def settle(args, device: str | torch.device = "cpu", spelled: tuple = ("bf16", "fp32"),
           choice: Callable[..., Choice] = fast) -> torch.dtype:
    """A bench's ``args.dtype`` resolved in place to the concrete name (``spelled``: how the bench
    writes bf16 and fp32), so its file names and titles say which ran; prints which and why, and
    the warning on stderr. Returns the dtype."""
    dtype, why, warning = resolve(args.dtype, device, choice)
    print(why, flush=True)
    if warning:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    args.dtype = spelled[0] if dtype == torch.bfloat16 else spelled[1]
    return dtype
