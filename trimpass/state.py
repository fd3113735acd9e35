"""The dynamic mode's device-resident active vocabulary, one per drafter, one row per batch row.

Buffers (per batch size B, made when a graph of that size is compiled): ``slot[B, V+1]`` (int32;
the slot holding each id, -1 when inactive), ``idx[B, CAP+1]`` (the active ids: the buffer the head
reads, with ``count[B]`` valid entries), ``stamp[B, CAP+1]`` (the step each slot was last seen, for
least-recently-seen eviction), ``clock[1]``. The last column of ``slot`` and of ``idx``/``stamp`` is
a scratch target for masked scatters, and is never inside the count. The first ``n_core`` slots hold
the core set and are never evicted: the kept ids, any configured core list, then the learned core.

The learned core needs no data from the user: ``trimpass::learn`` counts, per drafter, the ids the
drafter receives (prompts and accepted tokens) into ``freq[V]`` and every few dozen calls ranks the
most frequent into ``learned[C]``; each new request starts with those ids active. So the core is
learned from earlier requests of the traffic the drafter actually serves, on the device. Before
any traffic it is the lowest ids (measured with Qwen2.5 on ShareGPT: the lowest 1k cover 0.48 of
next tokens, a counted top-1k 0.66).

The successors need no data either: per drafter, ``succ[V+1, K]`` keeps the last K distinct ids
that followed each id (in earlier requests and this one); with every id the drafter receives, the
ids that followed it before are admitted too.

``trimpass::admit`` updates them in place from the token ids the drafter receives: static shapes,
no host read of any device value, so a compiled step stays CUDA-graph capturable. Ids admitted in
one call form a set: already-active ids are re-stamped; new ids take free slots, then evict the
least recently seen non-core slots; if a call brings more new ids than that, the surplus (highest
ids first) waits for the next call (:mod:`trimpass.kernels.vocab_state`: the Triton kernel on CUDA,
its torch reference elsewhere). A row whose position input starts at 0 is reset first (a new
request). The head is exact on every active id whatever the set is, so the policy decides speed and
draft quality, never correctness.
"""
from __future__ import annotations

import itertools
import weakref

import torch

from trimpass.kernels import vocab_state

_lib = torch.library.Library("trimpass", "FRAGMENT")
# The V-sized tensors (the slot map, the learned core's counts) are private to the ops that update
# them: no graph op reads them, so they are found by the state's serial rather than passed in.
# Passed in, functionalization would clone and copy back 1 MB each per step (measured on CPU with
# aot_eager: +1.7 ms a step, more than the 2-layer Gemma drafter's trimmed head and state together).
_lib.define("admit(Tensor(a!) idx, Tensor(b!) stamp, Tensor(c!) count, Tensor(d!) clock, "
            "Tensor ids, Tensor? pos, int n_core, Tensor? learned, int state, int follow=0) -> ()")
_states: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _owner(state: int) -> "ActiveState":
    try:
        return _states[state]
    except KeyError:
        raise RuntimeError("trimpass: this graph's dynamic-vocabulary state is gone (its backend "
                           "was freed); recompile the drafter") from None


def _use_kernel(t: torch.Tensor) -> bool:
    from trimpass import ops
    return ops._use_triton(t)


def admit_(slot, idx, stamp, count, clock, ids, pos, n_core: int, learned=None) -> None:
    """Admit ``ids[B, ...]``: the Triton kernel on CUDA (or when forced), torch ops elsewhere;
    neither reads a device value on the host. A fresh row's last ``learned.numel()`` core slots
    take the learned core ids."""
    B, V, cap = slot.shape[0], slot.shape[1] - 1, idx.shape[1] - 1
    ids = ids.reshape(B, -1).long()
    if ids.device.type == "cpu":  # a check without a device sync is only possible here
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= V):
            raise ValueError(f"ids: token ids must be in [0, {V}), got {int(ids.min())}.."
                             f"{int(ids.max())}")
    else:
        torch._assert_async(((ids >= 0) & (ids < V)).all(), "trimpass: token id out of range")
    ids = ids.clamp(0, V - 1)
    fresh = None if pos is None else pos.reshape(B, -1)[:, :1] == 0  # [B, 1]: a new request
    if fresh is not None and (not fresh.is_cpu or bool(fresh.any())):  # on CPU, skip for free
        live = torch.arange(cap + 1, device=idx.device) < count.long()[:, None]
        slot.scatter_(1, torch.where(fresh & live, idx, V), -1)  # O(cap) per row, not O(V)
        if learned is not None and learned.numel():
            lo = n_core - learned.numel()
            idx[:, lo:n_core] = torch.where(fresh, learned.expand(B, -1), idx[:, lo:n_core])
        core = torch.arange(n_core, device=slot.device, dtype=slot.dtype).expand(B, n_core)
        slot.scatter_(1, idx[:, :n_core], core)  # core ids stay active
        count.copy_(torch.where(fresh[:, 0], torch.full_like(count, n_core), count))
        stamp.masked_fill_(fresh & (torch.arange(cap + 1, device=stamp.device) >= n_core), -1)
    clock.add_(1)
    if _use_kernel(ids) and ids.shape[1] <= vocab_state.MAX_S:
        vocab_state.admit(slot, idx, stamp, count, clock, ids.contiguous(), n_core)
    else:
        vocab_state.admit_reference(slot, idx, stamp, count, clock, ids, n_core)


