"""The escape path: ids outside a request's active set that the drafter is likely to want, found by
a training-free low-rank proxy of its own head, and only when the trimmed distribution is unsure.

The proxy of a head ``W[V, d]`` is its best rank-``r`` approximation seen from the input side:
``V_r`` (the top-``r`` eigenvectors of ``WᵀW``, i.e. W's right singular vectors) and
``P = W V_r`` ``[V, r]`` stored in bf16 as ``Pᵀ`` ``[r, V]`` (a one-row product over ``r`` long
rows runs 2.5x faster here than over ``V`` short ones), so ``score(h) = (h V_r) Pᵀ ≈ h Wᵀ`` reads
``r/d`` of the head's rows at half the bytes. It is rebuilt whenever the weight changes (in place
or by ``load_state_dict``: its version counter or storage moves). On a step, each batch row's
confidence is the trimmed distribution's max probability at its last position; rows below
``gate`` take the proxy's top-``k`` ids outside their active set, which get their exact logits
written into the full-vocabulary output and are admitted into their request row as its least
recently seen ids (the request's own ids evict them first), at most ``slots`` of them a row:
past that, or past the row's free slots, they overwrite its escaped slots, lowest first, so what a
long generation's escapes hold stays bounded (unbounded, escaped ids filled free slots and stayed).
Escaped ids never evict a seen id and never push a row past its capacity. On CPU the gate
branches on the host; on other devices every row computes the proxy and a ``where`` selects, so the
step has static shapes and no host read (CUDA-graph capturable).
"""
from __future__ import annotations

import torch

from trimpass import base
from trimpass.kernels.vocab_state import capacity_of, put, take

__all__ = ["Proxy", "escape_step", "top_ids"]


class Proxy:
    """A low-rank proxy of one head weight, rebuilt when that weight changes."""

    def __init__(self, rank: int):
        self.rank = rank
        self.key = None
        self.basis = self.proj = None  # V_r [d, r] (weight dtype), Pᵀ [r, V] (bf16)

    def of(self, weight: torch.Tensor) -> Proxy:
        key = (weight.data_ptr(), weight._version, tuple(weight.shape), weight.dtype)
        if key != self.key:
            if self.key is not None and weight.is_cuda and torch.cuda.is_current_stream_capturing():
                # the build's eigh cannot be captured (cusolver fails); the pass keeps weights
                # static, so a weight that moved between warm-up and capture is a copy
                raise RuntimeError(
                    "escape proxy: the head weight moved while a CUDA graph was being captured, "
                    "so the graph was given a copy of it; compile the drafter with the trimpass "
                    "backend directly (its weights stay static inputs), or set escape=None")
            self.build(weight)
            self.key = key
        return self

    def reserve(self, V: int, d: int, dtype: torch.dtype, device) -> None:
        """Allocate the proxy's tensors for a ``[V, d]`` head now, when the graph is built: the
        first step fills them in place. Allocated inside that step, they would outlive a CUDA-graph
        tree's warm-up run in its memory pool, which torch refuses ("tensors in the cudagraph pool
        not tracked as outputs")."""
        if self.rank < d and not self._fits(V, d, dtype, device):
            self.basis = torch.empty((d, self.rank), dtype=dtype, device=device)
            self.proj = torch.empty((self.rank, V), dtype=torch.bfloat16, device=device)

    def _fits(self, V, d, dtype, device) -> bool:
        return self.basis is not None and self.basis.shape == (d, self.rank) and \
            self.basis.dtype == dtype and self.basis.device == torch.device(device) and \
            self.proj.shape == (self.rank, V)

    @torch.no_grad()
    def build(self, weight: torch.Tensor) -> None:
        (V, d), dtype, device = weight.shape, weight.dtype, weight.device
        if self.rank >= d:
            raise ValueError(f"escape.rank: {self.rank} must be below the head's width d={d} "
                             "(a full-rank proxy costs as much as the head)")
        w = weight.float()
        gram = w.T @ w
        _, vecs = torch.linalg.eigh(gram)  # ascending eigenvalues
        basis = vecs[:, -self.rank:].flip(1)
        self.reserve(V, d, dtype, device)  # a no-op where the graph's build reserved them
        self.basis.copy_(basis)
        self.proj.copy_((w @ basis).T)

    def scores(self, h: torch.Tensor) -> torch.Tensor:
        """Approximate logits ``[N, V]`` of hidden states ``h[N, d]``."""
        z = (h.to(self.basis.dtype) @ self.basis).to(torch.bfloat16)
        return z @ self.proj


