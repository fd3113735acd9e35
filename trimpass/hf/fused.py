"""The fused self-speculative loop behind :func:`trimpass.generate`: a Hugging Face causal LM drafts
for itself through its own trimmed head and verifies with its full head, without a second body pass.

The body runs one token at a time, as plain decoding does, over a static KV cache (every layer a
full-length static layer: a sliding-window layer's mask still applies the window, and rolling
back is setting the cache's length); the prompt is prefilled in passes whose row count is dynamic,
and the cache's length is dynamic in the compiled graphs, so the first call compiles both graphs
the loop runs and no later prompt compiles another (:mod:`trimpass.hf.buckets`).
Each step's hidden state is kept; the trimmed head (the step compiled through trimpass) drafts the
next token. Every ``gamma`` steps, or where the trimmed
confidence drops below ``confidence``, the full head verifies the kept hidden states in one batched
product (:mod:`trimpass.hf.accept`); the cache rolls back to the first mismatch and the full head's
own token follows. Each emitted token costs one body step; a round costs one full-head product.
Host reads per round: the accepted count (and, with ``confidence > 0``, the confidence per draft
step). Batch 1 only.
"""
from __future__ import annotations

import contextlib
import logging
import time
import types
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from trimpass import measure
from trimpass.config import disabled
from trimpass.hf import accept, buckets, decode_attention, lookup, upcast
from trimpass.loops.stats import LoopStats
from trimpass.measure import compiled_graphs

log = logging.getLogger("trimpass")

# the defaults: x1.67 the plain target against x1.49 at a fixed 4 (bench/results/peers.md)
GAMMA, CONFIDENCE = 8, 0.4
# lookup drafts: up to 15 tokens after the longest recurring suffix of up to 4 tokens, verified in
# one pass over them (the prefill's graph: its row count is dynamic), timed against a one-token step
LOOKUP_TOKENS, NGRAM = 15, 4


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
        return dict(mode="fused", rounds=self.rounds, drafted=self.drafted,
                    accepted=self.accepted, emitted=self.emitted, body_steps=self.body_steps,
                    trimmed_calls=self.trimmed_calls, verifications=self.verifications,
                    rechecks=self.rechecks, acceptance=self.acceptance, mat=self.mat,
                    warm_up_s=self.warm_up_s, graphs=self.graphs,
                    batched_passes=self.batched_passes, head_upcast=self.head_upcast,
                    body_upcast=self.body_upcast,
                    passes_per_token=(self.body_steps + self.batched_passes)
                    / max(self.emitted, 1),
                    sources=dict(
                        lookup=dict(rounds=self.lookup_rounds, drafted=self.lookup_drafted,
                                    accepted=self.lookup_accepted),
                        self=dict(rounds=self.rounds - self.lookup_rounds,
                                  drafted=self.drafted - self.lookup_drafted,
                                  accepted=self.accepted - self.lookup_accepted)))


class _Step(torch.nn.Module):
    """One pass of ``model``'s body over new ids; returns every row's hidden state, that of row
    ``row`` (a one-element tensor: the last real row of a padded chunk, a graph input, not a
    constant) and, with a head, its logits (the graph trimpass trims)."""

    def __init__(self, model, head: bool):
        super().__init__()
        config = decode_attention.copy_config(model.config)  # its own attention, not the model's
        self.body = decode_attention.rebind(getattr(model, model.base_model_prefix),
                                            decode_attention.configs(model.config, config))
        self.head = model.get_output_embeddings() if head else None
        self.cap = float(getattr(model.config, "final_logit_softcapping", None) or 0.0)
        # Dynamo keeps at most recompile_limit (8) graphs per code object, and each step
        # instance compiles its own (prefill, decode): a code object per step, not per class
        code = _Step.step.__code__.replace()
        self.forward = types.MethodType(types.FunctionType(code, globals(), "forward"), self)

    def step(self, ids, position_ids, row, cache):
        hs = self.body(input_ids=ids, position_ids=position_ids, past_key_values=cache,
                       use_cache=True).last_hidden_state[0]
        h = hs.index_select(0, row)
        if self.head is None:
            return hs, h, None
        z = self.head(h)
        return hs, h, torch.tanh(z / self.cap) * self.cap if self.cap else z


