"""What trimpass holds for each vLLM drafter, owned by trimpass: one :class:`Proposer` per drafter
(its trimmed head and request rows, its controller, its lookup indexes, its KV sharing, and the
requests' lifecycle), kept in a registry keyed
weakly by vLLM's proposer, never as attributes on vLLM's objects. :class:`Hooks` is what the
wrappers of :mod:`trimpass.serving.vllm_compat` call: at load, a drafter whose settings ask for
it gets a state (the settings from ``additional_config``, else the command line's fallbacks:
:mod:`trimpass.serving.vllm_settings`); every later wrapper finds the state by its proposer and
delegates to vLLM's own method where there is none."""
from __future__ import annotations

import collections
import time
import weakref

import torch

from trimpass.base import softmax_max
from trimpass.config import TrimpassError
from trimpass.measure import timed
from trimpass.serving import vllm_compat as compat
from trimpass.serving import vllm_kv
from trimpass.serving import vllm_settings as front
from trimpass.serving.vllm_check import CheckedTrimmer
from trimpass.serving.vllm_free import FreeDrafts
from trimpass.serving.vllm_trim import Trimmer
from trimpass.spec.control.controller import Controller, takes_free
from trimpass.spec.control.costs import ChainCosts

_drafters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_process = {"proposals": 0, "propose_s": 0.0}  # in this process, trimmed or not (benchmarks)


