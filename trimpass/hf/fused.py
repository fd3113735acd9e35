"""The fused self-speculative loop behind :func:`trimpass.generate`: a Hugging Face causal LM drafts
for itself through its own trimmed head and verifies with its full head, without a second body pass.

The body (:mod:`trimpass.hf.body`: the compiled step over a static KV cache) runs one token at a
time, as plain decoding does. Each step's hidden state is kept; the trimmed head (the step compiled
through trimpass) drafts the next token. Every ``gamma`` steps, or where the trimmed confidence
drops below ``confidence``, the full head verifies the kept hidden states in one batched product
(:mod:`trimpass.spec.verify`); the cache rolls back to the first mismatch and the full head's own
token follows. Lookup drafts come from the speculation core's proposer
(:mod:`trimpass.spec.proposers.lookup`, this loop a batch of one) and are verified in one batched
body pass. Each emitted token costs one body step; a round costs one full-head product. Host reads
per round: the accepted count and the emitted ids, a confidence per draft step (with ``confidence >
0``), one per near-tie. Batch 1 only. Diagnostics (the trace and replay of a call,
:mod:`trimpass.diagnostics.replay`) attach by the body's hooks.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from trimpass import measure
from trimpass.base import softmax_max
from trimpass.config import disabled
from trimpass.hf.body import Body
from trimpass.hf.costs import RoundCosts
from trimpass.hf.sampler import Sampler
from trimpass.loops.stats import LoopStats
from trimpass.measure import compiled_graphs
from trimpass.spec import verify
from trimpass.spec.config import BudgetConfig, GenerateConfig, LookupConfig
from trimpass.spec.control.controller import Controller
from trimpass.spec.proposers.lookup import LookupProposer

log = logging.getLogger("trimpass")
WARM_ROWS = LookupConfig.tokens + 1  # the warm-up's verification pass: a default lookup round's


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
    head_upcast: bool = False  # several-row full-head products run upcast (trimpass.hf.upcast)
    body_upcast: int = 0  # the body's linears over several rows that run upcast

    def as_dict(self) -> dict:
        own = dict(rounds=self.rounds - self.lookup_rounds,
                   drafted=self.drafted - self.lookup_drafted,
                   accepted=self.accepted - self.lookup_accepted)
        return dict(mode="fused", rounds=self.rounds, drafted=self.drafted,
                    accepted=self.accepted, emitted=self.emitted, body_steps=self.body_steps,
                    trimmed_calls=self.trimmed_calls, verifications=self.verifications,
                    rechecks=self.rechecks, acceptance=self.acceptance, mat=self.mat,
                    warm_up_s=self.warm_up_s, graphs=self.graphs,
                    batched_passes=self.batched_passes, head_upcast=self.head_upcast,
                    body_upcast=self.body_upcast,
                    passes_per_token=(self.body_steps + self.batched_passes)
                    / max(self.emitted, 1),
                    sources=dict(lookup=dict(rounds=self.lookup_rounds,
                                             drafted=self.lookup_drafted,
                                             accepted=self.lookup_accepted), self=own))

    def counted(self, k: int, n: int, lookup_round: bool) -> None:
        """One round of ``k`` drafted tokens of which ``n`` were kept."""
        self.rounds, self.drafted, self.accepted = self.rounds + 1, self.drafted + k, \
            self.accepted + n
        self.verifications += 1
        if lookup_round:
            self.batched_passes, self.lookup_rounds = self.batched_passes + 1, \
                self.lookup_rounds + 1
            self.lookup_drafted, self.lookup_accepted = self.lookup_drafted + k, \
                self.lookup_accepted + n
        else:
            self.body_steps, self.trimmed_calls = self.body_steps + k, self.trimmed_calls + k


class FusedLoop:
    """The loop for one model and one :class:`GenerateConfig` (its sampling aside): its
    :class:`~trimpass.hf.body.Body` (compiled step, full head, static cache), its controller
    (the speculation core's, this loop a batch of one) and counters (kept on the model;
    ``model._trimpass_fused`` is the latest). ``proposer``: the class
    of the lookup proposer each call builds (this loop a batch of one)."""
    proposer = LookupProposer

    def __init__(self, model, config: GenerateConfig, speculate: bool, backend, plain):
        """``backend`` compiles the drafting step (its trimmed head); ``plain`` (the inner
        compiler alone) the head-less step of plain decoding, used when ``speculate`` is False or
        trimpass is disabled."""
        self.speculate = speculate and not disabled()
        self.body = Body(model, self.speculate, backend, plain)
        self.step, self.head = self.body.step, self.body.head
        self.gamma, self.confidence = config.gamma, float(config.confidence)
        self.lookup = config.lookup if self.speculate else None
        self.lookup_tokens = 0 if self.lookup is None else self.lookup.tokens
        self.stats = FusedStats(name="fused")
        self.costs = RoundCosts(self.gamma)
        deepest = max(self.gamma, self.lookup_tokens)
        self.controller = Controller(BudgetConfig(lookup=self.lookup or False).for_engine(deepest),
                                     deepest, self.costs)
        self.warmed = False

    def warm_up(self) -> float:
        """Compile every graph the loop runs (the one-token step and the pass over many rows: a
        prompt's chunk, a verification) on a scratch request, and time the rounds' costs;
        returns the seconds it took (0 if they were compiled already)."""
        if self.warmed:
            return 0.0
        t0, graphs, body = time.perf_counter(), compiled_graphs(), self.body
        with torch.no_grad():
            self.stats.head_upcast = self.head.calibrate()  # before the costs time a round
            body.fresh_cache(2, WARM_ROWS)
            body.prefill(torch.zeros(1, 2, dtype=torch.long, device=body.device))  # many rows
            body.token(0, 2)  # the one-token step
            if self.lookup_tokens:  # the rounds' first costs, each from the same cache length
                H = body.rows_of([0] * WARM_ROWS, 2).clone()
                for name, run in (("step_s", lambda: body.token(0, 2)),
                                  ("verify_s", lambda: self.head(body.rows_of([0] * WARM_ROWS,
                                                                             2))),
                                  ("head_s", lambda: self.head(H[:self.gamma]))):
                    ms = measure.best_ms(lambda r=run: (body.rollback(2), r()))
                    self.costs.time(name, ms / 1e3)
            body.reset_rows()  # the scratch request's ids leave nothing behind
        self.warmed, s = True, self.stats
        s.warm_up_s, s.graphs = time.perf_counter() - t0, compiled_graphs() - graphs
        s.body_upcast = body.rows.rewritten
        log.info("trimpass.generate: compiled %d graphs in %.1f s (first call on this model and "
                 "setting; none later)", s.graphs, s.warm_up_s)
        return s.warm_up_s

    def _self_round(self, token: int, at: int, budget: int, sampler) -> list[int]:
        """Draft from ``token`` at position ``at`` through the trimmed head (up to ``gamma``
        steps, stopping below the confidence), verify with the full head, roll back."""
        token = torch.tensor([token], device=self.body.device)
        hs, drafted, qs = [], [], []
        for j in range(min(self.gamma, budget)):
            h, z = self.body.run(token.view(1, 1), at + j)[1:]
            hs.append(h.clone())  # a CUDA-graph replay writes its outputs over the last ones
            if sampler is None:
                token, conf = z.argmax(-1), softmax_max(z) if self.confidence else 1.0
            else:
                qs.append(sampler.draft(z))
                token, conf = torch.multinomial(qs[-1], 1)[:, 0], qs[-1].amax()
            drafted.append(token)
            if self.confidence and float(conf) < self.confidence:
                break
        H, d = torch.cat(hs), torch.cat(drafted)
        if sampler is None:
            new, n, again = verify.greedy_round(self.head, H, d)
            self.stats.rechecks += again
        else:
            new, n = verify.sampled_round(sampler.target(self.head(H)), torch.cat(qs), d)
        self.stats.counted(len(hs), n, lookup_round=False)
        self.body.rollback(at + len(new))
        self.controller.offer(0, "self", d.tolist(), len(hs))
        return new

    def _lookup_round(self, token: int, proposal: list[int], match: int, at: int,
                      sampler) -> list[int]:
        """Verify a lookup ``proposal`` after the pending ``token`` at ``at`` in one batched body
        pass: its longest agreeing prefix and the full head's own next token (greedy), or each
        drafted token with the target's probability (a point-mass draft, sampling)."""
        H = self.body.rows_of([token, *proposal], at)
        d = torch.tensor(proposal, device=H.device)
        if sampler is None:
            new, n, again = verify.greedy_round(self.head, H, d)
            self.stats.rechecks += again
        else:
            p = sampler.target(self.head(H))
            new, n = verify.sampled_round(p, verify.point_mass(d, p.shape[1], p.dtype), d)
        self.stats.counted(len(proposal), n, lookup_round=True)
        self.controller.offer(0, "lookup", proposal, len(proposal), match=match)
        self.body.rollback(at + len(new))
        return new

    def _next(self, text: list[int], new: list[int], budget: int, sampler, proposer) -> list[int]:
        """One round after ``text`` (its last ``new`` tokens emitted last round), as the
        controller plans it: a lookup round (depth 0) where the lookup draft is priced to emit
        more tokens per second than a trimmed self-draft, else the self-draft; each round is
        timed for the costs, and every draft offered is priced against what the round emitted."""
        t0, token, at = time.perf_counter(), text[-1], len(text) - 1
        if not self.speculate:
            self.stats.body_steps += 1
            return [self._first(self.body.token(token, at)[0], sampler)]
        drafts = proposer.draft([0], [len(text) - len(new)], lambda i, a, b: text[a:b], [new],
                                  budget - 1) if proposer is not None and budget > 1 else None
        look = drafts if drafts is not None and drafts.counts[0] else None
        plan = self.controller.plan(1, self.gamma, look,
                                    depths=(self.gamma,) if look is None else (0, self.gamma))
        if look is not None and not plan.depth:
            out = self._lookup_round(token, look.row(0), look.match[0], at, sampler)
            self.costs.time("verify_s", time.perf_counter() - t0)
        else:
            steps = self.stats.body_steps
            out = self._self_round(token, at, budget, sampler)
            self.costs.self_round(self.stats.body_steps - steps, time.perf_counter() - t0)
            if look is not None:
                self.controller.offer(0, "lookup", look.row(0), 0, match=look.match[0])
        self.controller.observe([0], [out])
        return out

    def _first(self, h, sampler) -> int:
        """The full head's own token from one hidden state (the prefill's, plain decoding's)."""
        self.stats.verifications += 1
        if sampler is None:
            return int(verify.greedy(self.head, h)[0][0])
        return int(torch.multinomial(sampler.target(self.head(h)), 1)[0, 0])

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens, sampler: Sampler | None, eos: set[int],
                 outputs=None) -> torch.Tensor:
        self.warm_up()
        self.body.reset_rows()
        P = input_ids.shape[1]
        self.body.tell("on_request", P, max_new_tokens)
        self.body.fresh_cache(P, max_new_tokens)
        h = self.body.prefill(input_ids.to(self.body.device))[0]
        text = input_ids[0].tolist() + [self._first(h, sampler)]
        proposer = self.proposer(self.lookup, outputs) if self.lookup_tokens else None
        self.controller.forget("lookup")  # the text's repeats are its own; the model's stay
        new = text[P:]
        while len(text) - P < max_new_tokens and text[-1] not in eos:
            new = self._next(text, new, max_new_tokens - (len(text) - P), sampler, proposer)
            text += new
        out = through_eos(text[P:], eos)
        self.stats.emitted += len(out)
        if outputs is not None:
            outputs.add(out)
        tail = torch.tensor([out], dtype=input_ids.dtype, device=input_ids.device)
        return torch.cat([input_ids, tail], dim=1)


def through_eos(ids: list[int], eos: set[int]) -> list[int]:
    """``ids`` up to and with their first EOS (a round may emit tokens past it)."""
    return next((ids[:i + 1] for i, t in enumerate(ids) if t in eos), ids)


def eos_ids(model) -> set[int]:
    e = getattr(model.generation_config, "eos_token_id", None)
    return set() if e is None else {int(x) for x in (e if isinstance(e, (list, tuple)) else [e])}
