"""Triton kernels of trimpass, installed as ``trimpass.kernels``.

Each file holds, in order: kernel(s), autotune configs, launcher, pure-torch reference. Their GPU
builds are checked ahead of time for sm_80 and sm_90 (``python -m trimpass.testing.gpu_build``)
with triton :data:`TRITON_FLOOR` and newer; a launcher refuses an older triton before launching."""
from __future__ import annotations

import functools
import re

import triton

TRITON_FLOOR = (3, 6)


@functools.lru_cache(maxsize=8)
def _release(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3])


def require_triton(version: str | None = None) -> None:
    """Raise ``RuntimeError`` naming the version when the installed triton (or ``version``) is
    older than :data:`TRITON_FLOOR`."""
    version = triton.__version__ if version is None else version
    if _release(version) < TRITON_FLOOR:
        floor = ".".join(map(str, TRITON_FLOOR))
        raise RuntimeError(f"triton {version} is older than {floor}, the oldest triton whose GPU "
                           f"builds of trimpass's kernels are checked; pip install "
                           f"'triton>={floor}'")