class Proposer:
    """One vLLM drafter's trimpass proposer: ``trimmer`` (None: untrimmed), ``controller`` (a
    :class:`~trimpass.spec.control.controller.Controller`, or None: vLLM drafts as it would),
    ``self_drafting`` (the drafter is a copy of the target: its layers use the target's KV cache
    once :meth:`share_cache` ran). Every per-request record lives in one map,
    :attr:`requests` (request id -> the step it was bound at), with one lifecycle: bound when the
    scheduler first sends the request, released on finish or abort, and rebuilt from the engine's
    tokens after preemption (its rows and lookup index release as it resumes and rebuild at its
    next proposal)."""

    def __init__(self, trimmer: Trimmer | None, controller: Controller | None,
                 self_drafting: bool, *, plain, model_key: str = "", max_seqs: int = 1,
                 audit: bool = False):
        self.trimmer, self.controller, self.self_drafting = trimmer, controller, self_drafting
        self.plain = plain  # hidden states -> the drafter's plain logits
        self.model_key, self.max_seqs = model_key, max_seqs
        self.cache_shared = False
        self.shared = collections.Counter()  # first_pass_rows, cache_unused_bytes
        self.rejected = None  # the runner's rejected counts, for the next-token first pass
        self.measuring = False  # the cost model is timing the target alone
        self.plain_steps = 0  # engine steps that verified no draft, sampled as plain decoding
        self.skipped_whole = 0  # proposals that ran no drafter forward and no vLLM preparation
        self.budget_s = 0.0  # seconds of the controller's own work (and its lookups'), on the host
        self.requests: dict = {}  # request id -> the engine step it was bound at
        self.steps = 0
        self.free = FreeDrafts(audit)  # lookup and suffix indexes (audit: ids offered, tests)
        if trimmer is not None:  # in the worker's stats file too
            trimmer.beside = lambda: self.free.stats(None if controller is None else
                                                     controller.counts)
        self.confidences: list = []  # this proposal's drafted tokens' confidences, on the device

    # ---- engine steps --------------------------------------------------------------------------
    def share_cache(self, pairs: dict) -> dict:
        """``pairs``: drafter layer name -> (its cache, the target layer's); the caches each
        drafter layer takes (every pair checked first, nothing shared on a mismatch)."""
        self.shared["cache_unused_bytes"] = vllm_kv.check_pairs(pairs)
        self.cache_shared = True
        return {name: theirs for name, (_, theirs) in pairs.items()}

    def first_pass_ran(self, rows: int) -> None:
        self.shared["first_pass_rows"] += rows

    def follow(self, step) -> None:
        """The requests' lifecycle at one engine step (:class:`~trimpass.serving.vllm_compat.
        Step`): new ones bound (a live id sent again is refused), finished and aborted ones
        released, and every record of a request not in the batch (preempted, resuming) dropped,
        to be rebuilt from its own tokens."""
        self.steps += 1
        for rid in step.finished:
            self.requests.pop(rid, None)
            self.free.finish(rid)
        for rid in step.new:
            if rid in self.requests:
                raise TrimpassError(f"trimpass: request id {rid!r} is live (bound at engine step "
                                    f"{self.requests[rid]}) and was sent again as a new request; "
                                    "give each live request its own id")
            self.requests[rid] = self.steps
        keep = [r for r in step.scheduled if r not in step.resumed]
        if self.trimmer is not None:
            self.trimmer.settle(keep)
        self.free.keep_only(keep)

    def step(self, step, run, *, verify, device, max_tokens: int):
        """One engine step; ``run()`` runs the target's forward, ``verify(n)`` a dummy forward of
        ``n`` tokens (the cost model's start-up measurement)."""
        self.follow(step)
        c = self.controller
        if c is None:
            return run()
        timings = c.costs.timings
        timings.forward_began(time.perf_counter())
        if c.costs.engine.table is None:
            self.measuring = True
            try:
                c.costs.engine.measure(verify, key=self.model_key, max_tokens=max_tokens,
                                       max_seqs=self.max_seqs, gamma_max=c.gamma_max,
                                       budget_s=float(c.settings["measure_s"]), device=device)
            finally:
                self.measuring = False
        out, seconds = timed(run, device=device)  # the syncs are no-ops on CPU
        timings.forward_ended(time.perf_counter(), len(step.scheduled),
                              drafted=any(step.drafts.values()))
        t0 = time.perf_counter()
        c.observe_step(step.scheduled, step.drafts, step.tokens, seconds)
        self.budget_s += time.perf_counter() - t0
        return out

    def plain_step(self) -> None:
        """This step verifies no drafted token: vLLM samples it as plain decoding."""
        self.plain_steps += 1

    # ---- proposals -----------------------------------------------------------------------------
    def draft(self, batch, emitted, run, *, gamma: int, tokens: int, greedy: bool, device):
        """One proposal over ``batch`` (:class:`~trimpass.serving.vllm_compat.Batch`);
        ``emitted()``: the tokens each request emitted this step; ``run(depth)``: vLLM's own
        proposal drafting ``depth`` tokens. The controller plans the depth before drafting; a
        plan that drafts nothing on the target's own cache runs no drafter forward and returns
        the lookup drafts alone (the rows catch up at the next drafted proposal)."""
        c = self.controller
        if c is None:
            return self._run(batch, emitted(), lambda: run(gamma))
        t0 = time.perf_counter()
        ids = emitted()
        c.observe(batch.req_ids, ids)
        free = greedy and takes_free(c.settings)
        offered = self.free.draft(c.settings, batch, ids, gamma) if free else []
        lookup = c.prices.choose(*offered)
        plan = c.plan(len(batch.req_ids), gamma, lookup)
        self.budget_s += time.perf_counter() - t0
        if plan.depth is None:
            self.skipped_whole += 1
            return self._cut(plan, batch, lookup=lookup, offered=offered)
        self.confidences = []
        drafts, seconds = timed(self._run, batch, ids, lambda: run(plan.depth), device=device)
        c.costs.timings.drafting(seconds)  # the drafter's, not the step's overhead
        if plan.depth and tokens <= len(batch.req_ids) * (1 + c.gamma_max):  # not a prefill's
            c.costs.drafted(len(batch.req_ids), plan.depth, seconds)
        conf = torch.stack(self.confidences, dim=1) if self.confidences else None
        return self._cut(plan, batch, drafts, conf, lookup=lookup, seconds=seconds,
                         offered=offered)

    def _run(self, batch, emitted, run):
        if self.trimmer is None:
            return run()
        self.trimmer.begin(batch, [len(x) for x in emitted])
        try:
            return run()
        finally:
            self.trimmer.end()

    def _cut(self, plan, batch, drafts=None, conf=None, offered=(), **kw):
        if drafts is not None and not (isinstance(drafts, torch.Tensor) and drafts.dim() == 2):
            self.controller.counts["unbudgeted"] += 1  # a route's drafts of another shape: as is
            return drafts
        t0 = time.perf_counter()
        try:
            out = self.controller.cut(plan, batch.req_ids, drafts, conf, **kw)
            chosen = kw.get("lookup")
            for d in offered:  # the free drafts not chosen, priced against what comes
                for i, rid in enumerate(batch.req_ids):
                    if d.counts[i] and (chosen is None or chosen.source[i] != d.source[i]):
                        self.controller.offer(rid, d.source[i], d.row(i), 0, match=d.match[i])
            return out
        finally:
            self.budget_s += time.perf_counter() - t0

    def logits(self, h):
        """The drafter's logits for ``h`` and each row's softmax maximum (or None)."""
        if self.trimmer is None:
            return self.plain(h), None
        return self.trimmer.logits(h, with_top=self.controller is not None)

    def drafted(self, ids, probs, logits, top) -> None:
        """One drafting step's tokens: their confidences stay on the device until the cut."""
        if self.controller is None:
            return
        if probs is not None:
            conf = probs.gather(-1, ids.long()[:, None])[:, 0].float()
        elif top is not None and top.shape[0] == ids.shape[0]:
            conf = top  # from the rows' own logits, no V-wide pass
        else:
            conf = softmax_max(logits)
        self.confidences.append(conf)

    def stats(self) -> dict:
        out = {**_process, "plain_steps": self.plain_steps, "skipped_whole": self.skipped_whole,
               "budget_s": self.budget_s, "requests_live": len(self.requests)}
        out.update(self.free.stats(None if self.controller is None else self.controller.counts))
        if self.cache_shared:
            out["shared_cache"] = {k: self.shared[k] for k in ("first_pass_rows",
                                                               "cache_unused_bytes")}
        if self.controller is not None:
            out["budget"] = b = self.controller.stats()
            if b["table"] is not None:  # the deployment it was measured on, checked at load
                b["table"]["model"] = self.model_key
        return out if self.trimmer is None else {**self.trimmer.stats(), **out}


