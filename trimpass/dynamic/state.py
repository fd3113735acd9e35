"""The dynamic mode's device-resident active vocabulary: one per drafter, one pool row per request.

A drafter's :class:`ActiveState` holds a pool of ``max_rows`` request rows. A row is the active set
of one request: ``idx[R, CAP]`` (the active ids, ``count[R]`` of them valid) and ``stamp[R, CAP]``
(the step each slot was last seen, for least-recently-seen eviction): 64 KB a row at capacity 4,096,
with no V-sized map (membership is a search of the row, capacity-sized on every device).
``bound[R]`` maps batch positions to rows: identity for Hugging Face and reference loops, where a
batch position whose position input starts at 0 starts a new request in its row; an engine binds its
request ids to rows with :meth:`ActiveState.bind` (taken when a request starts, freed when it ends,
never shared). The first ``n_core`` slots of every row hold the core set and are never evicted: the
kept ids, any configured core list, then the learned core.

The learned core and the successor memory belong to the drafter and are shared by its rows: per
drafter, ``freq[V]`` counts the ids the drafter receives and every few dozen calls the most frequent
become ``learned[C]``, which each new request starts with (before any traffic: the lowest ids, which
BPE and SentencePiece vocabularies give to frequent tokens). The admission policies
(:mod:`trimpass.dynamic.policies`; registered in :data:`ADMISSION`, e.g. the opt-in successors) add
ids beside the ones a request receives and keep their own drafter-wide memory. A request's own ids
never leave its row.

Every buffer is private to the ops of :mod:`trimpass.dynamic.ops` that use it (found by the state's
serial): passed to a graph as mutated arguments, functionalization would copy the pool every step.
Each ``admit`` returns a one-element token that the next ``admit``, then ``active``, takes, so they
stay ordered. The step path has static shapes and no host read of a device value, so a compiled step
stays CUDA-graph capturable; the admission kernel is :mod:`trimpass.kernels.vocab_state`."""
from __future__ import annotations

import itertools
import weakref

import torch

from trimpass.base import use_triton
from trimpass.dynamic.escape import Proxy
from trimpass.dynamic.successors import Successors
from trimpass.kernels import vocab_state
from trimpass.kernels.vocab_state import put, take

ADMISSION = (Successors,)  # the admission policies (trimpass.dynamic.policies), in call order
LEARN_EVERY = 32  # calls between re-rankings of the learned core: a top-k over V each time
HOST_IDS = 64  # on CPU, calls with up to this many ids are admitted id by id on the host
_states: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_serials = itertools.count(1)


def owner(serial: int) -> ActiveState:
    """The state a compiled graph names by ``serial``."""
    try:
        return _states[serial]
    except KeyError:
        raise RuntimeError("trimpass: this graph's dynamic-vocabulary state is gone (its backend "
                           "was freed); recompile the drafter") from None


