"""Triton kernels of trimpass, installed as ``trimpass.kernels``.

Each file holds, in order: kernel(s), autotune configs, launcher, pure-torch reference. Their GPU
builds are checked ahead of time for sm_80 and sm_90 (``python -m trimpass.testing.gpu_build``)
with triton :data:`TRITON_FLOOR` and newer; a launcher refuses an older triton (and, under the
interpreter, a triton whose interpreter cannot run with the installed numpy) before launching."""
from __future__ import annotations

import functools
import os
import re

import triton

TRITON_FLOOR = (3, 6)


@functools.lru_cache(maxsize=8)
def _release(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3])


def require_triton(version: str | None = None, numpy_version: str | None = None,
                   interpret: bool | None = None) -> None:
    """Raise ``RuntimeError`` naming the version when the installed triton (or ``version``) is
    older than :data:`TRITON_FLOOR`, or, under the interpreter (``TRITON_INTERPRET=1``), when
    triton < 3.8 meets numpy >= 2.4: triton 3.6's interpreter turns 1-element arrays into ints,
    which numpy 2.4 refuses (checked: triton 3.6.0 fails with numpy 2.4.6 and runs with 2.3.5;
    3.8.0 runs with 2.4.6)."""
    version = triton.__version__ if version is None else version
    if _release(version) < TRITON_FLOOR:
        floor = ".".join(map(str, TRITON_FLOOR))
        raise RuntimeError(f"triton {version} is older than {floor}, the oldest triton whose GPU "
                           f"builds of trimpass's kernels are checked; pip install "
                           f"'triton>={floor}'")
    if interpret is None:
        interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if not interpret or _release(version) >= (3, 8):
        return
    if numpy_version is None:
        import numpy
        numpy_version = numpy.__version__
    if _release(numpy_version) >= (2, 4):
        raise RuntimeError(f"under TRITON_INTERPRET=1, triton {version} cannot run with numpy "
                           f"{numpy_version} (its interpreter turns 1-element arrays into ints, "
                           "which numpy 2.4 refuses); pip install 'triton>=3.8' or 'numpy<2.4'")