class Hooks:
    """The callbacks of :func:`trimpass.serving.vllm_compat.install`. ``startup`` checks an
    engine's arguments before it starts; ``self_drafting_ok``: whether this vLLM may run the
    routes that write into the target's KV cache (its tested versions only)."""

    error = TrimpassError

    def __init__(self, startup, self_drafting_ok: bool = True):
        self.startup, self.self_drafting_ok = startup, self_drafting_ok

    def request(self, additional, extra: dict) -> None:
        """A request's ``vllm_xargs`` checked in the front end: its ``trimpass_tenant`` a string,
        and the server's own where the budget serves one tenant without sharing."""
        if compat.TENANT_KEY not in extra:
            return
        tenant, key = extra[compat.TENANT_KEY], f"vllm_xargs {compat.TENANT_KEY}"
        if not isinstance(tenant, str):
            raise ValueError(f"{key}: a string naming the request's tenant (whose earlier "
                             f"outputs draft for it), got {type(tenant).__name__}")
        budget = front.resolve_budget(None, additional) if additional is not None else None
        if not isinstance(budget, dict) or budget.get("tenant") is None:
            return
        suffix = budget.get("suffix")
        shared = isinstance(suffix, dict) and suffix.get("share") is True
        if tenant != budget["tenant"] and not shared:
            raise ValueError(f"{key}: this server serves tenant {budget['tenant']!r} alone and "
                             f"shares no suffix index across tenants; a request may not name "
                             f"another tenant's ({tenant!r}); leave it out")

    def state(self, proposer) -> Proposer | None:
        try:
            return _drafters.get(proposer)
        except TypeError:  # not weakly referable: not a proposer trimpass knows
            return None

    def loaded(self, proposer, drafter) -> None:
        settings = front.resolve(drafter.checkpoint, drafter.additional)
        budget = front.resolve_budget(drafter.checkpoint, drafter.additional)
        if settings is None and budget is None:
            return
        if drafter.head is None:
            raise RuntimeError("trimpass: the drafter has no compute_logits, lm_head or "
                               "logits_processor; trimpass drafts from vLLM causal-LM drafters "
                               "with a LogitsProcessor")
        if drafter.refused:
            raise RuntimeError(f"trimpass: this drafter uses vLLM's {drafter.refused}; trimpass "
                               "reads each drafted token's logits and supports neither")
        if budget is not None and drafter.async_scheduling:
            raise RuntimeError("trimpass budget: vLLM's async scheduling cannot take drafts of "
                               "varying length; start the engine with async_scheduling=False")
        self_drafting = vllm_kv.same_model(drafter.model, drafter.target)
        if self_drafting and not self.self_drafting_ok:
            raise RuntimeError("trimpass: the target drafting for itself writes into the "
                               "target's KV cache, which only a tested vLLM may do; use another "
                               "drafter or a tested vLLM")
        if self_drafting and not drafter.first_pass_ok:
            raise RuntimeError("trimpass: the next-token first pass needs vLLM's draft-model "
                               "route (no M-RoPE, no parallel drafting)")
        trimmer = None
        if settings is not None:
            kind = CheckedTrimmer if settings.get("check") else Trimmer
            trimmer = kind(drafter, settings, compat.log())
        runner = None
        if budget is not None:
            checked = front.budget_settings(budget, drafter.gamma)
            made_for = (checked.get("table") or {}).get("model")
            if made_for not in (None, drafter.model_key):
                raise RuntimeError(f"trimpass budget table: measured for {made_for}, but this "
                                   f"engine serves {drafter.model_key}; leave 'table' out (the "
                                   "engine measures its own) or give this deployment's table")
            runner = Controller(checked, drafter.gamma,
                                ChainCosts(checked.get("table"), shares_cache=self_drafting))
        _drafters[proposer] = Proposer(trimmer, runner, self_drafting,
                                           plain=drafter.head.plain, model_key=drafter.model_key,
                                           max_seqs=drafter.max_num_seqs,
                                           audit=bool((settings or {}).get("check")))

    def proposed(self, seconds: float) -> None:
        _process["proposals"] += 1
        _process["propose_s"] += seconds

    def worker_stats(self, st: Proposer | None) -> dict:
        return dict(_process) if st is None else st.stats()

    def set_budget(self, st: Proposer | None, settings: dict) -> dict:
        if st is None or st.controller is None:
            raise RuntimeError("trimpass: this engine has no budget; start it with "
                               "engine_args(..., budget=...)")
        st.controller.set(settings)
        return st.controller.settings
