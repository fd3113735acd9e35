"""``TrimConfig``: every user-facing setting of trimpass in one validated dataclass.

Checked in ``__post_init__`` so a bad setting fails where it is written, with a message naming the
argument, not later inside a compiler. A static ``vocab`` selects the static mode; ``vocab=None``
selects the dynamic, context-aware mode (the zero-configuration default). Errors raised while
Dynamo calls the backend use :class:`TrimpassError`, which Dynamo re-raises as it is, so the user
sees trimpass's sentence first rather than a ``BackendCompilerFailed`` wrapper.
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from trimpass.vocab import as_ids, check_ids

OUTPUTS = ("full", "compact")
INNER = ("inductor", "aot_eager", "eager")

try:  # Dynamo re-raises ShortenTraceback subclasses from a backend without wrapping them
    from torch._dynamo.exc import ShortenTraceback as _Passthrough
except ImportError:  # pragma: no cover - older torch
    _Passthrough = Exception


class TrimpassError(_Passthrough, ValueError):
    """A trimpass configuration or input error; its first line says what to do."""

    def __init__(self, msg: str):
        if _Passthrough is Exception:
            super().__init__(msg)
        else:
            super().__init__(msg, first_useful_frame=None)


DYNAMIC_DEFAULTS = dict(capacity=4096, core=None, learn_core=1024, successors=0,
                        refresh_every=0, refresh_topk=64, max_rows=64)
FLAT_ESCAPE = ("escape_rank", "escape_topk", "escape_gate")  # deprecated: use escape=Escape(...)


@dataclass(frozen=True)
class Escape:
    """The escape path's settings (dynamic mode; :mod:`trimpass.dynamic.escape`).

    rank: the rank of its low-rank proxy of the head, which scores every id when the trimmed
        distribution is unsure; must be below the head's width d. Rank 16 took the real
        Gemma-3-270M's greedy agreement from 97.0% to 98.0% for ~240 more head rows a step
        amortized (``bench/results/escape_frontier.md``).
    topk: ids outside the active set that get their exact logits when it fires.
    gate: it fires on a row whose trimmed max probability is below this, in (0, 1).
    slots: the most escaped ids a request row keeps between steps; past it, new ones overwrite
        the row's escaped slots, lowest slot first (at first its earliest escapes; after that the
        same low slots turn over). None: as many as the row's free slots hold.
    """
    rank: int = 16
    topk: int = 64
    gate: float = 0.5
    slots: int | None = 512

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise TrimpassError(f"escape.rank: must be a positive int (escape=None turns the path "
                                f"off), got {self.rank!r}")
        if isinstance(self.topk, bool) or not isinstance(self.topk, int) or self.topk <= 0:
            raise TrimpassError(f"escape.topk: must be a positive int, got {self.topk!r}")
        if isinstance(self.gate, bool) or not isinstance(self.gate, (int, float)) \
                or not 0 < self.gate < 1:
            raise TrimpassError(f"escape.gate: must be a probability in (0, 1), got "
                                f"{self.gate!r}")
        if self.slots is not None and (isinstance(self.slots, bool)
                                       or not isinstance(self.slots, int) or self.slots < 0):
            raise TrimpassError(f"escape.slots: escaped ids a row keeps, an int >= 0 (None: no "
                                f"bound), got {self.slots!r}")


DEFAULT_ESCAPE = Escape()  # TrimConfig's default; told apart from an Escape() the user passes


@dataclass(frozen=True)
class StaticSettings:
    """The static mode: one fixed, checked list of ids (``vocab`` ∪ ``keep``) for every row."""
    ids: torch.Tensor
    keep: torch.Tensor

    def check_vocab_size(self, V: int) -> None:
        _check_max(V, vocab=self.ids, keep=self.keep)

    def index(self, V: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(idx[K], count[1])`` on ``device``: sorted unique ids, ascending rows of W."""
        self.check_vocab_size(V)
        idx = torch.unique(torch.cat([self.ids, self.keep]))
        return idx.to(device), torch.tensor([idx.numel()], dtype=torch.int32, device=device)


@dataclass(frozen=True)
class DynamicSettings:
    """The dynamic mode: per-request rows of ``capacity`` ids (see
    :mod:`trimpass.dynamic.state`)."""
    keep: torch.Tensor
    capacity: int
    core: torch.Tensor | None
    learn_core: int
    successors: int
    refresh_every: int
    refresh_topk: int
    max_rows: int
    escape: Escape | None

    def check_vocab_size(self, V: int) -> None:
        _check_max(V, keep=self.keep, core=self.core)


