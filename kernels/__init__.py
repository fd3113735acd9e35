"""Triton kernels of trimpass, installed as ``trimpass.kernels``; each file: kernel, configs, launcher, reference."""
