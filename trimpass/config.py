"""``TrimConfig``: every user-facing setting of trimpass in one validated dataclass.

Checked in ``__post_init__`` so a bad setting fails where it is written, with a message naming the
argument, not later inside a compiler. A static ``vocab`` selects the static mode; ``vocab=None``
selects the dynamic, context-aware mode (the zero-configuration default). Errors raised while
Dynamo calls the backend use :class:`TrimpassError`, which Dynamo re-raises as it is, so the user
sees trimpass's sentence first rather than a ``BackendCompilerFailed`` wrapper.
"""
from __future__ import annotations

import os
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


@dataclass
class TrimConfig:
    """Settings of a trimpass backend.

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
    capacity: dynamic mode: active ids kept per batch row (least recently seen are evicted).
    core: dynamic mode: ids of a core set always active (e.g. a static list from ``select``).
    learn_core: dynamic mode: how many more core ids to learn online, on the device, from the
        drafter's own traffic: each new request starts with the ids its earlier requests received
        most often. Needs no tokenizer and no data; 0 disables it.
    successors: dynamic mode: with each id the drafter receives, also admit the last K distinct
        ids that followed it before (in this drafter's traffic, this request included); 0 (the
        default) disables it. ``4`` adds 2-3 points of coverage once a drafter has served some
        traffic, for ~60 more ids, but its bookkeeping costs ~0.2 ms a step on CPU.
    refresh_every: dynamic mode: every N-th step computes the full head once and admits its top
        ids; 0 (the default) disables it. Its cost, V/N head rows per step amortized, did not earn
        its place in the measurements (see README); opt in for drafters that need it.
    refresh_topk: dynamic mode: how many top ids a refresh step admits.
    """

    vocab: Any = None
    keep: Any = ()
    output: str = "full"
    inner: str | Callable = "inductor"
    mode: str | None = None
    options: dict | None = None
    vocab_size: int | None = None
    capacity: int = 4096
    core: Any = None
    learn_core: int = 1024
    successors: int = 0
    refresh_every: int = 0
    refresh_topk: int = 64
    _ids: torch.Tensor | None = field(default=None, init=False, repr=False)
    _keep: torch.Tensor = field(default=None, init=False, repr=False)
    _core: torch.Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if self.output not in OUTPUTS:
            raise TrimpassError(f"output: must be one of {OUTPUTS}, got {self.output!r}")
        if not (callable(self.inner) or self.inner in INNER):
            raise TrimpassError(f"inner: must be one of {INNER} or a Dynamo backend callable, got "
                                f"{self.inner!r}")
        if self.mode is not None and self.options:
            raise TrimpassError("mode and options: give one of them, as with torch.compile")
        if self.vocab_size is not None and (not isinstance(self.vocab_size, int)
                                            or self.vocab_size <= 0):
            raise TrimpassError(f"vocab_size: must be a positive int, got {self.vocab_size!r}")
        for name in ("capacity", "refresh_topk"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
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
        self._keep = self._checked(self.keep, "keep", allow_empty=True)
        if self.vocab is not None:
            self._ids = self._checked(self.vocab, "vocab")
        if self.core is not None:
            self._core = self._checked(self.core, "core")
        n_core = (0 if self._core is None else self._core.numel()) + self._keep.numel()
        if self.dynamic and n_core + self.learn_core >= self.capacity:
            raise TrimpassError(
                f"capacity: {self.capacity} leaves no room beside the core set, learned core and "
                f"kept ids ({n_core - self._keep.numel()} + {self.learn_core} + "
                f"{self._keep.numel()}); raise capacity, or lower learn_core or shrink core")

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
        return self._ids is None

    def check_vocab_size(self, V: int) -> None:
        """Check the ids against the head's V once the graph shows it."""
        for name, t in (("vocab", self._ids), ("keep", self._keep), ("core", self._core)):
            if t is not None and t.numel() and int(t.max()) >= V:
                raise TrimpassError(
                    f"{name}: has token id {int(t.max())} but the drafter's head has only {V} "
                    "rows; was the list made with another tokenizer?")

    def static_index(self, V: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        self.check_vocab_size(V)
        idx = torch.unique(torch.cat([self._ids, self._keep]))
        return idx.to(device), torch.tensor([idx.numel()], dtype=torch.int32, device=device)


def disabled() -> bool:
    """The kill switch: ``TRIMPASS_DISABLE=1`` makes every backend a plain inner compiler."""
    return os.environ.get("TRIMPASS_DISABLE", "0") not in ("", "0")
