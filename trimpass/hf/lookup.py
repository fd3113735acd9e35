"""The fused loop's choice between lookup drafts and the trimmed head.

The speculation core's lookup proposer (:mod:`trimpass.spec.proposers.lookup`, shared with the
vLLM adapter) keeps an index of a request's own tokens and proposes the tokens that followed the
text's longest recurring suffix, at no body step. The fused loop verifies them in one batched body
pass.

:class:`Chooser` picks a round's source by expected tokens per millisecond, from costs the loop
times on this machine (a one-token body step, a batched verification pass) and the request's own
record: tokens emitted per lookup round by match length (also read off the rounds that passed a
proposal over: the tokens they emitted say what a lookup round would have kept), and per trimmed
self-draft round with the steps it took. A lookup round emits ``1 + E[accepted | match length]``
tokens for one batched pass; a self-draft round emits its recorded tokens per round for its recorded
steps. A round that passes lookup over still learns its worth, but not its cost, which changes
with the request's length; so lookup also runs, as a probe, at the first match of each request and
after ``PROBE`` matches in a row it was not chosen for; each probe that finds lookup still not
worth choosing doubles that wait (up to ``PROBE_MAX``), and a round that chooses lookup on its
record resets it. The rule and its arithmetic: ``docs/fused.md``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

PROBE = 8  # matches passed over in a row before lookup runs anyway, to refresh its record and cost
PROBE_MAX = 64  # the longest wait between probes, after probes that kept finding lookup worse


@dataclass
class Record:
    """Tokens emitted and rounds, per source and match length (a prior of ``prior`` tokens a round
    worth one round, so a source is tried before the record speaks)."""
    prior: float
    tokens: dict = field(default_factory=dict)
    rounds: dict = field(default_factory=dict)

    def add(self, key, emitted: int) -> None:
        self.tokens[key] = self.tokens.get(key, 0) + emitted
        self.rounds[key] = self.rounds.get(key, 0) + 1

    def mean(self, key) -> float:
        """Tokens a round at ``key``: its own rounds and one round of the record's pooled mean
        over every key (the prior alone before any round), so a key not yet seen starts from what
        the others did rather than from the prior."""
        pooled = (sum(self.tokens.values()) + self.prior) / (sum(self.rounds.values()) + 1)
        return (self.tokens.get(key, 0) + pooled) / (self.rounds.get(key, 0) + 1)


class Chooser:
    """Lookup or trimmed self-draft, by expected tokens per ms; the record is the request's own,
    the costs running means of the loop's own timings (``step_ms``: a one-token body step with its
    trimmed head; ``verify_ms``: a batched verification pass), first taken at the warm-up."""

    def __init__(self, gamma: int, match_cap: int):
        self.gamma, self.match_cap = gamma, match_cap
        self.step_ms = self.verify_ms = None  # the machine's: kept across requests
        self.new_request()

    def new_request(self) -> None:
        """Forget the last request's record (its text is not this one's); keep the costs. The
        request's first match is a probe."""
        self.lookup = Record(prior=2.0)  # keyed by match length (capped at match_cap)
        self.self_tokens = Record(prior=self.gamma / 2)
        self.self_steps = Record(prior=self.gamma / 2)
        self.wait = self.passed_over = 0  # matches to pass over before the next probe; passed

    def time(self, kind: str, ms: float) -> None:
        old = getattr(self, kind)
        setattr(self, kind, ms if old is None else 0.9 * old + 0.1 * ms)

    def use_lookup(self, match: int) -> bool:
        """Whether this round verifies the lookup proposal of a ``match``-token suffix: where it
        is worth more tokens per ms, or as a probe (each one in a row waits twice as long)."""
        if match == 0:
            return False
        if self.prefers_lookup(match):
            self.passed_over, self.wait = 0, PROBE
            return True
        if self.passed_over >= self.wait:
            self.passed_over, self.wait = 0, min(max(2 * self.wait, PROBE), PROBE_MAX)
            return True
        self.passed_over += 1
        return False

    def unchosen(self, match: int, proposal: list[int], emitted: list[int]) -> None:
        """Record the lookup round that a self-draft round stood in for, read off the tokens that
        round emitted (the target's own): where they part from ``proposal``, a lookup round would
        have kept the tokens before that and emitted one more, exactly; where they never part, at
        least one more than they agree on (a lower bound). Sampled, the agreement is distributed
        as a lookup round's kept count, since each emitted token is drawn from the target."""
        n = min(len(proposal), len(emitted))
        agree = next((i for i in range(n) if proposal[i] != emitted[i]), n)
        self.lookup.add(min(match, self.match_cap), agree + 1)

    def prefers_lookup(self, match: int) -> bool:
        if match == 0:
            return False
        step = self.step_ms or 1.0
        verify = self.verify_ms or step
        per_ms_lookup = self.lookup.mean(min(match, self.match_cap)) / verify
        per_ms_self = self.self_tokens.mean(0) / (self.self_steps.mean(0) * step)
        return per_ms_lookup >= per_ms_self
