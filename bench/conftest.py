"""Benchmark set-up. ``TRIMPASS_BENCH=full`` runs the real drafter shapes; the default is a tiny smoke
set, which is what CI runs (with ``--benchmark-disable``) so the suite cannot rot."""
import os

os.environ.setdefault("TRITON_INTERPRET", "0" if os.environ.get("TRIMPASS_BENCH") == "full" else "1")
