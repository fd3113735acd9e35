"""Engine-neutral serving: request rows that follow an engine's batch (:class:`RequestRows`), and a
batch's trimmed logits over one vocabulary shard, with one weight copy shared by every row. An
engine adapter (:mod:`trimpass.serving.vllm_trim`) only says which requests are in the batch and
where their tokens are.

:class:`RequestRows` binds each request id to a row of the drafter's
:class:`~trimpass.dynamic.state.ActiveState` when it first enters the batch (the row rebuilt from
the request's tokens so far, so a resumed request drafts from its own ids only), admits the tokens
each request has gained since the last step, and releases the rows of requests that left the batch
(finished, aborted or preempted).

An engine's batch holds many requests, each with its own active ids (``idx[B, CAP]``, ``count[B]``).
Giving each row its own compact copy of its weight rows would cost ``B x CAP x d`` floats (671 MB at
64 rows, capacity 4,096, d = 640, fp32), so :func:`trimmed_logits` takes the union of the rows' ids
that fall in this shard, runs trimpass's ``trimpass::head_compact`` op once over it (its cached
compact copy is shared by the rows, padded to a power-of-two bucket so the cache entry is stable)
and places each row's own logits into a row of ``-inf``: a row's finite logits are exactly its
active ids, never another request's. A weight's bucket only grows (no re-gather when the union
hovers at a boundary) and its smaller buckets' copies are dropped; a union over ``MAX_UNION`` ids
falls back to the plain head (exact, no copy). So the copy is at most ``MAX_UNION x d`` per head
(168 MB at d = 640, fp32). A vocabulary-sharded head (tensor parallelism) passes its shard's rows
and ``start``; concatenating the shards' outputs gives the unsharded result."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from trimpass import compact, ops
from trimpass.dynamic.state import ActiveState

MAX_UNION = 65_536  # ids in one shared compact copy; beyond it, the plain head
MIN_BUCKET = 256
_buckets: dict = {}  # weight data_ptr -> the largest bucket it has used


def _bucket(weight: torch.Tensor, n: int) -> int:
    """A power of two >= n, never below the weight's earlier buckets; drops the weight's other
    compact copies when it grows."""
    key = weight.data_ptr()
    b = max(MIN_BUCKET, _buckets.get(key, 0))
    while b < n:
        b *= 2
    if b != _buckets.get(key):
        _buckets[key] = b
        compact.forget(weight, b)
    return b


def union(idx: torch.Tensor, count: torch.Tensor, start: int, size: int):
    """Of each row's first ``count[b]`` ids, those in ``[start, start + size)``, shard-local:
    ``(uniq[U], inv[N], rowof[N], local[N])`` with ``uniq[inv] == local``."""
    counts = [max(0, min(int(c), idx.shape[1])) for c in count.tolist()]
    flat = torch.cat([idx[b, :c] for b, c in enumerate(counts)]).long() - start
    rowof = torch.repeat_interleave(torch.arange(len(counts), device=idx.device),
                                    torch.tensor(counts, device=idx.device))
    keep = (flat >= 0) & (flat < size)
    flat, rowof = flat[keep], rowof[keep]
    uniq, inv = torch.unique(flat, return_inverse=True)
    return uniq, inv, rowof, flat


def top_prob(values: torch.Tensor, rowof: torch.Tensor, rows: int) -> torch.Tensor:
    """Each row's softmax maximum over its own logits ``values[rowof == b]`` (float32 [rows];
    0 for a row with none): 1 / sum(exp(v - max)), without a V-wide pass."""
    v = values.float()
    m = torch.full((rows,), float("-inf"), device=v.device).scatter_reduce(
        0, rowof, v, "amax", include_self=True)
    se = torch.zeros(rows, device=v.device).index_add_(0, rowof, torch.exp(v - m[rowof]))
    return torch.where(se > 0, 1.0 / se.clamp_min(1.0), torch.zeros_like(se))


def trimmed_logits(x: torch.Tensor, weight: torch.Tensor, idx: torch.Tensor, count: torch.Tensor,
                   start: int = 0, softcap: float = 0.0, *, scale: float = 1.0,
                   with_top: bool = False):
    """``[B, weight.shape[0]]`` logits of this shard: row ``b`` exact (``softcap``, then
    ``scale`` applied) on its active ids ``idx[b, :count[b]]`` that fall in ``[start, start +
    weight.shape[0])``, ``-inf`` elsewhere. Returns the logits and the number of distinct ids
    computed (the union); ``with_top=True`` adds each row's softmax maximum (:func:`top_prob`)."""
    B, size = x.shape[0], weight.shape[0]
    if idx.dim() == 1:  # one list for every row (a static vocabulary)
        idx, count = idx.expand(B, -1), count.reshape(1).expand(B)
    uniq, inv, rowof, local = union(idx, count, start, size)
    out = ops.filled((B, size), float("-inf"), x)
    U = int(uniq.numel())
    if U == 0:
        vals = out.new_zeros(0)
    elif U > MAX_UNION:  # too many rows to copy: the plain head, read at each row's own ids
        vals = ops.softcap(F.linear(x, weight), softcap)[rowof, local]
    else:
        ids = torch.zeros(_bucket(weight, U), dtype=torch.long, device=x.device)
        ids[:U] = uniq
        cnt = torch.tensor([U], dtype=torch.int32, device=x.device)
        z = ops.head_compact(x.contiguous(), weight, None, ids, cnt, 1.0, float(softcap or 0.0))
        vals = z[rowof, inv]
    if scale != 1.0:
        vals = vals * scale
    out[rowof, local] = vals
    return (out, U, top_prob(vals, rowof, B)) if with_top else (out, U)


