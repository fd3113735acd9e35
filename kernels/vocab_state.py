"""Admission of token ids into request rows of the dynamic vocabulary (see
``trimpass.dynamic.state``).

Buffers: a pool ``idx[R, CAP+1]``, ``stamp[R, CAP+1]`` (int64; column ``CAP`` is scratch) and
``count[R]`` (int32); ``rows[B]`` picks the pool row of each batch position. One call admits
``ids[B, S]`` into row ``rows[b]`` as a set, stamped with the current clock: ids already among the
row's first ``count`` slots (found by searching the row: no V-sized map) are re-stamped; new ids,
ranked by id, take the free slots from ``count`` on, then evict the least recently stamped non-core
slots not seen in this call (ties by slot index); new ids beyond that wait. The kernel runs one
program per batch position (for ``S <= MAX_S``; prefill-sized calls use the reference), with
barriers where the row's own writes are read back. The file holds, in order: the kernel, its launch
configuration, the launcher, and the pure-torch reference with the same signature."""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from trimpass.kernels import require_triton

INT64_MAX = 2**63 - 1
KEY_NONE = tl.constexpr(INT64_MAX)  # the kernel's copy: a jitted function reads only constexpr
# globals (a plain int builds under the interpreter and fails on the GPU)


@triton.jit
def _admit_kernel(
    idx_ptr, stamp_ptr, count_ptr, clock_ptr, rows_ptr, ids_ptr, scratch_ptr,
    S, CAP, n_core, K_EV,
    stride_idx, stride_stamp, stride_ids, stride_scr,
    BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, SEARCH_C: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    r = tl.load(rows_ptr + b).to(tl.int64)
    now = tl.load(clock_ptr)
    offs_s = tl.arange(0, BLOCK_S)
    ms = offs_s < S
    ids = tl.load(ids_ptr + b * stride_ids + offs_s, mask=ms, other=0).to(tl.int64)
    same = (ids[:, None] == ids[None, :]) & (offs_s[None, :] < offs_s[:, None]) & ms[None, :]
    first = ms & (tl.max(same.to(tl.int32), axis=1) == 0)
    count0 = tl.load(count_ptr + r).to(tl.int64)
    cur = tl.full([BLOCK_S], -1, tl.int32)
    for c0 in range(0, CAP, SEARCH_C):  # the row's slot of each id, -1 when absent
        offs = c0 + tl.arange(0, SEARCH_C)
        live = offs < count0
        row = tl.load(idx_ptr + r * stride_idx + offs, mask=live, other=-1)
        hit = (row[None, :] == ids[:, None]) & live[None, :]
        cur = tl.maximum(cur, tl.max(tl.where(hit, offs[None, :], -1), axis=1))
    present = first & (cur >= 0)
    tl.store(stamp_ptr + r * stride_stamp + cur, tl.zeros_like(cur) + now, mask=present)
    new = first & (cur < 0)
    rank = tl.sum((new[None, :] & (ids[None, :] < ids[:, None])).to(tl.int64), axis=1)
    free_pos = count0 + rank
    use_free = free_pos < CAP
    tl.debug_barrier()  # the re-stamps above must be visible to the eviction scan below
    offs_c = tl.arange(0, BLOCK_C)
    mc = offs_c < CAP
    st = tl.load(stamp_ptr + r * stride_stamp + offs_c, mask=mc, other=0)
    elig = mc & (offs_c >= n_core) & (offs_c < count0) & (st != now)
    key = tl.where(elig, st * (CAP + 1) + offs_c, KEY_NONE)
    tl.store(scratch_ptr + b * stride_scr + offs_c, tl.sort(key), mask=mc)
    tl.debug_barrier()
    ev_raw = rank - (CAP - count0)
    ev_idx = tl.minimum(tl.maximum(ev_raw, 0), K_EV - 1)
    ekey = tl.load(scratch_ptr + b * stride_scr + ev_idx, mask=ms, other=KEY_NONE)
    ev_ok = (ekey != KEY_NONE) & (ev_raw < K_EV)
    target = tl.where(use_free, free_pos, ekey % (CAP + 1))
    ok = new & (use_free | ev_ok)
    tl.store(idx_ptr + r * stride_idx + target, ids, mask=ok)
    tl.store(stamp_ptr + r * stride_stamp + target, tl.zeros_like(target) + now, mask=ok)
    tl.store(count_ptr + r, (count0 + tl.sum((ok & use_free).to(tl.int64), axis=0)).to(tl.int32))


SCRATCH = 1  # columns each pool row carries past its capacity: where a static-shape scatter sends
# the writes of ids that get no slot
MAX_S = 64  # ids per row per call handled by the kernel ([S, S] compares live in registers)
SEARCH_C = 256  # slots compared per step of the row search ([S, SEARCH_C] in registers) ...
COMPARES = 4096  # ... and at most this many ids x slots: 64 ids x 256 slots spill on the GPU
NUM_WARPS = 16  # the capacity-wide sort's keys (4,096 int64) spread over 512 threads: 4 warps
# need 255 registers and spill, and build for 90 s on sm_80


KERNEL = _admit_kernel  # for builds ahead of time (the GPU build check)


def new_pool(rows: int, capacity: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A pool of ``rows`` empty request rows: ``idx`` (ids) and ``stamp`` (-1: never seen), each
    ``[rows, capacity + SCRATCH]`` int64."""
    shape = (rows, capacity + SCRATCH)
    return (torch.zeros(shape, dtype=torch.long, device=device),
            torch.full(shape, -1, dtype=torch.long, device=device))


def capacity_of(idx: torch.Tensor) -> int:
    """The capacity of a pool made by :func:`new_pool`."""
    return idx.shape[1] - SCRATCH


def admit(idx, stamp, count, clock, rows, ids, n_core: int) -> None:
    """Launch one program per batch position; ``clock`` must already hold this call's stamp."""
    check_launch(idx, stamp, count, clock, rows, ids)
    if ids.shape[1] == 0:
        return
    scratch = torch.empty((ids.shape[0], capacity_of(idx)), dtype=torch.int64, device=idx.device)
    args, blocks = launch_args(idx, stamp, count, clock, rows, ids, scratch, n_core)
    _admit_kernel[(ids.shape[0],)](*args, **blocks)


def check_launch(idx, stamp, count, clock, rows, ids) -> None:
    """Raise, naming the argument (or triton's version), on a call the kernel cannot serve."""
    require_triton()
    if not (idx.is_cuda or idx.device.type == "cpu" and triton.knobs.runtime.interpret):
        raise ValueError(f"idx: on {idx.device}; the admission kernel runs on CUDA devices (on CPU "
                         "only under TRITON_INTERPRET=1; admit_host serves CPU buffers)")
    for name, t in (("stamp", stamp), ("count", count), ("clock", clock), ("rows", rows),
                    ("ids", ids)):
        if t.device != idx.device:
            raise ValueError(f"{name}: on {t.device} but the pool is on {idx.device}")
    if idx.dtype != torch.int64 or stamp.dtype != torch.int64 or idx.shape != stamp.shape \
            or idx.stride(1) != 1 or stamp.stride(1) != 1:
        raise ValueError(f"idx and stamp: expected two int64 [rows, capacity + {SCRATCH}] pools "
                         f"with contiguous rows (new_pool), got {idx.dtype} {tuple(idx.shape)} "
                         f"and {stamp.dtype} {tuple(stamp.shape)}")
    if ids.dim() != 2 or ids.shape[1] > MAX_S or ids.stride(1) != 1:
        raise ValueError(f"ids: expected [B, S] with S <= {MAX_S} ids per row (the kernel holds "
                         f"[S, S] compares in registers; admit_reference serves longer calls), "
                         f"got {tuple(ids.shape)}")
    if rows.numel() != ids.shape[0]:
        raise ValueError(f"rows: expected one pool row per batch position ({ids.shape[0]}), got "
                         f"{rows.numel()}")


def launch_args(idx, stamp, count, clock, rows, ids, scratch, n_core: int):
    """The kernel's arguments and block sizes exactly as :func:`admit` passes them (the GPU build
    check specializes its builds on these, as the JIT does at launch)."""
    S = ids.shape[1]
    cap = capacity_of(idx)
    args = (idx, stamp, count, clock, rows, ids, scratch,
            S, cap, n_core, min(S, cap),
            idx.stride(0), stamp.stride(0), ids.stride(0), scratch.stride(0))
    block_s = max(16, triton.next_power_of_2(S))
    search = min(SEARCH_C, triton.next_power_of_2(cap), max(16, COMPARES // block_s))
    blocks = dict(BLOCK_S=block_s, BLOCK_C=triton.next_power_of_2(cap), SEARCH_C=search,
                  num_warps=NUM_WARPS)
    return args, blocks


def admit_host(idx, stamp, count, clock, rows, ids, n_core: int) -> None:
    """The same admission for CPU tensors, id by id on the host (numpy views of the buffers): for
    the few ids of a decode or verify step, ~20 small vectorized ops cost more than this loop."""
    cap = capacity_of(idx)
    now = int(clock)
    I, T, C = idx.numpy(), stamp.numpy(), count.numpy()  # noqa: E741 - as in the reference
    rows = range(rows.start, rows.stop) if isinstance(rows, slice) else rows.tolist()
    for r, row_ids in zip(rows, ids.numpy(), strict=True):
        n = int(C[r])
        for i in _unseen(I[r, :n], T[r, :n], np.unique(row_ids), now):
            if n < cap:
                slot = n
                n += 1
            else:  # least recently seen non-core slot not seen in this call (ties: lowest slot)
                pool = T[r, n_core:cap]
                key = np.where(pool == now, np.iinfo(np.int64).max, pool)
                slot = n_core + int(np.argmin(key))
                if key[slot - n_core] == np.iinfo(np.int64).max:
                    break
            I[r, slot], T[r, slot] = i, now
        C[r] = n


def _unseen(live: np.ndarray, when: np.ndarray, uniq: np.ndarray, now: int) -> list[int]:
    """Stamp the slots of ``live`` holding one of the sorted distinct ids ``uniq`` with ``now``;
    return the ids ``live`` does not hold, in order. An id at a time for a few ids (a decode
    step's), one sorted search over the row for more (an escape's 64: 30 us against 140)."""
    if len(uniq) <= 8:
        new = []
        for i in uniq.tolist():
            hit = np.flatnonzero(live == i)
            if hit.size:
                when[hit[0]] = now
            else:
                new.append(i)
        return new
    pos = np.searchsorted(uniq, live).clip(max=len(uniq) - 1)
    seen = uniq[pos] == live
    when[seen] = now
    held = np.zeros(len(uniq), dtype=bool)
    held[pos[seen]] = True
    return uniq[~held].tolist()


def find(row_ids: torch.Tensor, count: torch.Tensor, ids: torch.Tensor, chunk: int = 256):
    """Slot of each ``ids[B, S]`` among the first ``count[B]`` of ``row_ids[B, CAP]``, -1 when
    absent (chunked over S so prefill-sized calls stay within memory)."""
    cap = row_ids.shape[1]
    slots = torch.arange(cap, device=row_ids.device)
    live = slots < count.long()[:, None]
    out = []
    for s0 in range(0, ids.shape[1], chunk):
        part = ids[:, s0:s0 + chunk]
        hit = (row_ids[:, None, :] == part[:, :, None]) & live[:, None, :]
        out.append(torch.where(hit, slots, -1).amax(-1) if cap else part.new_full(part.shape, -1))
    return torch.cat(out, 1) if out else ids.new_empty(ids.shape)


def take(t: torch.Tensor, rows) -> torch.Tensor:
    """``t``'s rows: a view for a ``slice`` (written in place), a copy for an index tensor."""
    return t[rows] if isinstance(rows, slice) else t.index_select(0, rows)


def put(t: torch.Tensor, rows, value: torch.Tensor) -> None:
    """Write ``value`` back into ``t``'s rows (nothing to do for a view :func:`take` gave)."""
    if not isinstance(rows, slice):
        t.index_copy_(0, rows, value)
    elif value.data_ptr() != t[rows].data_ptr():
        t[rows] = value


def admit_reference(idx, stamp, count, clock, rows, ids, n_core: int, evict: bool = True) -> None:
    """Pure-torch admission with the kernel's semantics: static shapes, no host sync. ``rows`` may
    also be a ``slice`` of the pool (admitted in place); ``evict=False`` is for callers that know
    every new id fits in a free slot (it skips the eviction scan)."""
    B, S = ids.shape
    cap = capacity_of(idx)
    if S == 0:
        return
    I, T, C = take(idx, rows), take(stamp, rows), take(count, rows)  # noqa: E741
    now = clock.expand(B, S)
    sids, _ = ids.sort(dim=1)
    first = torch.ones_like(sids, dtype=torch.bool)
    first[:, 1:] = sids[:, 1:] != sids[:, :-1]
    cur = find(I[:, :cap], C, sids)
    T.scatter_(1, torch.where(first & (cur >= 0), cur, cap), now)
    new = first & (cur < 0)
    rank = new.long().cumsum(1) - 1
    count64 = C.long()[:, None]
    free_pos = count64 + rank
    use_free = free_pos < cap
    if evict:
        slots = torch.arange(cap, device=idx.device)
        elig = (slots >= n_core) & (slots < count64) & (T[:, :cap] != clock)
        key = torch.where(elig, T[:, :cap] * (cap + 1) + slots, INT64_MAX)
        k_ev = min(S, cap)
        ev_key = key.topk(k_ev, dim=1, largest=False).values  # ascending
        ev_raw = rank - (cap - count64)
        ekey = ev_key.gather(1, ev_raw.clamp(0, k_ev - 1))
        ok = new & (use_free | ((ekey != INT64_MAX) & (ev_raw < k_ev)))
        target = torch.where(ok, torch.where(use_free, free_pos, ekey % (cap + 1)), cap)
    else:
        ok = new & use_free
        target = torch.where(ok, free_pos, cap)
    I.scatter_(1, target, torch.where(ok, sids, I.gather(1, target)))
    T.scatter_(1, target, now)
    put(idx, rows, I)
    put(stamp, rows, T)
    put(count, rows, C + (ok & use_free).sum(1).to(count.dtype))
