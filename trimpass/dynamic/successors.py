"""Successors, an admission policy (opt-in, ``successors=K``): with every id a request receives,
the last K distinct ids that followed that id before in this drafter's traffic join the row too.
Drafter-wide ``succ[V+1, K]`` (row V: no previous id), and each row's last id."""
from __future__ import annotations

import torch

from trimpass.dynamic.policies import AdmissionPolicy
from trimpass.kernels.vocab_state import put, take


class Successors(AdmissionPolicy):
    setting = "successors"

    def __init__(self, settings, rows: int, V: int, device: torch.device):
        super().__init__(settings, rows, V, device)
        self.last = torch.full((rows,), -1, dtype=torch.long, device=device)  # last id per row
        self.succ = torch.full((V + 1, settings.successors), -1, dtype=torch.int32,
                               device=device)

    def extra(self, ids: torch.Tensor, rows) -> torch.Tensor:
        """Record which id followed which (this call's ids after each row's last one) and return,
        for every received id, the ids that followed it before: ``[B, S*K]`` (the id itself where
        there are fewer than K). Static shapes, no host read."""
        B, (V1, K) = ids.shape[0], self.succ.shape
        seq = torch.cat([take(self.last, rows)[:, None], ids], 1)
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
        got_rows = torch.where(dup.gather(1, pick), -1, cand.gather(1, pick))
        self.succ[a] = got_rows.to(self.succ.dtype)  # every pair of a group writes the same row
        put(self.last, rows, ids[:, -1].clone())
        got = self.succ[ids].long()  # [B, S, K]
        return torch.where(got < 0, ids[..., None], got).reshape(B, -1)

    def restart(self, rows, fresh: torch.Tensor) -> None:
        put(self.last, rows, torch.where(fresh[:, 0], -1, take(self.last, rows)))

    def bytes_per_row(self) -> int:
        return self.last.element_size()
