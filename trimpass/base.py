"""The bottom of trimpass: what the kernels, the head ops and the dynamic vocabulary share, and
nothing of trimpass imported. Which kernel a head call runs (``use_kernel``, ``use_triton``), the
thread count of small CPU ops (``threads``, ``filled``), and the math applied to logits
(``softcap``, ``softmax_max``)."""
from __future__ import annotations

import contextlib
import os

import torch

_kernel_choice = os.environ.get("TRIMPASS_KERNEL", "auto")


@contextlib.contextmanager
def use_kernel(choice: str):
    """Force ``"triton"`` or ``"torch"`` (or ``"auto"``) for calls inside the block."""
    global _kernel_choice
    if choice not in ("auto", "triton", "torch"):
        raise ValueError(f"use_kernel: choice must be 'auto', 'triton' or 'torch', got {choice!r}")
    old, _kernel_choice = _kernel_choice, choice
    try:
        yield
    finally:
        _kernel_choice = old


def use_triton(x: torch.Tensor) -> bool:
    """Whether a call on ``x`` runs the Triton kernel (CUDA, or forced by ``use_kernel``)."""
    if _kernel_choice == "auto":
        return x.is_cuda
    if _kernel_choice == "triton" and not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the Triton kernel on CPU tensors needs TRITON_INTERPRET=1 set before "
                           "triton is imported; unset TRIMPASS_KERNEL to use the CPU path")
    return _kernel_choice == "triton"


def softcap(z: torch.Tensor, cap: float, inplace: bool = False) -> torch.Tensor:
    """Soft-capping, ``cap * tanh(z / cap)`` (Gemma's final-logit capping); ``cap = 0`` returns
    ``z`` as it is. trimpass's one definition: the ops, the kernel's reference and the tests."""
    if not cap:
        return z
    if inplace:
        return z.div_(cap).tanh_().mul_(cap)
    return torch.tanh(z / cap) * cap


class threads:
    """Run the block with ``n`` torch threads (CPU), then restore the count. Small CPU ops run on
    one thread on purpose: on a busy 2-core CPU an OpenMP region waits for a descheduled worker
    (measured: a V-sized fill took up to 8 ms, against 14 us on one thread). A class, not a
    generator: it sits on the head's hot path, where contextlib's wrapper costs 1.5 us a call."""
    __slots__ = ("n", "before")

    def __init__(self, n: int):
        self.n = n

    def __enter__(self) -> None:
        self.before = torch.get_num_threads()
        if self.n != self.before:
            torch.set_num_threads(self.n)

    def __exit__(self, *exc) -> None:
        if self.n != self.before:
            torch.set_num_threads(self.before)


def filled(shape, fill: float, like: torch.Tensor) -> torch.Tensor:
    """A new tensor of ``shape`` holding ``fill``, with ``like``'s dtype and device (on CPU, on one
    thread: a V-sized row is too little work to share)."""
    out = torch.empty(shape, dtype=like.dtype, device=like.device)
    if out.device.type != "cpu":
        return out.fill_(fill)
    with threads(1):
        return out.fill_(fill)


def softmax_max(z: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The softmax's largest probability along ``dim``, in float32 (a drafter's confidence in its
    greedy token)."""
    return torch.softmax(z, dim=dim, dtype=torch.float32).amax(dim=dim)
