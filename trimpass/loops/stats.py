"""What one speculative-decoding run did: verifications, drafts, acceptance, time per drafter call.

One record for every loop: the reference chain and tree loops (:mod:`trimpass.loops.chain`,
:mod:`trimpass.loops.tree`) fill it round by round; Hugging Face assisted generation
(:func:`trimpass.hf.assisted.run`) fills it from the outside (a hook on the target, a timer on the
drafter's calls).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class LoopStats:
    name: str = ""
    rounds: int = 0  # verification passes of the target
    drafted: int = 0  # draft tokens proposed to the target
    accepted: int = 0  # of those, accepted
    emitted: int = 0  # new tokens in the output (accepted drafts + the target's own)
    seconds: float = 0.0  # wall time of the whole generation
    lossless: bool = True  # the output equals the reference, where one was given
    draft_ms_each: list = field(default_factory=list)  # wall ms of every drafter call
    target_ms_each: list = field(default_factory=list)  # wall ms of every timed target pass
    per_round: list = field(default_factory=list)  # tokens emitted per verification

    def merge(self, other: LoopStats) -> LoopStats:
        """Add ``other``'s counts, time and per-call records to this one (more prompts)."""
        for f in ("rounds", "drafted", "accepted", "emitted", "seconds"):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        self.lossless = self.lossless and other.lossless
        for f in ("draft_ms_each", "target_ms_each", "per_round"):
            getattr(self, f).extend(getattr(other, f))
        return self

    @property
    def draft_calls(self) -> int:
        return len(self.draft_ms_each)

    @property
    def draft_s(self) -> float:
        return sum(self.draft_ms_each) / 1e3

    @property
    def target_s(self) -> float:
        return sum(self.target_ms_each) / 1e3

    @property
    def draft_ms(self) -> float:
        """Median ms per drafter call: robust to the first (compiling) calls."""
        return statistics.median(self.draft_ms_each) if self.draft_ms_each else float("nan")

    @property
    def mat(self) -> float:
        """Mean tokens emitted per verification (accepted drafts + the target's own token)."""
        return self.emitted / max(self.rounds, 1)

    @property
    def acceptance(self) -> float:
        """Share of drafted tokens the target accepted."""
        return self.accepted / max(self.drafted, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.emitted / max(self.seconds, 1e-9)
