"""The thin Dynamo backend: run the pass on each captured graph, then hand it to the inner compiler.

Every graph a :class:`TrimBackend` compiles (prefill, decode, recompiles, the pieces around a graph
break) is rewritten with the same configuration; in the dynamic mode, the graphs of one drafter
share that drafter's device-resident state, and no two drafters share one. ``TRIMPASS_DISABLE=1``
turns every backend into a plain pass-through to its inner compiler. A graph that nothing matched
is compiled unchanged, with one warning that says why.
"""
from __future__ import annotations

import logging
import warnings
import weakref

import torch

from trimpass.config import TrimConfig, TrimpassError, disabled
from trimpass.graph.index import DynamicIndex
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
    """A configured trimpass backend for ``torch.compile(..., backend=...)``.

    In the dynamic mode each drafter it compiles gets its own :class:`ActiveState`. Dynamo shares
    one compiled graph between instances of a module class with the same shapes; a graph names its
    drafter's state, so the backend makes Dynamo keep one graph per drafter instance (an identity
    guard on the method's receiver). That is also what CUDA-graph replay needs: a captured graph
    replays the addresses of the state it was captured with.
    """

    __name__ = "trimpass"

    def __init__(self, config: TrimConfig | None = None):
        self.config = config or TrimConfig()
        self.reports = []
        self._states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._unowned = None  # the state of a compiled function that is no module's method

    def state_for(self, drafter, create: bool = False):
        """The dynamic-vocabulary state of ``drafter`` (``None`` for a plain function)."""
        if not self.config.dynamic:
            return None
        from trimpass.dynamic.state import ActiveState
        if drafter is None:
            if self._unowned is None and create:
                self._unowned = ActiveState(self.config.settings)
            return self._unowned
        if drafter not in self._states and create:
            self._states[drafter] = ActiveState(self.config.settings)
        return self._states.get(drafter)

    @property
    def state(self):
        """The state of the only drafter this backend compiled, if exactly one (else ``None``)."""
        states = list(self._states.values()) + ([self._unowned] if self._unowned else [])
        return states[0] if len(states) == 1 else None

    def __call__(self, gm, example_inputs, mode=None, options=None, **kwargs):
        mode = mode if mode is not None else self.config.mode
        options = options if options is not None else self.config.options
        if disabled():
            return compile_inner(gm, example_inputs, self.config.inner, mode, options)
        drafter = _current_drafter()
        if drafter is not None:  # the latest backend compiling it is what explain/stats/observe see
            drafter._trimpass_backend = self
        index = None
        if self.config.dynamic:
            index = DynamicIndex(self.state_for(drafter, create=True))
            if drafter is not None:
                _guard_on_receiver()
        new = rewrite(gm, self.config, example_inputs, index=index)
        report = new.meta["trimpass"]
        self.reports.append(report)
        if report.rewritten:
            log.info("trimpass rewrote graph:\n%s", report)
        else:
            why = "; ".join(f"{n}: {r}" for n, r in report.skipped) or report.note
            what = ("rewrote no head in a graph (its token lookups still admit ids)"
                    if new is not gm else "left a graph unchanged")
            warnings.warn(f"trimpass {what}: {why}", TrimpassWarning, stacklevel=2)
        return compile_inner(new, example_inputs, self.config.inner, mode, options)

    def explain(self) -> str:
        """What was rewritten and skipped in each graph compiled so far."""
        if not self.reports:
            return "trimpass: nothing compiled yet (call the compiled drafter once)"
        return "\n".join(f"graph {i}: {r}" for i, r in enumerate(self.reports))


_per_drafter: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_fallback = {}


def _frame():
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        tx = InstructionTranslator.current_tx()
    except Exception:  # noqa: BLE001 - internals moved
        return None, None
    code = tx.f_code if tx is not None else None
    names = code.co_varnames[:code.co_argcount] if code is not None else ()
    if code is not None and code.co_name.startswith("torch_dynamo_resume_in_"):
        # the piece after a graph break: Dynamo passes its stack (``___stack0``, ...) and nested
        # frames first, then the live locals under their own names, the receiver first if live
        names = [n for n in names if not n.startswith("__")]
    return tx, (names[0] if names else None)


def _current_drafter():
    """The module whose frame Dynamo is compiling, when it is a module's method."""
    tx, first = _frame()
    owner = tx.f_locals.get(first) if tx is not None and first else None  # the receiver
    return owner if isinstance(owner, torch.nn.Module) else None


def _guard_on_receiver() -> None:
    """Make the graph being compiled valid for this very receiver only (an ID_MATCH guard)."""
    tx, first = _frame()
    try:
        from torch._dynamo.guards import GuardBuilder
        from torch._dynamo.source import LocalSource
        from torch._guards import Guard
        tx.output.guards.add(Guard(LocalSource(first), GuardBuilder.ID_MATCH))
    except Exception as e:  # noqa: BLE001 - never share a state silently
        raise TrimpassError(f"trimpass: could not pin the compiled graph to its drafter ({e}); "
                            "this torch version is not supported by the dynamic mode, pass a "
                            "static vocab=") from None


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
