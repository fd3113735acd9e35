"""Reference speculative-decoding loops, used by the tests and the benches: chain drafting with
greedy or rejection-sampling verification (:mod:`~trimpass.loops.chain`) and EAGLE-2-style tree
drafting (:mod:`~trimpass.loops.tree`). Both take any ``model(ids) -> logits`` and know nothing
about trimming; both report a :class:`~trimpass.loops.stats.LoopStats`."""
from trimpass.loops.stats import LoopStats

__all__ = ["LoopStats"]
