"""What a vLLM worker's trimming holds and where an operator reads it: :func:`memory` measures the
index state and the shared compact copy against their stated bounds, and :class:`Report` writes the
worker's counters to ``<stats_dir>/trimpass-worker-<pid>.json`` (the ``stats_dir`` setting) after
every step whose live rows changed, and at most every ``Report.interval`` seconds otherwise, so the
file reads 0 live rows once the load has drained. Each write replaces the file whole."""
from __future__ import annotations

import json
import os
import time

import torch

from trimpass import compact
from trimpass.serving.head import MAX_UNION


def memory(trimmer) -> dict:
    """Bytes now held against each bound: ``state_bytes`` (every tensor of the drafter's
    :class:`~trimpass.dynamic.state.ActiveState`, its policies' included) against
    ``state_bound`` = ``max_rows`` x ``bytes_per_row`` + ``drafter_bytes`` (the drafter-wide
    tensors: the learned core's counts, its ids, the successor table, three scalars), and
    ``compact_bytes`` (every compact copy in this process, oneDNN's packed copies counted apart in
    ``packed_bytes``) against ``compact_bound`` (``MAX_UNION`` rows of the head and their packed
    copy). The vLLM route has no escape path, hence no escape proxy."""
    st, W = trimmer.state, trimmer.head.weight
    held = compact.held_bytes()
    out = {"compact_bytes": held["rows"] + held["packed"], "packed_bytes": held["packed"],
           "compact_bound": 2 * MAX_UNION * W.shape[1] * W.element_size() + MAX_UNION * 8}
    if st is None:
        return {**out, "state_bytes": 0, "state_bound": 0, "drafter_bytes": 0}
    s = st.settings
    tensors = [v for v in vars(st).values() if isinstance(v, torch.Tensor)]
    tensors += [v for p in st.policies for v in vars(p).values() if isinstance(v, torch.Tensor)]
    wide = 4 * st.V + 8 * int(st.learned.numel()) + 3 * 8 + 4 * (st.V + 1) * s.successors
    return {**out, "state_bytes": sum(compact.nbytes(t) for t in tensors), "drafter_bytes": wide,
            "state_bound": s.max_rows * st.bytes_per_row() + wide}


class Report:
    """The worker's stats file (None: no file), with high-water marks of the bytes held."""

    interval = 1.0

    def __init__(self, stats_dir: str | None, rank: int = 0):
        self.path = None
        if stats_dir:
            os.makedirs(stats_dir, exist_ok=True)
            self.path = os.path.join(stats_dir, f"trimpass-worker-{os.getpid()}.json")
        self.rank = rank
        self.high: dict = {}
        self._last, self._rows = 0.0, None

    def write(self, trimmer) -> None:
        if self.path is None:
            return
        rows = trimmer.rows.live
        if rows == self._rows and time.monotonic() - self._last < self.interval:
            return
        s = {k: v for k, v in trimmer.stats().items() if k != "seen"}
        for k in ("state_bytes", "compact_bytes", "packed_bytes", "rows"):
            self.high[k] = max(self.high.get(k, 0), s[k])
        s.update({f"peak_{k}": v for k, v in self.high.items()}, pid=os.getpid(), rank=self.rank,
                 time=time.time())
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(s, f)
        os.replace(tmp, self.path)  # a reader never sees half a file
        self._last, self._rows = time.monotonic(), rows
