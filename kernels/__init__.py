"""Triton kernels of trimpass, installed as ``trimpass.kernels``.

Each file holds, in order: kernel(s), autotune configs, launcher, pure-torch reference."""
