"""Proof that a trimmed head ran: a drafter's calls counted against the trimmed head ops.

A lossless loop stays lossless whatever its drafter computes (greedy verification keeps only what
the target would emit), so a lossless test proves nothing about trimming unless it also checks that
every drafter call it made ran a trimmed head op. :func:`head_runs` counts both over a block::

    with head_runs(draft) as runs:
        out = loop(target, draft, ...)
    runs.check()  # every drafter call ran exactly one trimmed head op, and there was a call

With ``TRIMPASS_DISABLE=1`` (the pass off) no trimmed op runs, and ``check`` fails.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from trimpass import ops
from trimpass.measure import time_calls

HEAD_OPS = ("head_full", "head_compact", "head_topk")  # every op that computes a trimmed head


def head_ops() -> int:
    """Trimmed head ops run so far in this process (all drafters)."""
    return sum(ops.calls[k] for k in HEAD_OPS)


@dataclass
class HeadRuns:
    calls: int = 0  # calls of the drafter module
    head_ops: int = 0  # trimmed head ops run meanwhile

    def check(self, heads_per_call: int = 1) -> None:
        """Every drafter call ran ``heads_per_call`` trimmed head ops (its heads), and at least
        one call was made."""
        assert self.calls > 0, "the drafter was never called"
        assert self.head_ops == heads_per_call * self.calls, (
            f"the trimmed head ran {self.head_ops} times over {self.calls} drafter calls "
            f"(expected {heads_per_call} per call): the drafter ran untrimmed")


@contextlib.contextmanager
def head_runs(draft: torch.nn.Module) -> Iterator[HeadRuns]:
    """Count ``draft``'s calls (whoever makes them: a loop, HF ``generate``) and the trimmed head
    ops run inside the block; the counts are filled in when the block ends."""
    runs = HeadRuns()
    before = head_ops()
    with time_calls(draft) as watch:
        try:
            yield runs
        finally:
            runs.calls, runs.head_ops = watch.calls, head_ops() - before