_lib.define("refresh(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) idx, Tensor(b!) stamp, "
            "Tensor(c!) count, Tensor(d!) clock, int n_core, int every, int topk, int state) -> ()")
# Host-side step counters, keyed by a state id baked into the graph: compiled graphs hand the op
# functionalized copies of the buffers, so no tensor address identifies a state.
_steps: dict[tuple, int] = {}
_serials = itertools.count(1)


def admit_op(idx, stamp, count, clock, ids, pos, n_core: int, learned, state: int,
             follow: int = 0) -> None:
    """The graph's op: with ``follow``, the ids that followed each received id before come too."""
    st, B = _owner(state), idx.shape[0]
    if follow:
        ids = torch.cat([ids.reshape(B, -1), st.follow(ids, pos)], 1)
    admit_(st.rows[B]["slot"], idx, stamp, count, clock, ids, pos, n_core, learned)


def refresh_(x, weight, bias, idx, stamp, count, clock, n_core: int, every: int, topk: int,
             state: int) -> None:
    """Every ``every``-th call, compute the full head for each row's last position and admit its
    top ``topk`` ids. The schedule is counted on the host (no device read); inside a CUDA-graph
    capture it is skipped, so captured graphs never refresh."""
    key = (state, idx.shape[0])
    step = _steps.get(key, 0)
    _steps[key] = step + 1
    if every <= 0 or step % every or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    B = idx.shape[0]
    last = x.reshape(B, -1, x.shape[-1])[:, -1]
    top = torch.nn.functional.linear(last, weight, bias).topk(topk, dim=-1).indices
    admit_op(idx, stamp, count, clock, top, None, n_core, None, state)


_lib.define("learn(Tensor(a!) learned, Tensor ids, int every, int state) -> ()")


def learn_op(learned, ids, every: int, state: int) -> None:
    learn_(_owner(state).freq, learned, ids, every, state)


def learn_(freq, learned, ids, every: int, state_id: int) -> None:
    """Count the ids the drafter receives into ``freq[V]``; every ``every``-th call, make
    ``learned`` the most frequent ones (the next requests' learned core). Scheduled on the host,
    as ``refresh_`` is: a captured CUDA graph keeps counting but does not re-rank."""
    flat = ids.reshape(-1).long().clamp(0, freq.numel() - 1)
    freq.index_put_((flat,), torch.ones_like(flat, dtype=freq.dtype), accumulate=True)
    key = (state_id, "learn")
    step = _steps.get(key, 0) + 1
    _steps[key] = step
    if step % every == 0 and not (freq.is_cuda and torch.cuda.is_current_stream_capturing()):
        rank_(freq, learned)


def rank_(freq, learned) -> None:
    """Make ``learned`` the ``learned.numel()`` most frequent ids of ``freq``."""
    learned.copy_(freq.topk(learned.numel()).indices)


def _noop_fake(*args):
    return None


for _name, _impl in (("admit", admit_op), ("refresh", refresh_), ("learn", learn_op)):
    _lib.impl(_name, _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"trimpass::{_name}", _noop_fake, lib=_lib)


