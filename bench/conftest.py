"""Benchmark set-up. ``TRIMPASS_BENCH=full`` runs the real drafter shapes; the default is a tiny
smoke set, which is what CI runs (with ``--benchmark-disable``) so the suite cannot rot."""
import os

FULL = os.environ.get("TRIMPASS_BENCH") == "full"
os.environ.setdefault("TRITON_INTERPRET", "0" if FULL else "1")
