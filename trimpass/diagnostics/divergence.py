"""Where a route's greedy output leaves plain decoding's, and whether that is a near-tie.

Greedy speculative decoding emits the target's argmax, but a route computes it differently from
plain decoding: Hugging Face verifies several tokens in one batched pass, the fused loop runs a
compiled body and prefills in chunks. Each rounds differently, so where the top two logits lie
within rounding of each other the argmax may flip, and the outputs part from there on. For a pair of
outputs, :func:`explain` finds the first differing position and computes the logits of that prefix
both ways, by default eagerly: one-token steps over a cache (as ``model.generate`` decodes) and one
batched pass over the whole prefix (as a verification does); a compiled route gives its own two
computations (the fused loop: :func:`trimpass.diagnostics.replay.logits`). The gap between plain
decoding's top logit and the route's token, against the largest difference between the two
computations, decides: a gap within that difference is a near-tie that rounding alone can flip; a
wider gap is a bug. Where the route's own computation is replayed bit for bit (``exact``: the fused
loop's trace, :func:`trimpass.diagnostics.replay.replayed`), what decides is whether that
computation ranks the route's token at least as high as plain decoding's: then the flip is the two
computations' rounding apart, and its gap is at most twice their largest difference; else the route
emitted a token its own logits do not rank first, a bug. A fused-loop output is explained in two
stages through its compiled body (:func:`fused_stages`), and counts as its worse stage
(:func:`worst`).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from trimpass.diagnostics import replay


@dataclass
class Divergence:
    position: int  # index of the first differing new token
    plain: int  # plain decoding's token there
    route: int  # the route's token there
    gap: float  # plain's logit of its token minus of the route's, in plain's computation
    spread: float  # the largest |plain's - the route's computation| logit difference there
    ulps: float  # gap in ulps of the top logit in the model's dtype
    spread_ulps: float  # spread in the same ulps
    near_tie: bool  # gap <= spread: rounding alone can flip it

    def as_dict(self) -> dict:
        return asdict(self)


def first_difference(a: torch.Tensor, b: torch.Tensor, start: int) -> int | None:
    """The first index >= ``start`` where ``a`` and ``b`` [1, n] differ (None if one is a prefix of
    the other: an EOS or a length, not a token, apart)."""
    n = min(a.shape[1], b.shape[1])
    diff = (a[0, start:n] != b[0, start:n]).nonzero()
    return start + int(diff[0, 0]) if diff.numel() else None


def ulp(x: float, dtype: torch.dtype) -> float:
    """The spacing of ``dtype``'s values at ``x``."""
    e = math.floor(math.log2(abs(x))) if x else 0
    return torch.finfo(dtype).eps * 2.0 ** e


@torch.no_grad()
def _one_token_steps(model, prefix: torch.Tensor, prompt: int) -> torch.Tensor:
    """The last position's logits as ``model.generate`` computes them: the prompt in one pass,
    then one token at a time over the cache."""
    out = model(prefix[:, :prompt], use_cache=True)
    cache, z = out.past_key_values, out.logits[0, -1]
    for j in range(prompt, prefix.shape[1]):
        out = model(prefix[:, j:j + 1], past_key_values=cache, use_cache=True)
        cache, z = out.past_key_values, out.logits[0, -1]
    return z


@torch.no_grad()
def explain(model, prompt: int, plain: torch.Tensor, route: torch.Tensor,
            plain_way=None, route_way=None, exact: bool = False) -> Divergence | None:
    """The first divergence of ``route`` from ``plain`` (outputs [1, prompt + n] of one prompt of
    ``prompt`` tokens), or None where they agree. ``plain_way`` and ``route_way`` (each
    ``(prefix, prompt) -> logits [V]`` of the prefix's last position) say how each output was
    computed; by default eagerly, one-token steps and one batched pass. A route through a compiled
    body passes its own (:func:`trimpass.diagnostics.replay.logits`): a compiled body rounds
    otherwise than eager. ``exact``: ``route_way`` is the route's own computation, bit for bit."""
    at = first_difference(plain, route, prompt)
    if at is None:
        return None
    prefix = plain[:, :at]
    steps = (plain_way or (lambda x, p: _one_token_steps(model, x, p)))(prefix, prompt).float()
    batched = (route_way or (lambda x, p: model(x).logits[0, -1]))(prefix, prompt).float()
    a, b = int(plain[0, at]), int(route[0, at])
    gap = float(steps[a] - steps[b])
    spread = float((steps - batched).abs().max())
    unit = ulp(float(steps[a]), next(model.parameters()).dtype)
    tie = bool(batched[b] >= batched[a]) if exact else gap <= spread
    return Divergence(position=at - prompt, plain=a, route=b, gap=gap, spread=spread,
                      ulps=gap / unit, spread_ulps=spread / unit, near_tie=tie)