class ActiveState:
    """One drafter's request rows, learned core and successor memory, on the head's device."""

    def __init__(self, settings):
        self.settings = settings  # a trimpass.config.DynamicSettings
        self.serial = next(_serials)  # names it in graphs; id() is reused after GC
        _states[self.serial] = self
        self.V = None
        self.batch = 0  # the batch size of the latest call (host-side, for stats)
        self.calls = 0
        self.requests: dict = {}  # engine request id -> row
        self._steps = self._refreshes = 0  # host schedules: the learned core's ranking, refresh
        self._upkeeps, self.captured = 0, False  # the ranking's schedule once a step is captured
        self._identity = True  # batch position b uses row b (until an engine binds requests)
        self.policies: list = []  # the admission policies its settings turn on (built by build)

    # ---- construction -------------------------------------------------------------------------
    def core_ids(self) -> torch.Tensor:
        s = self.settings
        parts = [s.keep] + ([s.core] if s.core is not None else [])
        return torch.unique(torch.cat(parts))

    def build(self, V: int, device) -> None:
        """Allocate the pool and the drafter-wide tensors for a head of V rows (once)."""
        if self.V is not None:
            if V != self.V:
                raise ValueError(f"vocab size: this drafter's state was made for V={self.V}, a "
                                 f"new graph has V={V}; use one drafter per compiled module")
            return
        s, device = self.settings, torch.device(device)
        s.check_vocab_size(V)
        cap, R = s.capacity, s.max_rows
        fixed = self.core_ids().to(device)
        # before any traffic, ties go to the lowest ids (a prior below one count)
        self.freq = -torch.arange(V, dtype=torch.float32, device=device) / V
        self.freq[fixed] = float("-inf")  # fixed core ids are never learned
        self.learned = self.freq.topk(min(s.learn_core, V - int(fixed.numel()))).indices
        core = torch.cat([fixed, self.learned])
        self.n_core = int(core.numel())
        if self.n_core >= cap:
            raise ValueError(f"capacity: {cap} leaves no room beside the {self.n_core} core, "
                             "learned and kept ids; raise capacity or lower learn_core")
        self.idx, self.stamp = vocab_state.new_pool(R, cap, device)
        self.idx[:, :self.n_core] = core
        self.count = torch.full((R,), self.n_core, dtype=torch.int32, device=device)
        self.clock = torch.zeros(1, dtype=torch.long, device=device)
        self.bound = torch.arange(R, device=device)  # batch position -> row
        self.policies = [p(s, R, V, device) for p in ADMISSION if p.wanted(s)]
        self.token = torch.zeros(1, dtype=torch.long, device=device)
        self.fired = torch.zeros((), dtype=torch.long, device=device)  # escape-path row-steps
        self.proxy = None if s.escape is None else Proxy(s.escape.rank)
        self.V = V

    def check_batch(self, B: int) -> None:
        if B > self.settings.max_rows:
            raise ValueError(f"max_rows: a batch of {B} needs {B} request rows but this drafter's "
                             f"pool has {self.settings.max_rows}; pass max_rows={B} or more")

    # ---- the step (called by the ops) ---------------------------------------------------------
    def rows_of(self, B: int):
        """The pool rows of batch positions ``0..B-1``: a ``slice`` while no engine has bound
        requests (rows are then read and written in place), else an index tensor."""
        return slice(0, B) if self._identity else self.bound[:B]

    def admit(self, ids: torch.Tensor, pos: torch.Tensor | None, learn: bool = True,
              rows: torch.Tensor | None = None) -> None:
        """Admit ``ids[B, ...]`` into the rows of batch positions ``0..B-1`` (or into ``rows``); a
        position whose ``pos`` starts at 0 starts a new request first. No host read of a device
        value."""
        B, V = ids.shape[0], self.V
        self.check_batch(B)
        if rows is None:
            rows = self.rows_of(B)
            self.batch, self.calls = B, self.calls + 1
        ids = ids.reshape(B, -1).long()
        kernel = use_triton(ids)
        host = ids.is_cpu and not kernel  # the CPU path may read values on the host; no other
        if host:
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= V):
                raise ValueError(f"ids: token ids must be in [0, {V}), got {int(ids.min())}.."
                                 f"{int(ids.max())}")
        else:
            torch._assert_async(((ids >= 0) & (ids < V)).all(), "trimpass: token id out of range")
        ids = ids.clamp(0, V - 1)
        fresh = None if pos is None else pos.reshape(B, -1)[:, :1] == 0
        if fresh is not None and (not host or bool(fresh.any())):  # on CPU, skip for free
            self._restart(rows, fresh)
        if ids.shape[1]:
            for p in self.policies:
                ids = torch.cat([ids, p.extra(ids, rows)], 1)
        self.clock.add_(1)
        if kernel and ids.shape[1] <= vocab_state.MAX_S:
            vocab_state.admit(self.idx, self.stamp, self.count, self.clock,
                              self.bound[rows] if isinstance(rows, slice) else rows, ids,
                              self.n_core)
        elif host and ids.numel() <= HOST_IDS:
            vocab_state.admit_host(self.idx, self.stamp, self.count, self.clock, rows, ids,
                                   self.n_core)
        else:  # on the CPU path, skip the eviction scan when every new id fits (a host read)
            evict = not host or int(take(self.count, rows).max()) + ids.shape[1] > \
                self.settings.capacity
            vocab_state.admit_reference(self.idx, self.stamp, self.count, self.clock, rows, ids,
                                        self.n_core, evict)
        if learn and self.learned.numel():
            self.learn(ids)

    def _restart(self, rows: torch.Tensor, fresh: torch.Tensor) -> None:
        """Rows whose batch position starts a new request drop their ids (O(cap), not O(V)) and
        take the current learned core."""
        n_core, B = self.n_core, fresh.shape[0]
        lo = n_core - self.learned.numel()
        idx = take(self.idx, rows)
        idx[:, lo:n_core] = torch.where(fresh, self.learned.expand(B, -1), idx[:, lo:n_core])
        put(self.idx, rows, idx)
        put(self.count, rows, torch.where(fresh[:, 0], n_core, take(self.count, rows)))
        stale = fresh & (torch.arange(self.idx.shape[1], device=fresh.device) >= n_core)
        put(self.stamp, rows, take(self.stamp, rows).masked_fill(stale, -1))
        for p in self.policies:
            p.restart(rows, fresh)

    def active(self, B: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(idx[B, CAP], count[B])`` of batch positions ``0..B-1``: what the head reads."""
        rows = self.rows_of(B)  # copies: inductor may reuse an op's output buffer
        cap = self.settings.capacity  # the pool's scratch column dropped
        return take(self.idx, rows)[:, :cap].clone(), take(self.count, rows).clone()

    def learn(self, ids: torch.Tensor) -> None:
        """Count received ids; every ``LEARN_EVERY``-th call re-rank the learned core. Scheduled on
        the host: inside a CUDA-graph capture the counting is recorded, the ranking is left to
        :meth:`upkeep`."""
        flat = ids.reshape(-1)
        self.freq.index_add_(0, flat, torch.ones_like(flat, dtype=self.freq.dtype))
        if _capturing(self.freq):
            self.captured = True
            return
        self._steps += 1
        if self._steps % LEARN_EVERY == 0:
            self.rank()

    def upkeep(self) -> None:
        """The host's share of a step replayed from a CUDA graph, where none of the ops' Python
        runs: once the step has been captured, every ``LEARN_EVERY``-th call re-ranks the learned
        core. A loop or engine calls it once per drafter step; a no-op for steps that run their
        Python (they rank themselves) and before the first call."""
        if not self.captured:
            return
        self._upkeeps += 1
        if self._upkeeps % LEARN_EVERY == 0:
            self.rank()

    def rank(self) -> None:
        """Make the learned core the ``learn_core`` most frequent ids received so far."""
        if self.learned.numel():
            self.learned.copy_(self.freq.topk(self.learned.numel()).indices)

    def refresh(self, x: torch.Tensor, weight: torch.Tensor, bias) -> None:
        """Every ``refresh_every``-th call, compute the full head for each row's last position and
        admit its top ids (opt-in; skipped inside a CUDA-graph capture)."""
        s = self.settings
        self._refreshes += 1
        if s.refresh_every <= 0 or (self._refreshes - 1) % s.refresh_every or _capturing(x):
            return
        B = self.batch or x.shape[0]
        last = x.reshape(B, -1, x.shape[-1])[:, -1]
        k = min(s.refresh_topk, s.capacity - self.n_core)
        top = torch.nn.functional.linear(last, weight, bias).topk(k, dim=-1).indices
        self.admit(top, None, learn=False)

    # ---- the host API -------------------------------------------------------------------------
    def observe(self, target: torch.Tensor, k: int = 3) -> None:
        """Admit the target's top-``k`` (logits ``[B, ..., V]``) or ids ``[B, ...]``."""
        ids = target.topk(k, dim=-1).indices if target.is_floating_point() else target
        self.admit(ids.reshape(ids.shape[0], -1), None, learn=False)

    def reset(self) -> None:
        """Start a new request in every row (the learned core is re-ranked first)."""
        if self.V is None:
            return
        self.rank()
        R = self.settings.max_rows
        self._restart(slice(0, R), torch.ones(R, 1, dtype=torch.bool, device=self.idx.device))

    def bind(self, request_ids: list, tokens: dict | None = None) -> None:
        """Engines: batch position ``i`` serves ``request_ids[i]``. A request id seen for the first
        time takes a free row (starting from the core set, then its ``tokens[rid]`` if given, so a
        resumed request rebuilds its row); rows of ids no longer bound stay taken until
        :meth:`release`."""
        new = [r for r in request_ids if r not in self.requests]
        free = sorted(set(range(self.settings.max_rows)) - set(self.requests.values()))
        if len(new) > len(free):
            raise ValueError(f"max_rows: {len(self.requests) + len(new)} live requests need more "
                             f"rows than the pool's {self.settings.max_rows}; raise max_rows")
        for rid, row in zip(new, free[:len(new)], strict=True):
            self.requests[rid] = row
        rows = [self.requests[r] for r in request_ids]
        self._identity = False
        self.bound[:len(rows)] = torch.tensor(rows, device=self.bound.device)
        if new:
            at = torch.tensor([request_ids.index(r) for r in new])
            fresh = torch.zeros(len(request_ids), 1, dtype=torch.bool, device=self.idx.device)
            fresh[at] = True
            self._restart(self.bound[:len(rows)], fresh)
            for rid in new:
                if tokens and tokens.get(rid) is not None and len(tokens[rid]):
                    toks = torch.as_tensor(tokens[rid], device=self.idx.device).reshape(1, -1)
                    row = torch.tensor([self.requests[rid]], device=self.idx.device)
                    self.admit(toks, None, learn=False, rows=row)

    def release(self, request_id) -> None:
        """Engines: a request ended (or was preempted); its row becomes free."""
        self.requests.pop(request_id, None)

    def stats(self) -> dict:
        """The schema :func:`trimpass.stats` documents (dynamic mode)."""
        B = self.batch or 1
        idx, count = self.active(B) if self.V is not None else (None, None)
        return {
            "mode": "dynamic", "vocab_size": self.V, "capacity": self.settings.capacity,
            "max_rows": self.settings.max_rows, "core": getattr(self, "n_core", 0),
            "learned": 0 if self.V is None else int(self.learned.numel()),
            "active": [] if count is None else count.tolist(), "calls": self.calls,
            "requests": len(self.requests), "bytes_per_row": self.bytes_per_row(),
            "escapes": 0 if self.V is None else int(self.fired),
            **{k: v for p in self.policies for k, v in p.stats().items()},
        }

    def bytes_per_row(self) -> int:
        """Index-state bytes of one request row: ids and stamps (with the pool's scratch column),
        count, binding, and what the admission policies keep per row (the drafter-wide tensors
        aside)."""
        row = 2 * (self.settings.capacity + vocab_state.SCRATCH) * 8 + 4 + 8
        return row + sum(p.bytes_per_row() for p in self.policies)


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()
