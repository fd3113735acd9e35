"""A fused-loop call's own computation, recorded and replayed. :class:`Tracer` attaches to a
:class:`~trimpass.hf.fused.FusedLoop` by its body's hooks and keeps the last call's trace: its
cache, rollbacks and body passes (a tree pass with the path it kept), in order. :func:`replayed`
computes again, bit for bit, the full head's logits a call computed for one position; :func:`logits`
computes a prefix's last logits through the loop's compiled body as plain decoding would (its prompt
prefilled, then one token at a time), or as a verification would (one pass over many rows). What
:func:`trimpass.diagnostics.divergence.explain` compares; none of it runs in a call."""
from __future__ import annotations

import torch


class Tracer:
    """The hook that records each call of a loop (``trace``: the last call's, None before one)."""

    def __init__(self):
        self.trace: list | None = None

    @classmethod
    def attach(cls, loop) -> Tracer:
        """The loop's tracer, attached once and kept on it."""
        for hook in loop.body.hooks:
            if isinstance(hook, cls):
                return hook
        tracer = cls()
        loop.body.hooks.append(tracer)
        return tracer

    def on_request(self, prompt: int, new: int) -> None:
        self.trace = [("cache", prompt, new)]

    def on_rollback(self, length: int) -> None:
        if self.trace is not None:
            self.trace.append(("rollback", length))

    def on_pass(self, at: int, ids: torch.Tensor) -> None:
        if self.trace is not None:
            self.trace.append(("pass", at, ids))

    def on_tree(self, at: int, ids: torch.Tensor, depth: torch.Tensor, anc: torch.Tensor,
                path: list[int]) -> None:
        if self.trace is not None:
            self.trace.append(("tree", at, ids, depth, anc, list(path)))


def _rows(e) -> int:
    """The positions an event's pass computed from its start: a pass's rows, a tree's kept path."""
    return e[2].shape[1] if e[0] == "pass" else len(e[5])


@torch.no_grad()
def replayed(loop, trace: list, position: int) -> torch.Tensor:
    """The full head's logits [V] for the row at ``position`` as a call of ``loop`` computed them
    (``trace``: its :class:`Tracer`'s): its cache, rollbacks and body passes replayed in order up
    to the last pass over that row, the pass whose row gave the token after it."""
    last = max((i for i, e in enumerate(trace) if e[0] in ("pass", "tree")
                and e[1] <= position < e[1] + _rows(e)), default=None)
    if last is None:
        raise ValueError(f"position: no body pass of this trace computed row {position}")
    body = loop.body
    with body.quiet():
        for e in trace[:last + 1]:
            if e[0] == "cache":
                body.fresh_cache(e[1], e[2])
            elif e[0] == "rollback":
                body.rollback(e[1])
            elif e[0] == "pass":
                hs = body.run(e[2], e[1])[0]
            else:  # a tree pass, then its kept path moved into place
                body.cache.seek(e[1])
                hs = body.tree(e[2].to(body.device), e[3].to(body.device), e[4].to(body.device))
                hs = hs[torch.tensor(e[5], device=hs.device)]
                body.keep_path(e[1], e[5])
    row = position - trace[last][1]
    return body.head(hs[row:row + 1])[0]


@torch.no_grad()
def logits(loop, prefix: torch.Tensor, prompt: int) -> torch.Tensor:
    """The full head's logits [V] at the last position of ``prefix`` [1, n] through ``loop``'s
    compiled body: its first ``prompt`` tokens prefilled, the rest one token at a time (plain
    decoding's computation; ``prompt = n``: one pass over many rows, a verification's)."""
    body = loop.body
    ids = prefix.to(body.device)
    with body.quiet():
        body.fresh_cache(ids.shape[1], 1)
        h, _ = body.prefill(ids[:, :prompt])
        for j in range(prompt, ids.shape[1]):
            h = body.run(ids[:, j:j + 1], j)[1]
    return body.head(h)[0]