def fused_stages(model, loop, prompt: int, plain: torch.Tensor, ref: torch.Tensor,
                 route: torch.Tensor, trace=None) -> tuple[Divergence | None, Divergence | None]:
    """A fused loop's output ``route`` against plain decoding's ``plain`` (Hugging Face's eager
    ``generate``), in two stages through the compiled body of ``loop`` (a ``FusedLoop``): the route
    against its reference ``ref`` (the loop run with ``speculate=False``), the body's one-token
    steps against the route's own computation where ``trace`` (the route's call's, from its
    loop's :class:`~trimpass.diagnostics.replay.Tracer`, with that loop: ``(route loop, trace)``)
    is given, else against the body's batched pass; then the reference against plain decoding,
    eager one-token steps against the body's."""
    def body(prefix, p):
        return replay.logits(loop, prefix, p)

    def route_way(prefix, _):
        if trace is None:
            return replay.logits(loop, prefix, prefix.shape[1])
        route_loop, calls = trace
        return replay.replayed(route_loop, calls, prefix.shape[1] - 1)

    own = explain(model, prompt, ref, route, body, route_way, exact=trace is not None)
    return own, explain(model, prompt, plain, ref, route_way=body)


def worst(stages) -> Divergence | None:
    """The divergence a chain of stages amounts to: None where no stage differs, a stage that is
    not a near-tie where one is (a bug anywhere is a bug), else the near-tie of the largest gap."""
    found = [d for d in stages if d is not None]
    if not found:
        return None
    return next((d for d in found if not d.near_tie), max(found, key=lambda d: d.ulps))


@dataclass
class Tally:
    """A route's outputs against plain decoding's, prompt by prompt: identical, a near-tie, or not
    (a bug). Lossless when no divergence is more than a near-tie."""
    same: int = 0
    ties: list = field(default_factory=list)  # [(prompt index, Divergence)]
    bugs: list = field(default_factory=list)

    def add(self, model, prompt: int, plain: torch.Tensor, route: torch.Tensor,
            plain_way=None, route_way=None) -> None:
        self.record(explain(model, prompt, plain, route, plain_way, route_way))

    def record(self, d: Divergence | None) -> None:
        """Counts one prompt's output already explained: identical (None), a near-tie or a bug."""
        if d is None:
            self.same += 1
        else:
            (self.ties if d.near_tie else self.bugs).append((self.total, d))

    @property
    def total(self) -> int:
        return self.same + len(self.ties) + len(self.bugs)

    @property
    def lossless(self) -> bool:
        return not self.bugs

    def mark(self) -> str:
        """A table cell: ✓, ✓ with its near-ties counted, or ✗."""
        if self.bugs:
            return "✗"
        return f"✓ ({len(self.ties)} near-tie{'s' * (len(self.ties) > 1)})" if self.ties else "✓"

    def cell(self) -> str:
        """A table cell: near-ties / not near-ties, and each gap in ulps ("-" where none)."""
        gaps = ", ".join(f"{d.ulps:.1f}" for _, d in self.ties + self.bugs) or "-"
        return f"{len(self.ties)} / {len(self.bugs)} ({gaps})"

    def __str__(self) -> str:
        def each(ds):
            return ", ".join(f"prompt {k + 1} at new token {d.position}: gap {d.ulps:.1f} ulps "
                             f"(the two computations {d.spread_ulps:.1f} apart)"
                             for k, d in ds)
        return (f"{self.same} of {self.total} identical; near-ties {len(self.ties)}"
                f"{' (' + each(self.ties) + ')' if self.ties else ''}; not near-ties "
                f"{len(self.bugs)}{' (' + each(self.bugs) + ')' if self.bugs else ''}")
