"""Progress bars for long work (counting, loading, timing), quiet when output is not a terminal."""
from __future__ import annotations

import sys

from tqdm.auto import tqdm


def progress(iterable=None, desc: str = "", total: int | None = None, **kw):
    """A tqdm bar on stderr; off when stderr is not a terminal, unless ``TRIMPASS_PROGRESS=1``."""
    import os
    disable = not (sys.stderr.isatty() or os.environ.get("TRIMPASS_PROGRESS") == "1")
    return tqdm(iterable, desc=desc, total=total, disable=disable, leave=False, **kw)
