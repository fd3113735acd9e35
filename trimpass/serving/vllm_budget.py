"""D-Cut inside vLLM 0.32's workers: how far the drafter drafts and how many drafted tokens each
request sends to verification, by :mod:`trimpass.budget` and a cost model measured on the engine. A
:class:`Budget` sits on a drafter (a ``SpecDecodeBaseProposer``). During a proposal it records each
drafted token's confidence (the drafter's probability of the token it drafted: the softmax maximum
for greedy drafts, the sampled token's probability for probabilistic ones) and, after each drafting
step, asks :func:`trimpass.budget.draft_more` whether any request can still put a token into the
cut: requests that cannot are stopped (their later confidences count as 0) and, when none can
or when :func:`trimpass.budget.next_step_pays` says another step is not worth its time, drafting
ends there (the proposal returns the tokens drafted so far). The proposal is then cut by
:func:`trimpass.budget.dcut` into per-request prefixes, which vLLM's scheduler accepts as lists of
any length. Confidences are first calibrated by what the target accepted of earlier drafts
(:class:`trimpass.budget.calibration.Calibration`). The cost of verification, C(batch, tokens), is
measured at the engine's first step (the target alone through the runner's own dummy run, at a few
token counts, within ``measure_s`` seconds; cached per device, model, dtype and grid; or a
``table`` the user measured) and refined from the time of every pure decode step the engine then
runs; to it the policies add the step's measured overhead, the seconds between one forward's end
and the next one's start less the drafter's own (sampling, scheduling, output handling), apart for
steps that verified drafts and steps that did not. Every timing is the median of the last
``WINDOW`` at its batch bucket (a cold first call or an idle engine's gap is an outlier there),
and a bucket drafts until it has timed ``TIMED_MIN`` proposals. Before each proposal the policy
may skip it (``dcut`` and ``all-or-nothing`` where no draft could pay at this batch size,
``none`` always): where the drafter shares the target's KV cache (:mod:`trimpass.serving.vllm_kv`:
the target drafting for itself) no drafter forward runs at all;
otherwise vLLM's own K = 0 path runs the drafter's first forward, which keeps its cache in step.
Policies: ``dcut``; ``all-or-nothing`` (keep a step's whole draft or none of it, by the same cost
model); ``fixed`` (draft ``gamma`` tokens, keep them all); ``none`` (speculation paused); ``off``
(vLLM's own behaviour).
vLLM's async scheduling cannot take drafts of varying length; the CPU build runs without it, and a
GPU engine must set ``async_scheduling=False``.
"""
from __future__ import annotations

import collections
import time

import numpy as np
import torch

from trimpass import measure as _m
from trimpass.base import softmax_max
from trimpass.budget import CostTable
from trimpass.budget.calibration import Calibration
from trimpass.budget.costmodel import StepCost
from trimpass.budget.policies import make

PROBE_EVERY = 16  # while a batch bucket skips its proposals, one in this many drafts anyway
WINDOW = 15  # the timings whose median is a bucket's
TIMED_MIN = 3  # drafting proposals a bucket times before it may skip (its first may run cold)


class _StopDrafting(Exception):
    """Raised inside a proposal's drafting loop to end it before the next drafter forward."""


def _grid(top: int) -> list[int]:
    """1, 2, 4, ... up to ``top`` (included)."""
    out, n = [], 1
    while n < top:
        out.append(n)
        n *= 2
    return out + [top]