class Sampler:
    """The target's distribution as ``model.generate`` samples it (temperature, top-k, top-p, in
    that order, in fp32) and the drafter's (the temperature-scaled trimmed softmax)."""

    def __init__(self, temperature, top_k, top_p):
        from transformers import (
            LogitsProcessorList,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )
        self.t = float(temperature)
        warpers = [TemperatureLogitsWarper(self.t)] if self.t != 1.0 else []
        warpers += [TopKLogitsWarper(top_k)] if top_k is not None else []
        warpers += [TopPLogitsWarper(top_p)] if top_p is not None and top_p < 1 else []
        self.warpers = LogitsProcessorList(warpers)

    def target(self, z: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.warpers(None, z.float()), dim=-1)

    def draft(self, z: torch.Tensor) -> torch.Tensor:
        return torch.softmax(z.float() / self.t, dim=-1)


class FusedLoop:
    """The loop for one model and one set of settings: its compiled step, static cache and
    counters (one per setting, kept on the model; ``model._trimpass_fused`` is the latest)."""

    def __init__(self, model, gamma: int, confidence: float, speculate: bool, backend, plain,
                 lookup_tokens: int = 0):
        """``backend`` compiles the drafting step (its trimmed head); ``plain`` (the inner
        compiler alone) the head-less step of plain decoding, used when ``speculate`` is False or
        trimpass is disabled. ``lookup_tokens`` > 0 adds lookup drafts of up to that many tokens,
        verified in one batched pass (:mod:`trimpass.hf.lookup`)."""
        self.model, self.gamma, self.confidence = model, gamma, float(confidence)
        self.speculate, self.backend = speculate and not disabled(), backend
        self.lookup_tokens = lookup_tokens if self.speculate else 0
        self.step = _Step(model, head=self.speculate).eval()
        # several rows' linears upcast where this CPU multiplies half precision slowly
        self.rows = upcast.RowsBackend(backend if self.speculate else plain,
                                       model.get_output_embeddings().weight.shape)
        self.step.compile(backend=self.rows)
        self.head = accept.FullHead(model)
        self.cache, self.capacity, self.context = None, 0, buckets.context_of(model)
        self.stats = FusedStats(name="fused")
        self.chooser = lookup.Chooser(gamma)
        self.warmed = False
        self.trace = None  # the last call's cache, rollbacks and body passes, in order (replay)

    def _fresh_cache(self, prompt: int, new: int) -> Cache:
        """An empty cache for a prompt of ``prompt`` tokens and ``new`` more (a new size is a new
        cache, not a new graph: the length dimension is dynamic in both graphs)."""
        capacity = buckets.capacity_for(prompt + new, self.context)
        if capacity != self.capacity:
            self.cache, self.capacity = None, 0  # the old cache's memory first
            self.cache, self.capacity = buckets.new_cache(self.model, capacity), capacity
        self._rollback(0)
        return self.cache

    def _rollback(self, length: int) -> None:
        if self.trace is not None:
            self.trace.append(("rollback", length))
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(length)

    def _pass(self, ids: torch.Tensor, at: int):
        """One body pass over ``ids[1, n]`` from position ``at``: every row's hidden state, the last
        row's, and its trimmed logits. One token runs the one-token step's graph; more run one
        graph whose row count is dynamic (a prompt's chunk, a verification: any length)."""
        # a slice of a longer prompt keeps that prompt's row stride, and Dynamo guards on strides
        ids = torch.empty_like(ids, memory_format=torch.contiguous_format).copy_(ids)
        if self.trace is not None:
            self.trace.append(("pass", at, ids))
        positions = torch.arange(at, at + ids.shape[1], device=ids.device).unsqueeze(0)
        if ids.shape[1] > 1:
            torch._dynamo.maybe_mark_dynamic(ids, 1)
            torch._dynamo.maybe_mark_dynamic(positions, 1)
        row = torch.tensor([ids.shape[1] - 1], device=ids.device)
        out = self.step(ids, positions, row, self.cache)
        state = self.backend.state_for(self.step) if self.speculate else None
        if state is not None:
            state.upkeep()  # a replayed step runs none of the state's Python
        return out

    def _run(self, ids: torch.Tensor, at: int):
        return self._pass(ids, at)[1:]

    def _verify(self, tokens: list[int], at: int) -> torch.Tensor:
        """Every row's hidden state of one body pass over ``tokens`` from position ``at``."""
        ids = torch.tensor([tokens], device=self.head.weight.device)
        return self._pass(ids, at)[0].clone()

    def _prefill(self, ids: torch.Tensor):
        """The prompt in passes of up to ``buckets.CHUNK`` tokens; returns the last row's (h,
        logits)."""
        for start in range(0, ids.shape[1], buckets.CHUNK):
            h, z = self._run(ids[:, start:start + buckets.CHUNK], start)
        self._rollback(ids.shape[1])
        return h, z

    def warm_up(self) -> float:
        """Compile every graph the loop runs (the one-token step and the pass over many rows: a
        prompt's chunk, a verification) on a scratch request, and time both for the chooser;
        returns the seconds it took (0 if they were compiled already)."""
        if self.warmed:
            return 0.0
        t0 = time.perf_counter()
        graphs = compiled_graphs()
        device = self.head.weight.device
        state = self.backend.state_for(self.step) if self.speculate else None
        with torch.no_grad():
            self.stats.head_upcast = self.head.calibrate()  # before the chooser times a round
            self._fresh_cache(2, LOOKUP_TOKENS + 1)
            ids = torch.zeros(1, 2, dtype=torch.long, device=device)
            self._prefill(ids)  # the graph of many rows
            self._run(ids[:, :1], 2)  # the one-token step
            if self.lookup_tokens:
                for kind, run in (("step_ms", lambda: self._run(ids[:, :1], 2)),
                                  ("verify_ms", lambda: self.head(self._verify([0] * 16, 2)))):
                    # the chooser's first costs (a round's body pass and head product); each call
                    # from the same cache length
                    self.chooser.time(kind, measure.best_ms(lambda r=run: (self._rollback(2), r())))
            if state is None:
                state = self.backend.state_for(self.step) if self.speculate else None
            if state is not None and state.V is not None:
                state.reset()  # the scratch request's ids leave nothing behind
        self.warmed = True
        self.stats.warm_up_s = time.perf_counter() - t0
        self.stats.graphs = compiled_graphs() - graphs
        self.stats.body_upcast = self.rows.rewritten
        log.info("trimpass.generate: compiled %d graphs in %.1f s (first call on this model and "
                 "setting; none later)", self.stats.graphs, self.stats.warm_up_s)
        return self.stats.warm_up_s

    def _round(self, token, at: int, budget: int, sampler):
        """Draft from ``token`` at position ``at``, verify, roll back; returns the emitted ids."""
        hs, drafted, qs = [], [], []
        for j in range(min(self.gamma, budget)):
            h, z = self._run(token.view(1, 1), at + j)
            hs.append(h.clone())  # a CUDA-graph replay writes its outputs over the last ones
            if sampler is None:
                token = z.argmax(-1)
                conf = float(torch.softmax(z, -1, dtype=torch.float32).amax()) \
                    if self.confidence else 1.0
            else:
                q = sampler.draft(z)
                token = torch.multinomial(q, 1)[:, 0]
                qs.append(q)
                conf = float(q.amax()) if self.confidence else 1.0
            drafted.append(token)
            if conf < self.confidence:
                break
        k, H, d = len(hs), torch.cat(hs), torch.cat(drafted)
        s = self.stats
        s.rounds, s.drafted, s.body_steps = s.rounds + 1, s.drafted + k, s.body_steps + k
        s.trimmed_calls, s.verifications = s.trimmed_calls + k, s.verifications + 1
        if sampler is None:
            target, again = accept.greedy(self.head, H, d)
            s.rechecks += again
            n = accept.agreed(target, d)
            new = d[:n].tolist() + ([int(target[n])] if n < k else [])
        else:
            n, fix = accept.speculative(sampler.target(self.head(H)), torch.cat(qs), d)
            new = d[:n].tolist() + ([fix] if fix is not None else [])
        s.accepted += n
        self._rollback(at + len(new))
        self.chooser.self_tokens.add(0, len(new))
        self.chooser.self_steps.add(0, k)
        return new

    def _lookup_round(self, token: int, proposal: list[int], match: int, at: int, sampler):
        """Verify a lookup ``proposal`` after the pending ``token`` at ``at`` in one batched body
        pass; keep its longest agreeing prefix and the full head's own next token (greedy), or
        each drafted token with the target's probability (a point-mass draft, sampling)."""
        k, H = len(proposal), self._verify([token, *proposal], at)
        d = torch.tensor(proposal, device=H.device)
        if sampler is None:
            target, again = accept.greedy(self.head, H, d)
            self.stats.rechecks += again
            n = accept.agreed(target, d)
            new = proposal[:n] + [int(target[n])]
        else:
            p = sampler.target(self.head(H))
            q = torch.nn.functional.one_hot(d, p.shape[1]).to(p.dtype)
            n, fix = accept.speculative(p[:k], q, d)
            new = proposal[:n] + [fix if fix is not None else int(torch.multinomial(p[k], 1))]
        s = self.stats
        s.rounds, s.drafted, s.accepted = s.rounds + 1, s.drafted + k, s.accepted + n
        s.verifications, s.batched_passes = s.verifications + 1, s.batched_passes + 1
        s.lookup_rounds, s.lookup_drafted = s.lookup_rounds + 1, s.lookup_drafted + k
        s.lookup_accepted += n
        self.chooser.lookup.add(min(match, 4), len(new))
        self._rollback(at + len(new))
        return new

    def _plain(self, token, at: int, sampler):
        h, _ = self._run(token.view(1, 1), at)
        self.stats.body_steps += 1
        return [self._first(h, sampler)]

    def _next(self, token: int, at: int, budget: int, sampler, text: lookup.Lookup):
        """One round from the pending ``token`` at ``at``: lookup where its expected tokens per ms
        beat the trimmed self-draft's, else the self-draft; each timed for the choice."""
        t0 = time.perf_counter()
        if not self.speculate:
            return self._plain(torch.tensor([token], device=self.head.weight.device), at, sampler)
        proposal, match = text.propose(budget - 1) if self.lookup_tokens and budget > 1 else ([], 0)
        if proposal and self.chooser.use_lookup(match):
            new = self._lookup_round(token, proposal, match, at, sampler)
            self.chooser.time("verify_ms", 1e3 * (time.perf_counter() - t0))
            return new
        steps = self.stats.body_steps
        new = self._round(torch.tensor([token], device=self.head.weight.device), at, budget,
                          sampler)
        ms = 1e3 * (time.perf_counter() - t0)
        self.chooser.time("step_ms", ms / max(self.stats.body_steps - steps, 1))
        if proposal:
            self.chooser.unchosen(match, proposal, new)
        return new

    @torch.no_grad()
    def logits(self, prefix: torch.Tensor, prompt: int) -> torch.Tensor:
        """The full head's logits [V] at the last position of ``prefix`` [1, n] through this
        loop's compiled body: its first ``prompt`` tokens prefilled, the rest one token at a time
        (plain decoding's computation; ``prompt = n``: one pass over many rows, a verification's).
        What :func:`trimpass.hf.divergence.explain` compares."""
        ids = prefix.to(self.head.weight.device)
        with self._untraced():
            self._fresh_cache(ids.shape[1], 1)
            h, _ = self._prefill(ids[:, :prompt])
            for j in range(prompt, ids.shape[1]):
                h, _ = self._run(ids[:, j:j + 1], j)
        return self.head(h)[0]

    @contextlib.contextmanager
    def _untraced(self):
        """Body passes that leave the last call's trace as it was."""
        kept, self.trace = self.trace, None
        try:
            yield
        finally:
            self.trace = kept

    @torch.no_grad()
    def replayed(self, trace: list, position: int) -> torch.Tensor:
        """The full head's logits [V] for the row at ``position`` as a call of this loop computed
        them (``trace``: its ``self.trace``): its cache, rollbacks and body passes replayed in
        order up to the last pass over that row, the pass whose row gave the token after it."""
        last = max((i for i, e in enumerate(trace) if e[0] == "pass"
                    and e[1] <= position < e[1] + e[2].shape[1]), default=None)
        if last is None:
            raise ValueError(f"position: no body pass of this trace computed row {position}")
        with self._untraced():
            for e in trace[:last + 1]:
                if e[0] == "cache":
                    self._fresh_cache(e[1], e[2])
                elif e[0] == "rollback":
                    self._rollback(e[1])
                else:
                    hs = self._pass(e[2], e[1])[0]
        row = position - trace[last][1]
        return self.head(hs[row:row + 1])[0]

    def _first(self, h, sampler) -> int:
        """The full head's own token from one hidden state (the prefill's, plain decoding's)."""
        self.stats.verifications += 1
        if sampler is None:
            return int(accept.greedy(self.head, h)[0][0])
        return int(torch.multinomial(sampler.target(self.head(h)), 1)[0, 0])

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens, sampler, eos: set[int],
                 outputs=None) -> torch.Tensor:
        self.warm_up()
        state = self.backend.state_for(self.step) if self.speculate else None
        if state is not None and state.V is not None:
            state.reset()  # a new request: its context ids, not the last one's
        P = input_ids.shape[1]
        self.trace = [("cache", P, max_new_tokens)]
        self._fresh_cache(P, max_new_tokens)
        ids = input_ids.to(self.head.weight.device)
        h, _ = self._prefill(ids)
        out = [self._first(h, sampler)]
        text = lookup.Lookup(self.lookup_tokens, NGRAM if self.lookup_tokens else 0, outputs)
        self.chooser.new_request()
        text.extend(input_ids[0].tolist() + out)
        while len(out) < max_new_tokens and out[-1] not in eos:
            new = self._next(out[-1], P + len(out) - 1, max_new_tokens - len(out), sampler, text)
            out += new
            text.extend(new)
        out = through_eos(out, eos)
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
