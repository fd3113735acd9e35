"""The fused loop's counters (:class:`FusedStats`, what :func:`trimpass.stats` reports for it) and
the row classes its free drafts' passes are padded to (:func:`row_classes`)."""
from __future__ import annotations

from dataclasses import dataclass

from trimpass.loops.stats import LoopStats


@dataclass
class FusedStats(LoopStats):
    body_steps: int = 0  # one-token body passes (prefill not counted)
    trimmed_calls: int = 0  # body steps that ran the trimmed head
    verifications: int = 0  # batched full-head products
    rechecks: int = 0  # rows computed again alone at a near-tie
    warm_up_s: float = 0.0  # the first call's compile (every graph the loop runs)
    graphs: int = 0  # graphs that compile compiled
    batched_passes: int = 0  # batched body passes verifying lookup drafts
    lookup_rounds: int = 0  # of rounds, those that verified lookup drafts
    lookup_drafted: int = 0
    lookup_accepted: int = 0
    suffix_rounds: int = 0  # of rounds, those that verified the suffix index's drafts
    suffix_drafted: int = 0
    suffix_accepted: int = 0
    head_upcast: bool = False  # several-row full-head products run upcast (trimpass.hf.upcast)
    body_upcast: int = 0  # the body's linears over several rows that run upcast
    tree_rounds: int = 0  # of free rounds, those whose pass verified a tree (branches)
    branch_kept: int = 0  # tokens kept on a tree's side branches (a chain would have missed)

    def as_dict(self) -> dict:
        free = {k: dict(rounds=getattr(self, f"{k}_rounds"), drafted=getattr(self, f"{k}_drafted"),
                        accepted=getattr(self, f"{k}_accepted")) for k in ("lookup", "suffix")}
        own = {k: getattr(self, k) - sum(f[k] for f in free.values())
               for k in ("rounds", "drafted", "accepted")}
        return dict(mode="fused", rounds=self.rounds, drafted=self.drafted,
                    accepted=self.accepted, emitted=self.emitted, body_steps=self.body_steps,
                    trimmed_calls=self.trimmed_calls, verifications=self.verifications,
                    rechecks=self.rechecks, acceptance=self.acceptance, mat=self.mat,
                    warm_up_s=self.warm_up_s, graphs=self.graphs,
                    batched_passes=self.batched_passes, head_upcast=self.head_upcast,
                    body_upcast=self.body_upcast, tree_rounds=self.tree_rounds,
                    branch_kept=self.branch_kept,
                    passes_per_token=(self.body_steps + self.batched_passes)
                    / max(self.emitted, 1),
                    sources=dict(**free, self=own))

    def counted(self, k: int, n: int, source: str) -> None:
        """One round of ``k`` tokens drafted by ``source`` of which ``n`` were kept."""
        self.rounds, self.drafted, self.accepted = self.rounds + 1, self.drafted + k, \
            self.accepted + n
        self.verifications += 1
        if source != "self":
            self.batched_passes += 1
            for name, add in (("rounds", 1), ("drafted", k), ("accepted", n)):
                setattr(self, f"{source}_{name}", getattr(self, f"{source}_{name}") + add)
        else:
            self.body_steps, self.trimmed_calls = self.body_steps + k, self.trimmed_calls + k


def row_classes(tokens: int) -> tuple:
    """The padded row counts of a free draft's pass over a pending token and up to ``tokens``
    drafted ones: powers of two from 4 up to the first that holds them all (4, 8, 16 for 15)."""
    sizes, s = [], 4
    while not sizes or sizes[-1] < tokens + 1:
        sizes.append(s)
        s *= 2
    return tuple(sizes)
