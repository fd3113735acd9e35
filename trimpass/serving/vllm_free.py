"""The vLLM adapter's free drafts: one :class:`FreeDrafts` per drafter holds the requests' lookup
indexes and suffix indexes (and the suffix index's earlier outputs by tenant, within its byte cap),
built from the budget's settings as they stand, following the batch's requests (kept on finish for
their tenant, dropped when they leave the batch, rebuilt from the engine's tokens). A request's
tenant is its ``vllm_xargs`` ``trimpass_tenant`` (checked in the front end), or the server's one
tenant where the budget names it. ``audit`` records the ids each tenant was offered (tests)."""
from __future__ import annotations

from dataclasses import asdict

from trimpass.spec.config import LookupConfig, SuffixConfig
from trimpass.spec.proposers.lookup import LookupProposer
from trimpass.spec.proposers.suffix import SuffixProposer, SuffixStore


class FreeDrafts:
    def __init__(self, audit: bool = False):
        self.lookups: LookupProposer | None = None  # the requests' lookup indexes, once drafted
        self.suffixes: SuffixProposer | None = None  # their suffix indexes, tenants' outputs
        self.audit = audit
        self.offered: dict = {}  # tenant -> ids its requests were offered by the suffix index

    def draft(self, settings: dict, batch, emitted: list, gamma: int) -> list:
        """Each request's free drafts this step (a :class:`~trimpass.spec.drafts.Drafts` per
        source that is on: lookup's, the suffix index's)."""
        out = []
        if settings["lookup"]:
            lk, want = self.lookups, (settings["lookup"]["tokens"], settings["lookup"]["ngram"])
            if lk is None or (lk.config.tokens, lk.config.ngram) != want:
                lk = self.lookups = LookupProposer(LookupConfig(tokens=want[0], ngram=want[1]))
            out.append(lk.draft(batch.req_ids, batch.lengths, batch.tokens, emitted, gamma))
        if settings.get("suffix"):
            out.append(self._suffix(settings, batch, emitted, gamma))
        return out

    def _suffix(self, settings: dict, batch, emitted: list, gamma: int):
        sx = self.suffixes
        if sx is None or asdict(sx.config) != settings["suffix"]:
            config = SuffixConfig(**settings["suffix"])
            sx = self.suffixes = SuffixProposer(config, SuffixStore(config.max_bytes,
                                                                    config.share))
        fixed, B = settings.get("tenant"), len(batch.req_ids)
        tenants = (batch.tenants or [""] * B) if fixed is None else [fixed] * B
        d = sx.draft(batch.req_ids, batch.lengths, batch.tokens, emitted, gamma,
                     tenants=[t if isinstance(t, str) else "" for t in tenants])
        if self.audit:
            for i, rid in enumerate(batch.req_ids):
                self.offered.setdefault(sx.tenant.get(rid, ""), set()).update(d.row(i))
        return d

    def finish(self, rid) -> None:
        """A finished or aborted request: its output kept for its tenant's later requests."""
        if self.suffixes is not None:
            self.suffixes.finish(rid)

    def keep_only(self, req_ids) -> None:
        for free in (self.lookups, self.suffixes):
            if free is not None:
                free.keep_only(req_ids)

    def stats(self, counts=None) -> dict:
        """Live indexes, the store's bytes, outputs, evictions and tenants; with the controller's
        ``counts``, each free source's tokens sent and accepted."""
        out = {} if counts is None else {f"{k}_{n}": counts.get(f"{k}_{n}", 0)
                                         for k in ("lookup", "suffix") for n in ("sent",
                                                                                 "accepted")}
        if self.lookups is not None:
            out["lookup_live"] = len(self.lookups)
        if self.suffixes is not None:
            store = self.suffixes.store
            out["suffix"] = {"live": len(self.suffixes), "bytes": store.nbytes,
                             "outputs": len(store), "evicted": store.evicted,
                             "tenants": len(store.arenas)}
            if self.audit:
                out["suffix"]["offered"] = {t: sorted(v) for t, v in self.offered.items()}
        return out