def confidence(last: torch.Tensor, idx: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Max probability of the trimmed distribution ``[B]`` from full logits ``last[B, V]``."""
    return max_prob(last.gather(1, idx), count)


def max_prob(z: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Max probability ``[B]`` of the softmax over each row's first ``count`` logits ``z[B, n]``."""
    z = z.to(torch.float32, copy=True)
    z.masked_fill_(torch.arange(z.shape[1], device=z.device) >= count[:, None], float("-inf"))
    return z.sub_(z.amax(1, keepdim=True)).exp_().sum(1).reciprocal_()  # 1 / sum(exp(z - max))


def _unsure_rows(last, idx, count, compact_last, s) -> list[int]:
    """The host path's gate: rows with a free slot (escaped ids never evict one) whose trimmed
    distribution's max probability is below the gate, or that have no active id at all; read row
    by row in as few ops as possible (each small op costs ~10 us inside a step, with the caches
    cold from the drafter's matmuls)."""
    rows = []
    for r, c in enumerate(count.tolist()):
        if c >= s.capacity:
            continue
        z = compact_last[r, :c] if compact_last is not None else \
            last[r].gather(0, idx[r, :c].long())
        if not c or float(base.softmax_max(z, 0)) < s.escape.gate:
            rows.append(r)
    return rows


BLOCK = 256  # columns per block of the two-level top-k


def top_ids(s: torch.Tensor, k: int) -> torch.Tensor:
    """Columns of the ``k`` largest entries of each row of ``s[N, V]`` (``torch.topk``'s, up to the
    order of ties). Only ``k`` blocks of ``BLOCK`` columns are searched: those with the largest
    maxima, which hold every entry above the k-th largest value and enough entries equal to it.
    A V-wide ``topk`` costs ~260 us a row here; a block max and two short ``topk`` ~50."""
    N, V = s.shape
    k = min(k, V)  # a vocabulary smaller than the escape's top-k
    nb = V // BLOCK
    if nb <= 2 * k:
        return s.topk(k, dim=1).indices
    blocks = s[:, :nb * BLOCK].reshape(N, nb, BLOCK).amax(2).topk(k, dim=1).indices
    cols = (blocks[:, :, None] * BLOCK + torch.arange(BLOCK, device=s.device)).reshape(N, -1)
    if nb * BLOCK < V:  # the tail, fewer than BLOCK columns, always competes
        cols = torch.cat([cols, torch.arange(nb * BLOCK, V, device=s.device).expand(N, -1)], 1)
    return cols.gather(1, s.gather(1, cols).topk(k, dim=1).indices)


def _exact(h, weight, bias, ids, scale, cap):
    z = torch.einsum("nd,nkd->nk", h.to(weight.dtype), weight[ids]).float()
    if bias is not None:
        z = z + bias[ids].float()
    return base.softcap(z * scale, cap, inplace=True)


@torch.no_grad()
def escape_step(state, out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias,
                idx: torch.Tensor, count: torch.Tensor, scale: float = 1.0,
                softcap: float = 0.0, compact_last: torch.Tensor | None = None) -> None:
    """Run the escape path for the last position of each of ``out``'s batch rows, in place:
    ``out[B, ..., V]`` the trimmed head's full logits, ``x`` its input, ``idx[B, CAP]`` /
    ``count[B]`` the active ids it read, ``compact_last[B, n]`` (optional) the compact logits of
    each row's last position, which the confidence is read from instead of ``out`` when given;
    admitted ids go into ``state``'s rows. On CPU the small ops run on one thread, the proxy's
    V-wide product on all."""
    host = out.is_cpu and not base.use_triton(out)  # the CPU path may read on the host
    n = torch.get_num_threads()
    with base.threads(1 if host else n):
        _escape(state, out, x, weight, bias, idx, count, scale, softcap, host, n, compact_last)


def _escape(state, out, x, weight, bias, idx, count, scale, softcap, host: bool,
            threads: int, compact_last) -> None:
    s, proxy = state.settings, state.proxy.of(weight)  # built (and checked) on the first step
    B, V = idx.shape[0], out.shape[-1]
    last = out.reshape(B, -1, V)[:, -1]
    h = x.reshape(B, -1, x.shape[-1])[:, -1]
    if host:
        rows = _unsure_rows(last, idx, count, compact_last, s)
        if not rows:
            return
        state.fired.add_(len(rows))
        rows = torch.tensor(rows, device=idx.device)
        h, idx_f = h[rows], idx[rows]
    else:
        conf = confidence(last, idx, count) if compact_last is None else \
            max_prob(compact_last, count)
        # a full row takes no escaped id; an empty row's confidence is NaN (no distribution): it
        # fires, as on the host path
        fire = (count < s.capacity) & ~(conf >= s.escape.gate)
        rows, idx_f = None, idx
    with base.threads(threads):
        sc = proxy.scores(h)  # [N, V] bf16, kept so: a float copy is 1 MB a row more to write
    if host:  # only ids outside the active set compete
        for i, c in enumerate(count[rows].tolist()):
            sc[i].index_fill_(0, idx_f[i, :c], float("-inf"))
    else:  # slots past a count may repeat a live id: amin lets -inf win whatever the order
        valid = torch.arange(idx_f.shape[1], device=idx.device) < count[:, None]
        sc.scatter_reduce_(1, idx_f, torch.where(valid, float("-inf"), float("inf")).to(
            sc.dtype), "amin")
    top = top_ids(sc, s.escape.topk)
    pool = state.rows_of(B)
    pool = torch.arange(pool.start, pool.stop, device=idx.device) if isinstance(pool, slice) \
        else pool
    if host:
        fire = torch.ones(len(rows), dtype=torch.bool, device=idx.device)
        last, pool = last[rows], pool[rows]
    # fewer outside ids than topk: the rest are active ids scored -inf, never admitted again
    kept = _keep(state, pool, top, fire[:, None] & (sc.gather(1, top) != float("-inf")))
    exact = _exact(h, weight, bias, top, scale, softcap).to(out.dtype)
    new = torch.where(kept, exact, last.gather(1, top))  # the output's ids stay the active set
    if host:
        out.reshape(B, -1, V)[rows[:, None], -1, top] = new
    else:
        last.scatter_(1, top, new)
        state.fired.add_(fire.sum())


def _keep(state, pool, top, ok) -> torch.Tensor:
    """Admit the escaped ids ``top[ok]`` into rows ``pool``, stamped 0 (least recently seen: the
    ids a request receives evict them first; one it receives is stamped like any other), at most
    ``escape.slots`` a row: past that, and past the row's free slots, they replace its escaped
    ids in slot order. Never evicts a seen id; static shapes, no host read. Returns which were
    kept."""
    budget = state.settings.escape.slots
    I, T, C = take(state.idx, pool), take(state.stamp, pool), take(state.count, pool)  # noqa: E741
    cap = capacity_of(state.idx)
    C64 = C.long()[:, None]
    slots = torch.arange(cap, device=I.device)
    escaped = (slots >= state.n_core) & (slots < C64) & (T[:, :cap] == 0)
    E = escaped.sum(1, keepdim=True)
    free = (cap - C64).clamp(min=0)
    if budget is not None:
        free = torch.minimum(free, (budget - E).clamp(min=0))
    rank = ok.long().cumsum(1) - 1
    append = ok & (rank < free)
    k = min(top.shape[1], cap)
    oldest = torch.where(escaped, slots, cap).topk(k, dim=1, largest=False).values
    back = (rank - free).clamp(0, k - 1)
    reuse = ok & ~append & (rank - free < E) & (back < k)
    target = torch.where(append, C64 + rank, torch.where(reuse, oldest.gather(1, back), cap))
    put_ok = append | reuse
    I.scatter_(1, target, torch.where(put_ok, top, I.gather(1, target)).to(I.dtype))
    T.scatter_(1, target, torch.where(put_ok, 0, T.gather(1, target)))
    put(state.idx, pool, I)
    put(state.stamp, pool, T)
    put(state.count, pool, C + append.sum(1).to(C.dtype))
    return put_ok
