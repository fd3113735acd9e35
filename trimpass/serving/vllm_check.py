"""The check mode (the ``check`` setting, for tests; it reaches the workers with the other
settings): a :class:`Trimmer` that also computes the plain head at every call and counts rows whose
finite logits are not exactly their active ids, or differ there (``violations``,
``max_abs_err``); an isolation check (every row's ids are its request's own tokens and the shared
core, ``foreign``; and it holds all of its own tokens while they fit, ``missing``); and each
proposal's first drafted row by the request's first tokens and length (``first``), which the
skipped-step tests compare across runs."""
from __future__ import annotations

import torch

from trimpass.serving.vllm_trim import Trimmer


class CheckedTrimmer(Trimmer):
    def __init__(self, drafter, settings: dict, log=None):
        super().__init__(drafter, settings, log)
        self.own: list = []  # each batch row's own tokens
        self.keys: list = []  # each batch row's (first tokens, length)
        self.first: dict = {}  # "first tokens|length" -> the first draft's logits
        self._first_call = False
        self.checked = self.violations = self.foreign = self.missing = 0
        self.isolation_checked = 0
        self.max_abs_err = 0.0
        self.seen: dict = {}

    def begin(self, batch, emitted: list[int]) -> None:
        super().begin(batch, emitted)
        if self.state is None:
            return
        n = batch.lengths
        self.own = [set(batch.tokens(i, 0, n[i]).tolist()) for i in range(len(n))]
        got = list(emitted) + [0] * (len(n) - len(emitted))  # the first draft follows them
        self.keys = [f"{batch.tokens(i, 0, 4).tolist()}|{n[i] + got[i]}" for i in range(len(n))]
        self._first_call = True

    def checked_call(self, h, logits, idx, count) -> None:
        """Each row finite exactly on its active ids, equal there to the plain head."""
        if logits is None:
            return
        full = self.head.plain(h)
        B = h.shape[0]
        if idx.dim() == 1:
            idx, count = idx.expand(B, -1), count.reshape(1).expand(B)
        for b, rid in enumerate(self.batch):
            active = idx[b, :int(count[b])].long()
            ids = active  # a target id outside an EAGLE-3 draft vocabulary stays -inf
            if self.vocab is not None:
                ids = active[self.vocab.t2d[active] >= 0]
            finite = torch.isfinite(logits[b]).nonzero().reshape(-1)
            ok = torch.equal(finite, torch.sort(ids).values)
            err = float((logits[b, ids] - full[b, ids]).abs().max()) if ids.numel() else 0.0
            self.max_abs_err = max(self.max_abs_err, err)
            self.violations += int(not ok or err > 1e-3)
            if self._first_call and b < len(self.keys):
                row = logits[b, ids]
                self.first[self.keys[b]] = [int(ids[row.argmax()]), float(row.max()),
                                            float(torch.logsumexp(row, 0))]
            self.seen.setdefault(rid, set()).update(active.tolist())
            if self.state is not None and b < len(self.own):
                self._isolation(b, set(active.tolist()))
        self.checked += 1
        self._first_call = False

    def _isolation(self, b: int, ids: set) -> None:
        """Row ``b``'s ids are its request's own tokens and the shared core only (no id of
        another request), and hold all of its own tokens while they fit. Meaningful where nothing
        else is shared by design: no learned core, no successors."""
        st = self.state
        row = st.requests[self.batch[b]]
        shared = set(st.idx[row, :st.n_core].tolist())
        own = self.own[b]
        self.foreign += len(ids - shared - own)
        if len(shared | own) <= st.settings.capacity:
            self.missing += len(own - ids)
        self.isolation_checked += 1

    def stats(self) -> dict:
        return {**super().stats(), "checked": self.checked, "violations": self.violations,
                "max_abs_err": self.max_abs_err, "foreign": self.foreign,
                "missing": self.missing, "isolation_checked": self.isolation_checked,
                "seen": {k: sorted(v) for k, v in self.seen.items()}, "first": self.first}
