"""Progress for long work (counting, loading, timing, compiling): a tqdm bar on a terminal, quiet
when output is not a terminal; and, inside :func:`logged`, a logger's lines on stderr, timestamped
and flushed as each is written, so a log file shows the work as it goes (printed above any bar)."""
from __future__ import annotations

import contextlib
import logging
import os
import sys

from tqdm.auto import tqdm


def progress(iterable=None, desc: str = "", total: int | None = None, **kw):
    """A tqdm bar on stderr; off when stderr is not a terminal, unless ``TRIMPASS_PROGRESS=1``."""
    disable = not (sys.stderr.isatty() or os.environ.get("TRIMPASS_PROGRESS") == "1")
    return tqdm(iterable, desc=desc, total=total, disable=disable, leave=False, **kw)


class _Lines(logging.StreamHandler):
    """A stream handler that writes above any tqdm bar (``tqdm.write``), flushed line by line."""

    def emit(self, record):
        try:
            tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except Exception:
            self.handleError(record)


@contextlib.contextmanager
def logged(name: str, stream=None):
    """Within the block, logger ``name``'s INFO lines go to ``stream`` (default: stderr),
    timestamped, each flushed as it is written; the logger is left as found after."""
    log = logging.getLogger(name)
    handler = _Lines(stream if stream is not None else sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield log
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