class DraftVocab:
    """An EAGLE-3 drafter's own vocabulary: its head's row ``i`` scores target id
    ``i + d2t[i]``. Rows, static lists and a request's tokens stay in the target's ids;
    :meth:`to_draft` maps a row's active ids to head rows (``-1`` for an id outside the draft
    vocabulary, which :func:`union` leaves out) and :meth:`to_target` places the draft-vocabulary
    logits in a ``[B, V]`` row of ``-inf``, as the untrimmed EAGLE-3 head does."""

    def __init__(self, d2t: torch.Tensor, V: int):
        d2t = d2t.reshape(-1).long()
        targets = torch.arange(d2t.numel(), device=d2t.device) + d2t
        check_draft_map(targets, V, "d2t")
        self.V, self.targets = V, targets
        self.t2d = torch.full((V,), -1, dtype=torch.long, device=d2t.device)
        self.t2d[targets] = torch.arange(targets.numel(), device=d2t.device)

    def to_draft(self, idx: torch.Tensor) -> torch.Tensor:
        return self.t2d[idx.long().clamp(0, self.V - 1)].masked_fill_(
            (idx < 0) | (idx >= self.V), -1)

    def to_target(self, logits: torch.Tensor) -> torch.Tensor:
        out = logits.new_full((logits.shape[0], self.V), float("-inf"))
        out[:, self.targets] = logits
        return out


def check_draft_map(targets: torch.Tensor, V: int, name: str) -> None:
    """The target ids of a draft vocabulary's rows: each in ``[0, V)``, none twice."""
    bad = (targets < 0) | (targets >= V)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"{name}: draft id {i} maps to target id {int(targets[i])}, outside the "
                         f"target's vocabulary [0, {V}); the map belongs to another target")
    if torch.unique(targets).numel() != targets.numel():
        raise ValueError(f"{name}: two draft ids map to the same target id; a draft vocabulary "
                         "map must be one-to-one")


class RequestRows:
    """The rows of one drafter's requests; ``state`` is None in the static mode (no rows)."""

    def __init__(self, state: ActiveState | None):
        self.state = state
        self.admitted: dict = {}  # request id -> tokens admitted so far

    def follow(self, req_ids: list, lengths: list[int], tokens) -> None:
        """The batch is now ``req_ids``, request ``i`` holding ``lengths[i]`` tokens (drafts
        excluded); ``tokens(i, start, end)`` returns its tokens ``[start, end)`` (a 1-D array or
        tensor). Releases the rows of requests no longer in the batch, binds new ones (each row
        built from its own tokens, which also count for the learned core), and admits each other
        request's new tokens into its own row."""
        st = self.state
        if st is None:
            return
        self.keep_only(req_ids)
        new = {rid: self._ids(tokens(i, 0, lengths[i])) for i, rid in enumerate(req_ids)
               if rid not in st.requests}
        st.bind(req_ids, tokens=new)
        for i, rid in enumerate(req_ids):
            n = lengths[i]
            if rid in new:
                if new[rid].numel():
                    st.learn(new[rid].to(st.freq.device))
                self.admitted[rid] = n
                continue
            a = min(self.admitted.get(rid, 0), n)
            toks = self._ids(tokens(i, a, n)) if n > a else None
            if toks is not None and toks.numel():
                row = torch.tensor([st.requests[rid]], device=st.idx.device)
                st.admit(toks[None].to(st.idx.device), None, learn=True, rows=row)
            self.admitted[rid] = n

    def _ids(self, toks) -> torch.Tensor:
        """A request's tokens as ids of this vocabulary: an id outside ``[0, V)`` (an engine that
        does not check its prompts) is left out here, so the engine's own check, or its embedding,
        is what reports it."""
        t = torch.as_tensor(toks).long().reshape(-1)
        return t[(t >= 0) & (t < self.state.V)]

    def keep_only(self, req_ids) -> None:
        """Release the rows of every request not in ``req_ids`` (those that left the batch)."""
        if self.state is not None:
            live = set(req_ids)
            for rid in [r for r in self.state.requests if r not in live]:
                self.release(rid)

    def release(self, rid) -> None:
        """A request left (finished, aborted or preempted): its row becomes free."""
        if self.state is not None:
            self.state.release(rid)
        self.admitted.pop(rid, None)

    @property
    def live(self) -> int:
        return 0 if self.state is None else len(self.state.requests)
