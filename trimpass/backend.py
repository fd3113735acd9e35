"""The thin Dynamo backend: run the pass on each captured graph, then hand it to the inner compiler.

One :class:`TrimBackend` serves one drafter: every graph compiled for it (prefill, decode,
recompiles, the pieces around a graph break) is rewritten with the same configuration and, in the
dynamic mode, shares one device-resident state. ``TRIMPASS_DISABLE=1`` turns every backend into a
plain pass-through to its inner compiler. A graph that nothing matched is compiled unchanged, with
one warning that says why.
"""
from __future__ import annotations

import logging
import warnings
import weakref

import torch

from trimpass.config import TrimConfig, TrimpassError, disabled
from trimpass.graph.rewrite import rewrite

log = logging.getLogger("trimpass")


class TrimpassWarning(UserWarning):
    """A graph trimpass left unchanged, and why."""


def compile_inner(gm, example_inputs, inner, mode=None, options=None):
    """Compile ``gm`` with the inner compiler, forwarding inductor's ``mode`` / ``options``."""
    if callable(inner):
        return inner(gm, example_inputs)
    if inner == "inductor":
        return torch._TorchCompileInductorWrapper(mode, options, None)(gm, example_inputs)
    return torch._dynamo.lookup_backend(inner)(gm, example_inputs)


class TrimBackend:
    """A configured trimpass backend for ``torch.compile(..., backend=...)``."""

    __name__ = "trimpass"

    def __init__(self, config: TrimConfig | None = None):
        self.config = config or TrimConfig()
        self.reports = []
        self.state = None  # the dynamic mode's device-resident state, made on first use

    def _index(self):
        if not self.config.dynamic:
            return None
        from trimpass.graph.dynamic import DynamicIndex
        if self.state is None:
            from trimpass.state import ActiveState
            self.state = ActiveState(self.config)
        return DynamicIndex(self.state)

    def __call__(self, gm, example_inputs, mode=None, options=None, **kwargs):
        mode = mode if mode is not None else self.config.mode
        options = options if options is not None else self.config.options
        if disabled():
            return compile_inner(gm, example_inputs, self.config.inner, mode, options)
        drafter = _current_drafter()
        if drafter is not None:  # the latest backend compiling it is what explain/stats/observe see
            drafter._trimpass_backend = self
        new = rewrite(gm, self.config, example_inputs, index=self._index())
        report = new.meta["trimpass"]
        self.reports.append(report)
        if report.rewritten:
            log.info("trimpass rewrote graph:\n%s", report)
        else:
            why = "; ".join(f"{n}: {r}" for n, r in report.skipped) or report.note
            warnings.warn(f"trimpass left a graph unchanged: {why}", TrimpassWarning, stacklevel=2)
        return compile_inner(new, example_inputs, self.config.inner, mode, options)

    def explain(self) -> str:
        """What was rewritten and skipped in each graph compiled so far."""
        if not self.reports:
            return "trimpass: nothing compiled yet (call the compiled drafter once)"
        return "\n".join(f"graph {i}: {r}" for i, r in enumerate(self.reports))


_per_drafter: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_fallback = {}


def _current_drafter():
    """The module whose frame Dynamo is compiling, when it is a module's method."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        tx = InstructionTranslator.current_tx()
        code = tx.f_code if tx is not None else None
        first = code.co_varnames[0] if code is not None and code.co_argcount else "self"
        owner = tx.f_locals.get(first) if tx is not None else None  # the method's receiver
    except Exception:  # noqa: BLE001 - internals moved: fall back to one shared backend
        owner = None
    return owner if isinstance(owner, torch.nn.Module) else None


def backend_for(drafter) -> TrimBackend:
    """The zero-configuration backend of one drafter (made on first use)."""
    if drafter is None:
        return _fallback.setdefault("shared", TrimBackend())
    got = getattr(drafter, "_trimpass_backend", None) or _per_drafter.get(drafter)
    if got is None:
        got = _per_drafter[drafter] = TrimBackend()
    return got


def dynamo_entry(gm, example_inputs, **kwargs):
    """``torch.compile(draft, backend="trimpass")``: the zero-configuration backend."""
    return backend_for(_current_drafter())(gm, example_inputs, **kwargs)


def make_backend(**kwargs) -> TrimBackend:
    try:
        return TrimBackend(TrimConfig(**kwargs))
    except TypeError as e:
        raise TrimpassError(f"trimpass.backend: {e}; see help(trimpass.TrimConfig)") from None
