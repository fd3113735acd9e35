"""What trimpass holds for each vLLM drafter, owned by trimpass: one :class:`DrafterState` per
drafter (its trimmed head and request rows, its budget, its KV sharing), kept in a registry keyed
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
from trimpass.budget.runner import PolicyRunner, StopDrafting
from trimpass.config import TrimpassError
from trimpass.measure import timed
from trimpass.serving import vllm_compat as compat
from trimpass.serving import vllm_kv
from trimpass.serving import vllm_settings as front
from trimpass.serving.vllm_check import CheckedTrimmer
from trimpass.serving.vllm_trim import Trimmer
from trimpass.spec.config import LookupConfig
from trimpass.spec.proposers.lookup import LookupProposer

_drafters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_process = {"proposals": 0, "propose_s": 0.0}  # in this process, trimmed or not (benchmarks)
_UNDECIDED = object()


class DrafterState:
    """One drafter's trimpass state: ``trimmer`` (None: untrimmed), ``budget`` (a
    :class:`PolicyRunner`, or None), ``self_drafting`` (the drafter is a copy of the target: its
    layers use the target's KV cache once :meth:`share_cache` ran)."""

    def __init__(self, trimmer: Trimmer | None, budget: PolicyRunner | None,
                 self_drafting: bool, *, plain, model_key: str = "", max_seqs: int = 1):
        self.trimmer, self.budget, self.self_drafting = trimmer, budget, self_drafting
        self.plain = plain  # hidden states -> the drafter's plain logits
        self.model_key, self.max_seqs = model_key, max_seqs
        self.cache_shared = False
        self.shared = collections.Counter()  # first_pass_rows, cache_unused_bytes
        self.rejected = None  # the runner's rejected counts, for the next-token first pass
        self.measuring = False  # the cost model is timing the target alone
        self.plain_steps = 0  # engine steps that verified no draft, sampled as plain decoding
        self.skipped_whole = 0  # proposals skipped before vLLM prepared them
        self.budget_s = 0.0  # seconds of the budget's own work (and its lookups'), on the host
        self._decided = _UNDECIDED  # the budget's decision for the proposal under way
        self.lookups: LookupProposer | None = None  # the requests' lookup indexes, once drafted
        self._proposals = None  # this proposal's lookup drafts, for begin_drafting

    # ---- engine steps --------------------------------------------------------------------------
    def share_cache(self, pairs: dict) -> dict:
        """``pairs``: drafter layer name -> (its cache, the target layer's); the caches each
        drafter layer takes (every pair checked first, nothing shared on a mismatch)."""
        self.shared["cache_unused_bytes"] = vllm_kv.check_pairs(pairs)
        self.cache_shared = True
        return {name: theirs for name, (_, theirs) in pairs.items()}

    def first_pass_ran(self, rows: int) -> None:
        self.shared["first_pass_rows"] += rows

    def step(self, step, run, *, verify, device, max_tokens: int):
        """One engine step (:class:`~trimpass.serving.vllm_compat.Step`); ``run()`` runs the
        target's forward, ``verify(n)`` a dummy forward of ``n`` tokens."""
        if self.trimmer is not None:
            self.trimmer.settle([r for r in step.scheduled if r not in step.resumed])
        if self.lookups is not None:
            self.lookups.keep_only(step.scheduled)
        b = self.budget
        if b is None:
            return run()
        b.timings.forward_began(time.perf_counter())
        if b.cost.table is None:
            self.measuring = True
            try:
                b.cost.measure(verify, key=self.model_key, max_tokens=max_tokens,
                               max_seqs=self.max_seqs, gamma_max=b.gamma_max,
                               budget_s=float(b.settings["measure_s"]), device=device)
            finally:
                self.measuring = False
        out, seconds = timed(run, device=device)  # the syncs are no-ops on CPU
        b.timings.forward_ended(time.perf_counter(), len(step.scheduled),
                                drafted=any(step.drafts.values()))
        t0 = time.perf_counter()
        b.observed(step.scheduled, step.drafts, step.tokens, seconds)
        self.budget_s += time.perf_counter() - t0
        return out

    def plain_step(self) -> None:
        """This step verifies no drafted token: vLLM samples it as plain decoding."""
        self.plain_steps += 1

    # ---- proposals -----------------------------------------------------------------------------
    def before_proposal(self, batch, emitted: list[int], *, gamma: int | None = None,
                        tokens: int | None = None, ids=None, no_probs: bool = False
                        ) -> list | None:
        """Before vLLM prepares a proposal over ``batch``: the budget reads what the target
        accepted of the last drafts (``emitted``: each request's tokens emitted this step) and,
        given the proposal's ``gamma``, the target pass's ``tokens`` and each request's lookup
        draft (where lookup is on and the drafts need no probabilities, ``no_probs``; ``ids()``:
        the tokens each request emitted), decides. Returns the proposal's drafts (lookup drafts
        only) where the budget skips the drafter and the drafter shares the target's cache: then
        neither vLLM's preparation nor the drafter has anything to do, and the request rows catch
        up at the next drafted proposal (each admits its request's tokens since its last). Else
        None, and vLLM proposes."""
        self._req_ids, self._proposals = batch.req_ids, None
        if self.budget is not None:
            t0 = time.perf_counter()
            drafts = self._budget_decides(batch, emitted, gamma, tokens, ids, no_probs)
            self.budget_s += time.perf_counter() - t0
            if drafts is not None:
                return drafts
        if self.trimmer is not None:
            self.trimmer.begin(batch, emitted)
        return None

    def _budget_decides(self, batch, emitted, gamma, tokens, ids, no_probs) -> list | None:
        b = self.budget
        b.accepted(batch.req_ids, emitted)
        if b.settings["lookup"] and gamma and no_probs and ids is not None:
            self._proposals = self._lookups(b.settings["lookup"]).draft(
                batch.req_ids, batch.lengths, batch.tokens, ids(), gamma).per_request()
        if gamma is None or not b.shares_cache:
            return None
        run = b.begin(len(batch.req_ids), gamma, tokens, self._proposals)
        if run is not None:
            self._decided = run
            return None
        self.skipped_whole += 1
        return b.cut(torch.empty(len(batch.req_ids), 0, dtype=torch.long), batch.req_ids)

    def _lookups(self, settings: dict) -> LookupProposer:
        lk, want = self.lookups, (settings["tokens"], settings["ngram"])
        if lk is None or (lk.config.tokens, lk.config.ngram) != want:
            lk = self.lookups = LookupProposer(LookupConfig(tokens=want[0], ngram=want[1]))
        return lk

    def after_proposal(self, draft):
        if self.budget is None:
            return draft
        t0 = time.perf_counter()
        try:
            return self.budget.cut(draft, self._req_ids)
        finally:
            self.budget_s += time.perf_counter() - t0

    def end_proposal(self) -> None:
        self._decided, self._proposals = _UNDECIDED, None
        if self.trimmer is not None:
            self.trimmer.end()

    def begin_drafting(self, batch: int | None, gamma: int, tokens: int | None) -> int | None:
        """The drafting steps this proposal runs (None: no drafter forward): the budget's
        decision, taken in :meth:`before_proposal` where vLLM's proposal passed through it."""
        if self.budget is None:
            return gamma
        if self._decided is not _UNDECIDED:
            run, self._decided = self._decided, _UNDECIDED
            return run
        return self.budget.begin(batch, gamma, tokens, self._proposals)

    def drafted_for(self, seconds: float) -> None:
        if self.budget is not None:
            self.budget.timings.drafting(seconds)

    def stopped_draft(self):
        return self.budget.stopped_draft()

    def logits(self, h):
        """The drafter's logits for ``h`` and each row's softmax maximum (or None)."""
        if self.trimmer is None:
            return self.plain(h), None
        return self.trimmer.logits(h, with_top=self.budget is not None)

    def drafted(self, ids, probs, logits, top) -> None:
        if self.budget is None:
            return
        if probs is not None:
            conf = probs.gather(-1, ids.long()[:, None])[:, 0].float()
        elif top is not None and top.shape[0] == ids.shape[0]:
            conf = top  # from the rows' own logits, no V-wide pass
        else:
            conf = softmax_max(logits)
        self.budget.drafted(ids, conf, probs)

    def stats(self) -> dict:
        out = {**_process, "plain_steps": self.plain_steps, "skipped_whole": self.skipped_whole,
               "budget_s": self.budget_s}
        if self.lookups is not None:
            out["lookup_live"] = len(self.lookups)
        if self.cache_shared:
            out["shared_cache"] = {k: self.shared[k] for k in ("first_pass_rows",
                                                               "cache_unused_bytes")}
        if self.budget is not None:
            out["budget"] = b = self.budget.stats()
            if b["table"] is not None:  # the deployment it was measured on, checked at load
                b["table"]["model"] = self.model_key
        return out if self.trimmer is None else {**self.trimmer.stats(), **out}


class Hooks:
    """The callbacks of :func:`trimpass.serving.vllm_compat.install`. ``startup`` checks an
    engine's arguments before it starts; ``self_drafting_ok``: whether this vLLM may run the
    routes that write into the target's KV cache (its tested versions only)."""

    error = TrimpassError
    stop = StopDrafting

    def __init__(self, startup, self_drafting_ok: bool = True):
        self.startup, self.self_drafting_ok = startup, self_drafting_ok

    def state(self, proposer) -> DrafterState | None:
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
            runner = PolicyRunner(checked, drafter.gamma, shares_cache=self_drafting)
        _drafters[proposer] = DrafterState(trimmer, runner, self_drafting,
                                           plain=drafter.head.plain, model_key=drafter.model_key,
                                           max_seqs=drafter.max_num_seqs)

    def proposed(self, seconds: float) -> None:
        _process["proposals"] += 1
        _process["propose_s"] += seconds

    def worker_stats(self, st: DrafterState | None) -> dict:
        return dict(_process) if st is None else st.stats()

    def set_budget(self, st: DrafterState | None, settings: dict) -> dict:
        if st is None or st.budget is None:
            raise RuntimeError("trimpass: this engine has no budget; start it with "
                               "engine_args(..., budget=...)")
        st.budget.set(settings)
        return st.budget.settings