def _check_max(V: int, **lists) -> None:
    for name, t in lists.items():
        if t is not None and t.numel() and int(t.max()) >= V:
            raise TrimpassError(
                f"{name}: has token id {int(t.max())} but the drafter's head has only {V} rows; "
                "was the list made with another tokenizer?")


@dataclass
class TrimConfig:
    """Settings of a trimpass backend: the front door of both modes.

    A static ``vocab`` selects the static mode; ``vocab=None`` the dynamic, context-aware mode (the
    zero-configuration default). The dynamic-only settings (``capacity``, ``core``,
    ``learn_core``, ``successors``, ``refresh_every``, ``refresh_topk``, ``max_rows``) default to
    ``None`` and take their defaults in the dynamic mode; given with a static ``vocab`` they, and
    ``escape``, are an error, since they would do nothing. :attr:`settings` holds the checked
    settings of the mode.

    vocab: static active vocabulary (list / 1-D tensor of token ids, or a path to a torch-saved
        1-D int64 tensor or dict with key ``ids``); ``None`` for the dynamic context-aware mode.
    keep: ids always active (EOS, BOS, pad, ...).
    output: ``"full"`` — V-sized logits, ``-inf`` on inactive ids, so unchanged downstream code
        stays correct; ``"compact"`` — logits over the active ids (read them with
        :func:`trimpass.active_ids`).
    inner: the compiler that receives the rewritten graph: ``"inductor"``, ``"aot_eager"``,
        ``"eager"``, or a Dynamo backend callable.
    mode, options: forwarded to inductor (as ``torch.compile``'s).
    vocab_size: the head's V, when the graph has no embedding lookup to read it from.
    capacity: dynamic mode (default 4096): active ids kept per request row (least recently seen
        are evicted).
    core: dynamic mode: ids of a core set always active (e.g. a static list from ``select``).
    learn_core: dynamic mode (default 1024): how many more core ids to learn online, on the
        device, from the drafter's own traffic: each new request starts with the ids its earlier
        requests received most often. Needs no tokenizer and no data; 0 disables it.
    successors: dynamic mode (default 0, off): with each id the drafter receives, also admit the
        last K distinct ids that followed it before (in this drafter's traffic). ``4`` adds 2-3
        points of coverage once a drafter has served some traffic, for ~60 more ids, but its
        bookkeeping costs ~0.2 ms a step on CPU.
    refresh_every: dynamic mode (default 0, off): every N-th step computes the full head once and
        admits its top ids. Its cost, V/N head rows per step amortized, did not earn its place in
        the measurements (see README); opt in for drafters that need it.
    refresh_topk: dynamic mode (default 64): how many top ids a refresh step admits.
    max_rows: dynamic mode (default 64): request rows in the drafter's pool (the largest batch,
        or an engine's concurrent requests); each row holds ~64 KB at capacity 4,096.
    escape: dynamic mode: the escape path's settings, an :class:`Escape` (default
        ``Escape(rank=16, topk=64, gate=0.5)``), or ``None`` to turn it off. The flat
        ``escape_rank`` (0: off), ``escape_topk`` and ``escape_gate`` still work, with a
        ``DeprecationWarning``.
    """

    vocab: Any = None
    keep: Any = ()
    output: str = "full"
    inner: str | Callable = "inductor"
    mode: str | None = None
    options: dict | None = None
    vocab_size: int | None = None
    capacity: int | None = None
    core: Any = None
    learn_core: int | None = None
    successors: int | None = None
    refresh_every: int | None = None
    refresh_topk: int | None = None
    max_rows: int | None = None
    escape: Escape | None = DEFAULT_ESCAPE
    escape_rank: int | None = None
    escape_topk: int | None = None
    escape_gate: float | None = None
    settings: StaticSettings | DynamicSettings = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if self.output not in OUTPUTS:
            raise TrimpassError(f"output: must be one of {OUTPUTS}, got {self.output!r}")
        if not (callable(self.inner) or self.inner in INNER):
            raise TrimpassError(f"inner: must be one of {INNER} or a Dynamo backend callable, got "
                                f"{self.inner!r}")
        if self.mode is not None and self.options:
            raise TrimpassError("mode and options: give one of them, as with torch.compile")
        if self.mode is not None:
            from torch._inductor import list_mode_options
            if self.mode not in list_mode_options():
                raise TrimpassError(f"mode: one inductor knows ({', '.join(list_mode_options())})"
                                    f" or None, got {self.mode!r}")
        if self.vocab_size is not None and (not isinstance(self.vocab_size, int)
                                            or self.vocab_size <= 0):
            raise TrimpassError(f"vocab_size: must be a positive int, got {self.vocab_size!r}")
        keep = self._checked(self.keep, "keep", allow_empty=True)
        self._flat_escape()
        if self.escape is not None and not isinstance(self.escape, Escape):
            raise TrimpassError(f"escape: must be a trimpass.config.Escape or None, got "
                                f"{self.escape!r}")
        if self.vocab is not None:
            given = [k for k in DYNAMIC_DEFAULTS if getattr(self, k) is not None]
            given += ["escape"] * (self.escape is not DEFAULT_ESCAPE and self.escape is not None)
            if given:
                raise TrimpassError(
                    f"{given[0]}: a dynamic-mode setting, which does nothing with a static vocab; "
                    f"remove {', '.join(given)}, or drop vocab= to use the dynamic mode")
            self.settings = StaticSettings(self._checked(self.vocab, "vocab"), keep)
            return
        for k, v in DYNAMIC_DEFAULTS.items():
            if getattr(self, k) is None:
                setattr(self, k, v)
        for name in ("capacity", "refresh_topk", "max_rows"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise TrimpassError(f"{name}: must be a positive int, got {v!r}")
        if not isinstance(self.learn_core, int) or self.learn_core < 0:
            raise TrimpassError(f"learn_core: must be an int >= 0 (0 disables), got "
                                f"{self.learn_core!r}")
        if not isinstance(self.successors, int) or not 0 <= self.successors <= 16:
            raise TrimpassError(f"successors: must be an int in [0, 16] (0 disables), got "
                                f"{self.successors!r}")
        if not isinstance(self.refresh_every, int) or self.refresh_every < 0:
            raise TrimpassError(f"refresh_every: must be an int >= 0 (0 disables), got "
                                f"{self.refresh_every!r}")
        core = None if self.core is None else self._checked(self.core, "core")
        n_core = (0 if core is None else core.numel()) + keep.numel()
        if n_core + self.learn_core >= self.capacity:
            raise TrimpassError(
                f"capacity: {self.capacity} leaves no room beside the core set, learned core and "
                f"kept ids ({n_core - keep.numel()} + {self.learn_core} + {keep.numel()}); raise "
                "capacity, or lower learn_core or shrink core")
        self.settings = DynamicSettings(keep, self.capacity, core, self.learn_core,
                                        self.successors, self.refresh_every, self.refresh_topk,
                                        self.max_rows, self.escape)

    def _flat_escape(self) -> None:
        """The deprecated flat ``escape_*`` settings, folded into ``escape``."""
        flat = {k[len("escape_"):]: getattr(self, k) for k in FLAT_ESCAPE
                if getattr(self, k) is not None}
        if not flat:
            return
        warnings.warn(f"{', '.join('escape_' + k for k in flat)}: deprecated; pass "
                      f"escape=Escape({', '.join(f'{k}={v!r}' for k, v in flat.items())}) "
                      "(trimpass.config.Escape), or escape=None to turn the path off",
                      DeprecationWarning, stacklevel=4)
        if self.vocab is not None:
            raise TrimpassError(f"escape_{next(iter(flat))}: a dynamic-mode setting, which does "
                                "nothing with a static vocab; remove it")
        if flat.get("rank") == 0:
            self.escape = None
            return
        if isinstance(flat.get("rank"), int) and not isinstance(flat["rank"], bool) \
                and flat["rank"] < 0:
            raise TrimpassError(f"escape_rank: must be an int >= 0 (0 disables), got "
                                f"{flat['rank']!r}")
        base = self.escape if isinstance(self.escape, Escape) else DEFAULT_ESCAPE
        try:
            self.escape = Escape(**{**base.__dict__, **flat})
        except TrimpassError as e:
            raise TrimpassError(str(e).replace("escape.", "escape_", 1)) from None

    def _checked(self, ids, name: str, allow_empty: bool = False) -> torch.Tensor:
        try:
            t = as_ids(list(ids) if isinstance(ids, (tuple, set, range)) else ids, name)
            if t.numel() or not allow_empty:
                check_ids(t, self.vocab_size, name)
        except (TypeError, ValueError) as e:
            raise TrimpassError(str(e)) from None
        return t

    @property
    def dynamic(self) -> bool:
        return isinstance(self.settings, DynamicSettings)


def disabled() -> bool:
    """The kill switch: ``TRIMPASS_DISABLE=1`` makes every backend a plain inner compiler."""
    return os.environ.get("TRIMPASS_DISABLE", "0") not in ("", "0")
