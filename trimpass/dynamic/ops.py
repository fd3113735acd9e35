"""The dynamic vocabulary's ops, ``torch.library`` ops in the ``trimpass`` namespace beside the head
ops (:mod:`trimpass.ops`): ``admit`` (a step's token ids into its request rows), ``active`` (the
rows' ids and counts for the head), ``refresh`` (a periodic full-head pass) and ``head_full_escape``
(``head_full`` followed by the escape path, :mod:`trimpass.dynamic.escape`). Each finds its
drafter's :class:`~trimpass.dynamic.state.ActiveState` by the serial the graph passes in."""
from __future__ import annotations

import torch

from trimpass import ops
from trimpass.dynamic.escape import escape_step
from trimpass.dynamic.state import owner


# The dynamic vocabulary's ops. Their buffers are private to the drafter's ActiveState, found by
# its serial (passed in, functionalization would copy the request pool every step). `admit` returns
# a new one-element token that the step's next admit, then `active`, takes: a data dependency that
# orders them. It is not declared as a mutation of the token: under aot_autograd a mutable op runs
# through auto_functionalized, which cost 0.2-0.3 ms a call inside a Gemma decode step here.
def _admit(token, ids, pos, state: int) -> torch.Tensor:
    owner(state).admit(ids, pos)
    return token + 1


def _active(token, batch: int, capacity: int, state: int):
    return owner(state).active(batch)


def _active_fake(token, batch, capacity, state):
    return (token.new_empty((batch, capacity), dtype=torch.long),
            token.new_empty((batch,), dtype=torch.int32))


def _refresh(token, x, weight, bias, state: int) -> None:
    owner(state).refresh(x, weight, bias)
    token.add_(1)


def _head_full_escape(x, weight, bias, idx, count, state: int, scale: float = 1.0,
                      softcap: float = 0.0):
    """``head_full``, then the escape path (:mod:`trimpass.dynamic.escape`) on its output in
    place."""
    out, last = ops.full_and_last(x, weight, bias, idx, count, scale, softcap)
    B = count.numel()
    escape_step(owner(state), out, x, weight, bias, idx.reshape(B, -1), count.reshape(B),
                scale, softcap, compact_last=last)
    return out


def _head_full_escape_fake(x, weight, bias, idx, count, state, scale=1.0, softcap=0.0):
    return ops.head_full_meta(x, weight, bias, idx, count, scale, softcap)


def _no_output(*args):
    return None


SCHEMAS = {
    "admit": ("(Tensor token, Tensor ids, Tensor? pos, int state) -> Tensor", _admit,
              lambda token, *args: torch.empty_like(token)),
    "active": ("(Tensor token, int batch, int capacity, int state) -> (Tensor, Tensor)", _active,
               _active_fake),
    "refresh": ("(Tensor(a!) token, Tensor x, Tensor weight, Tensor? bias, int state) -> ()",
                _refresh, _no_output),
    "head_full_escape": (f"({ops.HEAD_ARGS}, int state, float scale=1.0, float softcap=0.0) "
                         "-> Tensor", _head_full_escape, _head_full_escape_fake),
}


_lib = torch.library.Library("trimpass", "FRAGMENT")
ops.register(_lib, SCHEMAS)
# A graph piece that looks tokens up but holds no head admits with no one reading the token: kept
# from dead-code elimination (fx, aot_autograd and inductor all ask torch.fx's side-effect set).
torch.fx.node.has_side_effect(torch.ops.trimpass.admit.default)
head_full_escape = torch.ops.trimpass.head_full_escape