class Budget:
    """One drafter's verification budget: its policy, cost model, timings and counters."""

    def __init__(self, proposer, settings: dict):
        for flag in ("use_local_argmax_reduction", "use_heterogeneous_vocab", "parallel_drafting"):
            if getattr(proposer, flag, False):
                raise RuntimeError(f"trimpass budget: this drafter uses vLLM's {flag}; D-Cut "
                                   "reads each drafted token's probability and supports neither")
        self.proposer = proposer
        cfg = proposer.vllm_config
        if getattr(cfg.scheduler_config, "async_scheduling", False):
            raise RuntimeError("trimpass budget: vLLM's async scheduling cannot take drafts of "
                               "varying length; start the engine with async_scheduling=False")
        self.gamma_max = int(proposer.num_speculative_tokens)
        self.policy = make(settings, self.gamma_max)
        self.model_key = f"{cfg.model_config.model}:{cfg.model_config.dtype}"
        self.max_seqs = int(cfg.scheduler_config.max_num_seqs)
        self.table: CostTable | None = None
        self.first_s: dict = {}  # batch bucket -> seconds of the first forward + sampling
        self.step_s: dict = {}  # batch bucket -> seconds of each later drafting step
        self.overhead_s: dict = {}  # batch bucket -> seconds outside forward and drafting, for a
        self.overhead_plain_s: dict = {}  # step that verified drafts; for one that verified none
        self._samples: dict = {}  # (name, bucket) -> the last WINDOW seconds
        self._ended: tuple | None = None  # (when the last forward ended, its bucket, its kind)
        self._drafting_s = 0.0  # the drafter's seconds since then
        self.shares_cache = False  # the drafter's attention reads and writes the target's cache
        self._skipped: set = set()  # requests whose last proposal was skipped
        self._resumed: set = set()  # requests whose drafts in verification follow a skip
        self._skips_in_row: dict = {}  # batch bucket -> proposals skipped in a row
        self._timed = False  # whether this proposal's first forward is a drafting step's time
        self._sample, self._propose = proposer._sample_draft_tokens, proposer.propose
        proposer._sample_draft_tokens, proposer.propose = self.sample, self.propose
        self.counts = collections.Counter()
        self.kept = collections.Counter()  # K (drafted tokens verified in all) -> steps
        self.depth = collections.Counter()  # drafting steps run -> proposals
        self._conf: list[torch.Tensor] = []
        self._ids: list[torch.Tensor] = []
        self._probs: list[torch.Tensor] = []
        self._t: list[float] = []
        self._stopped: torch.Tensor | None = None
        self._gamma_run: int | None = None
        self.calibration = Calibration()
        self._sent: dict = {}  # request id -> raw prefix scores of the drafts it sent to verify

    @property
    def settings(self) -> dict:
        return self.policy.settings

    def set(self, settings: dict) -> None:
        """A new policy; its counters start from zero, the cost model and timings are kept."""
        self.policy = make(settings, self.gamma_max)
        measured = self.counts["cost_measurements"]
        for c in (self.counts, self.kept, self.depth):
            c.clear()
        self.counts["cost_measurements"] = measured

    # ---- the cost model ------------------------------------------------------------------------
    def measure_cost(self, runner) -> None:
        """C(batch, tokens) from the target alone at a few token counts (the runner's dummy run
        with attention, the drafter's own dummy run skipped), cached per device and model: here
        C(B, B + K) = T(B + K), and the engine's own decode steps then refine each cell."""
        if self.settings.get("table") is not None:  # measured elsewhere, given by the user
            self.table = CostTable.from_dict(self.settings["table"])
            return
        top = min(int(runner.max_num_tokens), self.max_seqs * (1 + self.gamma_max))
        ns = _grid(top)
        budget_s = float(self.settings["measure_s"])

        def compute() -> dict:
            drafter, device = runner.drafter, runner.device
            drafter.dummy_run = lambda *a, **k: None  # this instance only, restored below
            try:
                times = []
                t0 = time.perf_counter()
                for i, n in enumerate(ns):
                    share = max(budget_s - (time.perf_counter() - t0), 0.0) / (len(ns) - i)
                    times.append(_m.median_s_within(
                        lambda n=n: runner._dummy_run(n, force_attention=True), share, device,
                        max_calls=5))
            finally:
                del drafter.dummy_run
            return {"tokens": ns, "seconds": times}

        got = _m.cached(f"vllm-verify:{self.model_key}:n={ns}", compute, runner.device)
        batches = _grid(self.max_seqs)
        drafts = [0] + _grid(self.max_seqs * self.gamma_max)
        tokens = [[b + k for k in drafts] for b in batches]  # T(n) held flat beyond the grid
        self.table = CostTable(batches, drafts, np.interp(tokens, got["tokens"], got["seconds"]))
        self.counts["cost_measurements"] += 1

    def observe_step(self, scheduler_output, seconds: float) -> None:
        """Refine the cost model from one pure decode step (every request: 1 + its drafts)."""
        sched = scheduler_output.num_scheduled_tokens
        spec = scheduler_output.scheduled_spec_decode_tokens
        lengths = [len(v) for v in spec.values()]
        self.counts["verified"] += sum(lengths)
        self.counts["verified_mixed"] += int(len(set(lengths)) > 1)
        self.counts["verified_max"] = max(self.counts["verified_max"], max(lengths, default=0))
        if self.table is None:
            return
        if not sched or any(n != 1 + len(spec.get(r, ())) for r, n in sched.items()):
            return
        B, tokens = len(sched), int(scheduler_output.total_num_scheduled_tokens)
        self.table.update(B, tokens, seconds, refit=self.counts["updates"] % 8 == 7)
        self.counts["updates"] += 1

    @property
    def cost(self) -> StepCost | None:
        """A step's cost as the policies price it: C plus the measured per-step overhead."""
        if self.table is None:
            return None
        return StepCost(self.table, lambda b: self._overhead(b, False),
                        lambda b: self._overhead(b, True))

    def _overhead(self, batch: int, drafted: bool) -> float:
        """The overhead of a step of this kind at ``batch``'s bucket, or at the nearest bucket
        measured (of the other kind where this one has none; 0 before any)."""
        mine, other = (self.overhead_s, self.overhead_plain_s)[::1 if drafted else -1]
        got = mine or other
        if not got:
            return 0.0
        n = _bucket(batch).bit_length()
        return got[min(got, key=lambda k: (abs(k.bit_length() - n), k))]

    def _record(self, name: str, k: int, seconds: float) -> None:
        """One more timing of ``name`` (an attribute: bucket -> median) at bucket ``k``."""
        s = self._samples.setdefault((name, k), collections.deque(maxlen=WINDOW))
        s.append(seconds)
        getattr(self, name)[k] = float(np.median(s))

    def forward_began(self, now: float) -> None:
        """The target's forward starts at ``now``: the seconds since the last one ended, less the
        drafter's, are the last step's overhead."""
        if self._ended is not None:
            end, k, drafted = self._ended
            self._record("overhead_s" if drafted else "overhead_plain_s", k,
                         max(now - end - self._drafting_s, 0.0))
        self._ended, self._drafting_s = None, 0.0

    def forward_ended(self, now: float, batch: int, drafted: bool) -> None:
        """The target's forward of ``batch`` requests ended at ``now``; ``drafted``: whether it
        verified drafted tokens."""
        if batch > 0:
            self._ended = (now, _bucket(batch), bool(drafted))

    # ---- during a proposal ---------------------------------------------------------------------
    def propose(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self._drafted(*args, **kwargs)
        finally:
            self._drafting_s += time.perf_counter() - t0

    def _drafted(self, *args, **kwargs):
        self._conf, self._ids, self._probs, self._t = [], [], [], [time.perf_counter()]
        self._stopped = None
        self._gamma_run = kwargs.get("num_speculative_tokens", args[0] if args else None)
        B = _batch_size(kwargs)
        tokens = kwargs.get("target_token_ids")
        # a first forward over prompt tokens (a prefill in the batch) is not a drafting step's time
        self._timed = B is None or tokens is None or \
            int(tokens.shape[0]) <= B * (1 + self.gamma_max)
        if B is not None and self._gamma_run and self._skip(B):
            self.proposer._last_draft_probs = None
            if self.shares_cache:  # the target's pass already wrote every layer's cache
                self.counts["skipped"] += 1
                return torch.empty(B, 0, dtype=torch.int64, device=kwargs["next_token_ids"].device)
            self.counts["skipped_first_forward_ran"] += 1
            self._gamma_run = 0
            if args:
                args = (0, *args[1:])
            else:
                kwargs["num_speculative_tokens"] = 0
        try:
            return self._propose(*args, **kwargs)
        except _StopDrafting:
            self.counts["stopped_early"] += 1
            if self._probs:
                self.proposer._last_draft_probs = torch.stack(self._probs, dim=1).contiguous()
            return torch.stack(self._ids, dim=1)

    def _skip(self, B: int) -> bool:
        """The policy's decision, except that every PROBE_EVERY-th skip in a row at a batch bucket
        drafts anyway: its times and the calibration stay current as the load changes."""
        k = _bucket(B)
        accept_max = float(self.calibration.scores(torch.ones(1, dtype=torch.float64))[0])
        timed = len(self._samples.get(("first_s", k), ())) >= TIMED_MIN
        skip = self.policy.skip(B, self.gamma_max, self.cost,
                                self.first_s.get(k) if timed else None, self.step_s.get(k),
                                accept_max)
        if skip and self.policy.name != "none":
            self._skips_in_row[k] = self._skips_in_row.get(k, 0) + 1
            if self._skips_in_row[k] % PROBE_EVERY == 0:
                self.counts["probes"] += 1
                return False
        elif not skip:
            self._skips_in_row[k] = 0
        return skip

    def sample(self, hidden_states, sampling_metadata):
        p = self.proposer
        if p._enable_probabilistic_draft_probs and not sampling_metadata.all_greedy:
            ids, probs = self._sample(hidden_states, sampling_metadata)
            conf = probs.gather(-1, ids.long()[:, None])[:, 0].float()
        else:
            trimmer = getattr(p, "_trimpass", None)
            if trimmer is not None:
                trimmer.top = None
            logits = p.model.compute_logits(hidden_states)
            ids, probs = logits.argmax(dim=-1), None
            conf = getattr(trimmer, "top", None)  # from the rows' own logits, no V-wide pass
            if conf is None or conf.shape[0] != ids.shape[0]:
                conf = softmax_max(logits)
        self._ids.append(ids)
        if probs is not None:
            self._probs.append(probs)
        if self._stopped is not None:
            conf = torch.where(self._stopped, torch.zeros_like(conf), conf)
        self._conf.append(conf.clamp(0, 1).nan_to_num(0.0))
        self._t.append(time.perf_counter())
        d = len(self._ids)
        if d < (self._gamma_run or 0) and self._stop_after(d):
            raise _StopDrafting
        return ids, probs

    def _stop_after(self, d: int) -> bool:
        conf, k = None, _bucket(self._conf[-1].shape[0])
        if self.policy.reads_confidence and self.table is not None and \
                self.step_s.get(k) is not None and self.first_s.get(k) is not None:
            conf = self.calibration.confidences(torch.stack(self._conf, dim=1).cpu())
        stop, active = self.policy.stop(conf, d, int(self._gamma_run), self.cost,
                                        self.step_s.get(k), self.first_s.get(k),
                                        self._t[-1] - self._t[0])
        if active is not None:
            self._stopped = ~active.to(self._conf[-1].device)
        return stop

    def observe_acceptance(self, req_ids, sampled) -> None:
        """What the target accepted of the drafts sent last step: ``sampled`` holds each request's
        emitted tokens this step (a [B, 1 + K] tensor with -1 where rejected, or lists)."""
        if not self._sent:
            return
        for rid, v in zip(req_ids, emitted(sampled), strict=False):
            scores = self._sent.pop(rid, None)
            if scores and v > 0:
                self.calibration.observe(scores, v - 1)
                got = min(v - 1, len(scores))
                self.counts["accepted"] += got
                if rid in self._resumed:  # the first drafts after a skipped proposal
                    self.counts["resumed_sent"] += len(scores)
                    self.counts["resumed_accepted"] += got
        self._sent.clear()

    def cut(self, draft, req_ids=None) -> list[list[int]] | torch.Tensor:
        """Each request's kept prefix of this proposal's ``draft`` [B, d], as vLLM's lists."""
        if not isinstance(draft, torch.Tensor) or draft.dim() != 2 or len(self._conf) != \
                draft.shape[1]:
            self.counts["unbudgeted"] += 1
            return draft
        B, d = draft.shape
        t, k = self._t, _bucket(B)
        if req_ids is not None:
            self._follow_skips(req_ids, skipped=d == 0)
        if d == 0:
            self.depth[0] += 1
            self.kept[0] += 1
            return [[] for _ in range(B)]
        if self._timed:
            self._record("first_s", k, t[1] - t[0])
        if d > 1:
            self._record("step_s", k, (t[-1] - t[1]) / (d - 1))
        raw = torch.stack(self._conf, dim=1).cpu().double()
        if not self.policy.reads_confidence or self.table is None or B == 0:
            n = torch.full((B,), d, dtype=torch.long)
        else:
            n = self.policy.keep(self.calibration.confidences(raw), self.cost, t[-1] - t[0])
        rows, lengths = draft.cpu().tolist(), n.tolist()
        kept = [row[:k] for row, k in zip(rows, lengths, strict=True)]
        if req_ids is not None:
            scores = torch.cumprod(raw, dim=1).tolist()
            self._sent = {rid: sc[:k] for rid, sc, k in zip(req_ids, scores, lengths,
                                                            strict=False) if k}
        self.kept[int(n.sum())] += 1
        self.counts["mixed"] += int(len(set(lengths)) > 1)
        self.depth[d] += 1
        self.counts["proposals"] += 1
        self.counts["drafted"] += B * d
        return kept

    def _follow_skips(self, req_ids, skipped: bool) -> None:
        """Which requests' drafts this step are their first after a skipped proposal."""
        if skipped:
            self._skipped = set(req_ids)
            self._resumed = set()
        else:
            self._resumed = self._skipped & set(req_ids)
            self._skipped = set()

    def stats(self) -> dict:
        return {"policy": self.policy.name, "gamma": self.settings.get("gamma"),
                "shares_cache": self.shares_cache, "first_s": dict(self.first_s),
                "step_s": dict(self.step_s), "overhead_s": dict(self.overhead_s),
                "overhead_plain_s": dict(self.overhead_plain_s),
                **dict(self.counts), "kept": dict(self.kept), "depth": dict(self.depth),
                "table": None if self.table is None else self.table.to_dict()}


def emitted(sampled) -> list[int]:
    """Tokens each request emitted this step, from the runner's ``sampled_token_ids`` (a [B, 1 +
    K] tensor with -1 where rejected, or lists)."""
    if isinstance(sampled, torch.Tensor):
        return (sampled >= 0).sum(dim=1).tolist() if sampled.dim() == 2 else []
    return [len(x) for x in sampled or ()]


def _batch_size(kwargs) -> int | None:
    ids = kwargs.get("next_token_ids")
    return None if ids is None else int(ids.shape[0])


def _bucket(batch: int) -> int:
    """The power of two at or above ``batch``: drafting times are kept per bucket."""
    return 1 << max(int(batch) - 1, 0).bit_length()

