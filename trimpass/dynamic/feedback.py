"""Target feedback, opt-in: a tap on the target feeds its top-k at the positions it computes
(the prompt, then each verification pass) into the paired drafter's request rows, so ids the target
finds likely become proposable at the drafter's next step, with no change to the loop.

``trimpass.pair(target, draft, k)`` registers a forward hook on ``target``: it reads the logits the
target returns (``[B, S, V]``: an HF output's ``.logits``, a tuple's first element or a tensor),
never changes them and never trims the target, takes their top-``k`` per position and admits them
into ``draft``'s rows for the same batch positions (``trimpass.observe``). Before the drafter's
first call there is no row yet, and the tap does nothing. ``handle.remove()`` unpairs. The dynamic
mode only: a static vocabulary has no rows to feed.
"""
from __future__ import annotations

import torch

from trimpass.config import TrimpassError


def _logits(output):
    out = getattr(output, "logits", output)
    if isinstance(out, (tuple, list)):
        out = out[0]
    if not (torch.is_tensor(out) and out.is_floating_point() and out.dim() >= 2):
        raise TrimpassError("pair: the target's output has no logits [B, ..., V] (an HF output's "
                            f".logits, a tuple's first element or a tensor); got "
                            f"{type(output).__name__}")
    return out


def _vocab(module) -> int | None:
    head = getattr(module, "get_output_embeddings", lambda: None)()
    return None if head is None else head.weight.shape[0]


def pair(target: torch.nn.Module, draft, k: int = 3, state=None):
    """Feed ``target``'s top-``k`` at every position it computes into ``draft``'s rows.
    ``state`` finds the drafter's state (``trimpass.active_state``; passed in to avoid a cycle).
    Returns the hook's handle (``.remove()`` unpairs)."""
    if not isinstance(target, torch.nn.Module):
        raise TrimpassError(f"pair: target must be an nn.Module, got {type(target).__name__}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise TrimpassError(f"pair: k must be an int >= 1 (ids per position), got {k!r}")
    tv, dv = _vocab(target), _vocab(getattr(draft, "_orig_mod", draft))
    if tv is not None and dv is not None and tv != dv:
        raise TrimpassError(f"pair: the target's vocabulary ({tv:,}) differs from the drafter's "
                            f"({dv:,}); pair a drafter made for this target")

    def tap(module, args, output):
        st = state(draft)
        if st is None:  # the drafter has not run yet: no rows to feed
            return
        logits = _logits(output)
        if logits.shape[-1] != st.V:
            raise TrimpassError(f"pair: the target's logits have {logits.shape[-1]:,} columns, "
                                f"the drafter's vocabulary {st.V:,}")
        with torch.no_grad():
            st.observe(logits.detach(), k)

    return target.register_forward_hook(tap)