class ActiveState:
    """One drafter's active vocabulary; buffers per batch size, all on the head's device."""

    def __init__(self, config):
        self.config = config
        self.serial = next(_serials)  # names it in graphs and schedules; id() is reused after GC
        _states[self.serial] = self
        self.rows: dict[int, dict[str, torch.Tensor]] = {}
        self.V = None
        self.freq = self.learned = self.succ = None  # drafter-wide: shared by every batch size

    def core_ids(self) -> torch.Tensor:
        parts = [self.config._keep] + ([self.config._core] if self.config._core is not None else [])
        return torch.unique(torch.cat(parts)) if parts else torch.empty(0, dtype=torch.long)

    def buffers(self, B: int, V: int, device) -> dict[str, torch.Tensor]:
        """The buffers for batch size ``B`` (made, with the core set admitted, on first use)."""
        if self.V is not None and V != self.V:
            raise ValueError(f"vocab size: this drafter's state was made for V={self.V}, a new "
                             f"graph has V={V}; use one backend per drafter")
        self.V = V
        if B not in self.rows:
            self.config.check_vocab_size(V)
            cap = self.config.capacity
            core = self.core_ids()
            if self.succ is None:  # [V+1, K]: the last K distinct ids seen after each id; row V
                self.succ = torch.full((V + 1, self.config.successors), -1, dtype=torch.int32,
                                       device=device)  # is scratch for pairs with no first id
            if self.freq is None:
                # before any traffic, ties go to the lowest ids: BPE and SentencePiece
                # vocabularies list frequent tokens first (a prior below one count)
                self.freq = -torch.arange(V, dtype=torch.float32, device=device) / V
                self.freq[core.to(device)] = float("-inf")  # fixed core ids are never learned
                n_learn = min(self.config.learn_core, V - int(core.numel()))
                self.learned = self.freq.topk(n_learn).indices
            core = torch.cat([core.to(device), self.learned])
            n_core = int(core.numel())
            if n_core >= cap:
                raise ValueError(f"capacity: {cap} leaves no room beside the {n_core} core, "
                                 "learned and kept ids; raise capacity or lower learn_core")
            buf = dict(
                slot=torch.full((B, V + 1), -1, dtype=torch.int32, device=device),
                idx=torch.zeros((B, cap + 1), dtype=torch.long, device=device),
                stamp=torch.full((B, cap + 1), -1, dtype=torch.long, device=device),
                count=torch.full((B,), n_core, dtype=torch.int32, device=device),
                clock=torch.zeros(1, dtype=torch.long, device=device),
            )
            if n_core:
                buf["idx"][:, :n_core] = core.to(device)
                buf["slot"][:, core.to(device)] = torch.arange(n_core, dtype=torch.int32,
                                                               device=device)
            buf["n_core"] = n_core
            buf["last"] = torch.full((B,), -1, dtype=torch.long, device=device)  # last id per row
            self.rows[B] = buf
        return self.rows[B]

    def admit(self, ids: torch.Tensor) -> None:
        """Admit ``ids[B, ...]`` into the rows of batch size B (eagerly, outside any graph)."""
        b = self.rows.get(ids.shape[0])
        if b is None:
            raise ValueError(f"ids: no state for batch size {ids.shape[0]} yet; run the compiled "
                             f"drafter on such a batch first (have: {sorted(self.rows)})")
        torch.ops.trimpass.admit(*self.args(b), ids.to(b["idx"].device), None, b["n_core"], None,
                                 self.serial)

    def follow(self, ids: torch.Tensor, pos) -> torch.Tensor:
        """Record which id followed which (this call's ids after each row's last one) and return,
        for every received id, the ids that followed it before: ``[B, S*K]`` (the id itself where
        there are fewer than K). Static shapes, no host read."""
        B, (V1, K) = ids.shape[0], self.succ.shape
        ids = ids.reshape(B, -1).long().clamp(0, V1 - 2)
        last = self.rows[B]["last"]
        if pos is not None:  # a new request has no previous id
            last.masked_fill_(pos.reshape(B, -1)[:, 0] == 0, -1)
        seq = torch.cat([last[:, None], ids], 1)
        a, b = seq[:, :-1].reshape(-1), seq[:, 1:].reshape(-1)
        a = torch.where(a < 0, V1 - 1, a)  # no previous id: the scratch row
        P, ar = a.numel(), torch.arange(a.numel(), device=a.device)
        order = torch.argsort(a * (P + 1) + (P - 1 - ar))  # by predecessor, newest pair first
        a, b = a[order], b[order]
        first = torch.ones_like(a, dtype=torch.bool)
        first[1:] = a[1:] != a[:-1]
        start = torch.cummax(torch.where(first, ar, 0), 0).values
        at = (start[:, None] + torch.arange(K, device=a.device)).clamp(max=P - 1)  # [P, K]
        window = torch.where(a[at] == a[:, None], b[at], -1)  # the group's newest K successors
        cand = torch.cat([window, self.succ[a].long()], 1)  # then the ones seen before
        dup = (cand[:, :, None] == cand[:, None, :]).tril(-1).any(2) | (cand < 0)
        pick = torch.argsort(dup.to(torch.int8), dim=1, stable=True)[:, :K]
        rows = torch.where(dup.gather(1, pick), -1, cand.gather(1, pick))
        self.succ[a] = rows.to(self.succ.dtype)  # every pair of a group writes the same row
        last.copy_(ids[:, -1])
        got = self.succ[ids].long()  # [B, S, K]
        return torch.where(got < 0, ids[..., None], got).reshape(B, -1)

    @staticmethod
    def args(b: dict) -> tuple:
        """The buffers the ops take, in order (the slot map is found by the state's serial)."""
        return b["idx"], b["stamp"], b["count"], b["clock"]

    def observe(self, target: torch.Tensor, k: int = 3) -> None:
        ids = target.topk(k, dim=-1).indices if target.is_floating_point() else target
        self.admit(ids.reshape(ids.shape[0], -1))

    def reset(self) -> None:
        for key in [k for k in _steps if k[0] == self.serial and k[1] != "learn"]:
            del _steps[key]
        if self.learned is not None and self.learned.numel():
            rank_(self.freq, self.learned)
        for b in self.rows.values():
            B = b["count"].shape[0]
            torch.ops.trimpass.admit(*self.args(b), b["idx"][:, :0],
                                     torch.zeros(B, 1, dtype=torch.long, device=b["idx"].device),
                                     b["n_core"], self.learned, self.serial)

    def stats(self) -> dict:
        out = {"capacity": self.config.capacity, "vocab_size": self.V}
        for B, b in self.rows.items():
            out[f"batch{B}"] = {"active": b["count"].tolist(), "core": b["n_core"],
                                "learned": 0 if self.learned is None else self.learned.numel(),
                                "steps": int(b["clock"])}
        return out
