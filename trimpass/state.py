"""The dynamic mode's device-resident active vocabulary, one per drafter, one row per batch row.

Buffers (per batch size B, made when a graph of that size is compiled): ``slot[B, V+1]`` (int32;
the slot holding each id, -1 when inactive), ``idx[B, CAP+1]`` (the active ids: the buffer the head
reads, with ``count[B]`` valid entries), ``stamp[B, CAP+1]`` (the step each slot was last seen, for
least-recently-seen eviction), ``clock[1]``. The last column of ``slot`` and of ``idx``/``stamp`` is
a scratch target for masked scatters, and is never inside the count. The first ``n_core`` slots hold
the core set (the kept ids and any configured core list) and are never evicted.

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

import torch

from trimpass.kernels import vocab_state

_lib = torch.library.Library("trimpass", "FRAGMENT")
_lib.define("admit(Tensor(a!) slot, Tensor(b!) idx, Tensor(c!) stamp, Tensor(d!) count, "
            "Tensor(e!) clock, Tensor ids, Tensor? pos, int n_core) -> ()")


def _use_kernel(t: torch.Tensor) -> bool:
    from trimpass import ops
    return ops._use_triton(t)


def admit_(slot, idx, stamp, count, clock, ids, pos, n_core: int) -> None:
    """Admit ``ids[B, ...]``: the Triton kernel on CUDA (or when forced), torch ops elsewhere;
    neither reads a device value on the host."""
    B, V, cap = slot.shape[0], slot.shape[1] - 1, idx.shape[1] - 1
    ids = ids.reshape(B, -1).long()
    if ids.device.type == "cpu":  # a check without a device sync is only possible here
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= V):
            raise ValueError(f"ids: token ids must be in [0, {V}), got {int(ids.min())}.."
                             f"{int(ids.max())}")
    else:
        torch._assert_async(((ids >= 0) & (ids < V)).all(), "trimpass: token id out of range")
    ids = ids.clamp(0, V - 1)
    if pos is not None:
        fresh = pos.reshape(B, -1)[:, :1] == 0  # [B, 1]: a new request starts on this row
        slot.masked_fill_(fresh, -1)
        core = torch.arange(n_core, device=slot.device, dtype=slot.dtype).expand(B, n_core)
        slot.scatter_(1, idx[:, :n_core], core)  # core ids stay active
        count.copy_(torch.where(fresh[:, 0], torch.full_like(count, n_core), count))
        stamp.masked_fill_(fresh & (torch.arange(cap + 1, device=stamp.device) >= n_core), -1)
    clock.add_(1)
    if _use_kernel(ids) and ids.shape[1] <= vocab_state.MAX_S:
        vocab_state.admit(slot, idx, stamp, count, clock, ids.contiguous(), n_core)
    else:
        vocab_state.admit_reference(slot, idx, stamp, count, clock, ids, n_core)


_lib.define("refresh(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) slot, Tensor(b!) idx, "
            "Tensor(c!) stamp, Tensor(d!) count, Tensor(e!) clock, int n_core, int every, "
            "int topk, int state_id) -> ()")
# Host-side step counters, keyed by a state id baked into the graph: compiled graphs hand the op
# functionalized copies of the buffers, so no tensor address identifies a state.
_steps: dict[tuple, int] = {}


def refresh_(x, weight, bias, slot, idx, stamp, count, clock, n_core: int, every: int,
             topk: int, state_id: int) -> None:
    """Every ``every``-th call, compute the full head for each row's last position and admit its
    top ``topk`` ids. The schedule is counted on the host (no device read); inside a CUDA-graph
    capture it is skipped, so captured graphs never refresh."""
    key = (state_id, idx.shape[0])
    step = _steps.get(key, 0)
    _steps[key] = step + 1
    if every <= 0 or step % every or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    B = idx.shape[0]
    last = x.reshape(B, -1, x.shape[-1])[:, -1]
    top = torch.nn.functional.linear(last, weight, bias).topk(topk, dim=-1).indices
    admit_(slot, idx, stamp, count, clock, top, None, n_core)


def _noop_fake(*args):
    return None


for _name, _impl in (("admit", admit_), ("refresh", refresh_)):
    _lib.impl(_name, _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"trimpass::{_name}", _noop_fake, lib=_lib)


class ActiveState:
    """One drafter's active vocabulary; buffers per batch size, all on the head's device."""

    def __init__(self, config):
        self.config = config
        self.rows: dict[int, dict[str, torch.Tensor]] = {}
        self.V = None

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
            n_core = int(core.numel())
            if n_core >= cap:
                raise ValueError(f"capacity: {cap} leaves no room beside the {n_core} core and "
                                 "kept ids; raise capacity")
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
            self.rows[B] = buf
        return self.rows[B]

    def admit(self, ids: torch.Tensor) -> None:
        """Admit ``ids[B, ...]`` into the rows of batch size B (eagerly, outside any graph)."""
        b = self.rows.get(ids.shape[0])
        if b is None:
            raise ValueError(f"ids: no state for batch size {ids.shape[0]} yet; run the compiled "
                             f"drafter on such a batch first (have: {sorted(self.rows)})")
        torch.ops.trimpass.admit(b["slot"], b["idx"], b["stamp"], b["count"], b["clock"],
                                 ids.to(b["idx"].device), None, b["n_core"])

    def observe(self, target: torch.Tensor, k: int = 3) -> None:
        ids = target.topk(k, dim=-1).indices if target.is_floating_point() else target
        self.admit(ids.reshape(ids.shape[0], -1))

    def reset(self) -> None:
        for key in [k for k in _steps if k[0] == id(self)]:
            del _steps[key]
        for b in self.rows.values():
            B = b["count"].shape[0]
            torch.ops.trimpass.admit(b["slot"], b["idx"], b["stamp"], b["count"], b["clock"],
                                     b["idx"][:, :0], torch.zeros(B, 1, dtype=torch.long,
                                                                  device=b["idx"].device),
                                     b["n_core"])

    def stats(self) -> dict:
        out = {"capacity": self.config.capacity, "vocab_size": self.V}
        for B, b in self.rows.items():
            out[f"batch{B}"] = {"active": b["count"].tolist(), "core": b["n_core"],
                                "steps": int(b["clock"])}
        return out
