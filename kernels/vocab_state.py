"""Admission of token ids into the dynamic vocabulary's per-row state (see ``trimpass.state``).

Buffers: ``slot[B, V+1]`` (int32, -1 = inactive), ``idx[B, CAP+1]``, ``stamp[B, CAP+1]`` (int64),
``count[B]`` (int32); column ``V`` / ``CAP`` is scratch. One call admits ``ids[B, S]`` as a set,
stamped with the current clock ``now``: active ids are re-stamped; new ids, ranked by id, take the
free slots from ``count`` on, then evict the least recently stamped non-core slots not seen in this
call (ties by slot index); new ids beyond that wait. The kernel runs one program per row (for
``S <= MAX_S``; prefill-sized calls use the reference), with barriers where the row's own writes
are read back. The file holds, in order: the kernel, its launch configuration, the launcher, and the
pure-torch reference with the same signature.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

INT64_MAX = 2**63 - 1


@triton.jit
def _admit_kernel(
    slot_ptr, idx_ptr, stamp_ptr, count_ptr, clock_ptr, ids_ptr, scratch_ptr,
    S, CAP, n_core, K_EV,
    stride_slot, stride_idx, stride_stamp, stride_ids, stride_scr,
    BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    now = tl.load(clock_ptr)
    offs_s = tl.arange(0, BLOCK_S)
    ms = offs_s < S
    ids = tl.load(ids_ptr + b * stride_ids + offs_s, mask=ms, other=0).to(tl.int64)
    same = (ids[:, None] == ids[None, :]) & (offs_s[None, :] < offs_s[:, None]) & ms[None, :]
    first = ms & (tl.max(same.to(tl.int32), axis=1) == 0)
    cur = tl.load(slot_ptr + b * stride_slot + ids, mask=ms, other=-1).to(tl.int64)
    present = first & (cur >= 0)
    tl.store(stamp_ptr + b * stride_stamp + cur, tl.zeros_like(cur) + now, mask=present)
    new = first & (cur < 0)
    rank = tl.sum((new[None, :] & (ids[None, :] < ids[:, None])).to(tl.int64), axis=1)
    count0 = tl.load(count_ptr + b).to(tl.int64)
    free_pos = count0 + rank
    use_free = free_pos < CAP
    tl.debug_barrier()  # the re-stamps above must be visible to the eviction scan below
    offs_c = tl.arange(0, BLOCK_C)
    mc = offs_c < CAP
    st = tl.load(stamp_ptr + b * stride_stamp + offs_c, mask=mc, other=0)
    elig = mc & (offs_c >= n_core) & (offs_c < count0) & (st != now)
    key = tl.where(elig, st * (CAP + 1) + offs_c, INT64_MAX)
    tl.store(scratch_ptr + b * stride_scr + offs_c, tl.sort(key), mask=mc)
    tl.debug_barrier()
    ev_raw = rank - (CAP - count0)
    ev_idx = tl.minimum(tl.maximum(ev_raw, 0), K_EV - 1)
    ekey = tl.load(scratch_ptr + b * stride_scr + ev_idx, mask=ms, other=INT64_MAX)
    ev_ok = (ekey != INT64_MAX) & (ev_raw < K_EV)
    target = tl.where(use_free, free_pos, ekey % (CAP + 1))
    ok = new & (use_free | ev_ok)
    evicting = ok & (~use_free)
    old = tl.load(idx_ptr + b * stride_idx + target, mask=evicting, other=0)
    tl.store(slot_ptr + b * stride_slot + old, tl.full([BLOCK_S], -1, tl.int32), mask=evicting)
    tl.debug_barrier()
    tl.store(idx_ptr + b * stride_idx + target, ids, mask=ok)
    tl.store(slot_ptr + b * stride_slot + ids, target.to(tl.int32), mask=ok)
    tl.store(stamp_ptr + b * stride_stamp + target, tl.zeros_like(target) + now, mask=ok)
    tl.store(count_ptr + b, (count0 + tl.sum((ok & use_free).to(tl.int64), axis=0)).to(tl.int32))


MAX_S = 64  # ids per row per call handled by the kernel ([S, S] compares live in registers)


def admit(slot, idx, stamp, count, clock, ids, n_core: int) -> None:
    """Launch one program per row; ``clock`` must already hold this call's stamp."""
    B, S = ids.shape
    cap = idx.shape[1] - 1
    if S == 0:
        return
    scratch = torch.empty((B, cap), dtype=torch.int64, device=idx.device)
    _admit_kernel[(B,)](
        slot, idx, stamp, count, clock, ids, scratch,
        S, cap, n_core, min(S, cap),
        slot.stride(0), idx.stride(0), stamp.stride(0), ids.stride(0), scratch.stride(0),
        BLOCK_S=max(16, triton.next_power_of_2(S)), BLOCK_C=triton.next_power_of_2(cap),
    )


def admit_reference(slot, idx, stamp, count, clock, ids, n_core: int) -> None:
    """Pure-torch admission with the kernel's semantics: static shapes, no host sync."""
    B, S = ids.shape
    V, cap = slot.shape[1] - 1, idx.shape[1] - 1
    now = clock.expand(B, S)
    sids, _ = ids.sort(dim=1)
    first = torch.ones_like(sids, dtype=torch.bool)
    first[:, 1:] = sids[:, 1:] != sids[:, :-1]
    cur = slot.gather(1, sids).long()
    stamp.scatter_(1, torch.where(first & (cur >= 0), cur, cap), now)
    new = first & (cur < 0)
    rank = new.long().cumsum(1) - 1
    count64 = count.long()[:, None]
    free_pos = count64 + rank
    use_free = free_pos < cap
    slots = torch.arange(cap, device=idx.device)
    elig = (slots >= n_core) & (slots < count64) & (stamp[:, :cap] != clock)
    key = torch.where(elig, stamp[:, :cap] * (cap + 1) + slots, INT64_MAX)
    k_ev = min(S, cap)
    ev_key = key.topk(k_ev, dim=1, largest=False).values  # ascending
    ev_raw = rank - (cap - count64)
    ekey = ev_key.gather(1, ev_raw.clamp(0, k_ev - 1))
    ev_ok = (ekey != INT64_MAX) & (ev_raw < k_ev)
    ok = new & (use_free | ev_ok)
    target = torch.where(ok, torch.where(use_free, free_pos, ekey % (cap + 1)), cap)
    slot.scatter_(1, torch.where(ok & ~use_free, idx.gather(1, target), V), -1)
    idx.scatter_(1, target, torch.where(ok, sids, idx.gather(1, target)))
    slot.scatter_(1, torch.where(ok, sids, V), target.to(slot.dtype))
    stamp.scatter_(1, target, now)
    count.add_((ok & use_free).sum(1).to(count.dtype))
