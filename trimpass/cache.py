"""Where trimpass keeps what it computes once: token counts, cost curves, the assembled GGUF."""
from __future__ import annotations

import os


def cache_dir() -> str:
    """``$TRIMPASS_CACHE``, else ``~/.cache/trimpass``."""
    return os.environ.get("TRIMPASS_CACHE", os.path.join(os.path.expanduser("~"), ".cache",
                                                         "trimpass"))
