"""The dynamic vocabulary: per-request rows of active ids kept on the device
(:mod:`~trimpass.dynamic.state`), the escape path (:mod:`~trimpass.dynamic.escape`), target
feedback (:mod:`~trimpass.dynamic.feedback`) and the ``torch.library`` ops a rewritten graph calls
(:mod:`~trimpass.dynamic.ops`). It sits below :mod:`trimpass.graph`, whose ``index`` inserts the
ops, and above :mod:`trimpass.ops` and :mod:`trimpass.base`."""
