"""The glue inside vLLM 0.32's worker processes: request rows that follow the model runner's batch,
and the drafter's logits from trimpass's trimmed head, on the ``draft_model`` and the EAGLE routes
(an EAGLE-3 head with its own ``d2t`` vocabulary trims inside it: :class:`DraftVocab`).

:func:`install` (called by the plugin in every process) wraps these, each a plain delegation until
a drafter trims: ``SpecDecodeBaseProposer.load_model`` (after loading, a drafter whose settings ask
for it gets a :class:`Trimmer`: its model's ``compute_logits`` is replaced on that instance only,
so the target's head, even a shared ``lm_head`` module, is never touched);
``GPUModelRunner.propose_draft_token_ids`` (which the CPU runner inherits: before each proposal the
trimmer binds the input batch's request ids to rows of its
:class:`trimpass.dynamic.state.ActiveState` and admits each request's new tokens);
``GPUModelRunner._update_states`` (right after the runner takes the scheduler's news, in the same
step, the rows of requests that left the batch are released: finished, aborted, preempted or not
scheduled; a resuming request's too, rebuilt from its own tokens at its next proposal; then the
``stats_dir`` file is written, :mod:`trimpass.serving.vllm_report`); and a ``trimpass_stats``
method on vLLM's workers for :func:`trimpass.serving.vllm.stats`. The pool has one row per
``max_num_seqs``; a smaller ``max_rows`` is a start-up error. A drafter with budget settings also
gets a :class:`trimpass.serving.vllm_budget.Budget` (D-Cut): the runner's ``execute_model`` is
timed for its cost model (measured before the engine's first step), each proposal is cut into
per-request lists, and ``trimpass_budget`` switches its policy. Where trimpass serves the target
as its own drafter, ``GPUModelRunner.initialize_kv_cache_tensors`` then points the drafter's
attention layers at the target's cache (:mod:`trimpass.serving.vllm_kv`): its first forward runs
over each request's next token alone, and a skipped proposal runs no drafter forward."""
from __future__ import annotations

import collections
import time

import torch

from trimpass.dynamic.state import ActiveState
from trimpass.measure import timed
from trimpass.serving import vllm_kv
from trimpass.serving import vllm_settings as front
from trimpass.serving.head import DraftVocab, RequestRows, trimmed_logits
from trimpass.serving.vllm_budget import Budget, emitted
from trimpass.serving.vllm_report import Report, memory

_installed = False
_proposals = [0, 0.0]  # proposals and their seconds in this process, trimmed or not (benchmarks)


def _log():
    from vllm.logger import init_logger
    return init_logger("vllm.trimpass")


class Trimmer:
    """One drafter's trimming: its rows, its counters, its ``compute_logits``."""

    def __init__(self, proposer, target_model, settings: dict):
        model = proposer.model
        if model is target_model:
            raise RuntimeError("trimpass: the drafter is the target model object; trimming it "
                               "would trim the target's head")
        for attr in ("compute_logits", "lm_head", "logits_processor"):
            if not hasattr(model, attr):
                raise RuntimeError(f"trimpass: the drafter {type(model).__name__} has no {attr}; "
                                   "trimpass trims vLLM causal-LM drafters with a LogitsProcessor")
        cfg = proposer.vllm_config
        V = model.logits_processor.org_vocab_size
        Vt = cfg.model_config.get_vocab_size()
        d2t = getattr(model, "draft_id_to_target_id", None)  # an EAGLE-3 draft vocabulary
        self.vocab = None if d2t is None else DraftVocab(d2t.data, Vt)
        if self.vocab is None and V != Vt:
            raise ValueError(f"trimpass: vocab size: the drafter has {V} ids but the target has "
                             f"{Vt} and no d2t map; trimpass serves a drafter of the target's "
                             "vocabulary, or an EAGLE-3 drafter with its d2t map")
        V = Vt  # rows, static lists and tokens are target ids
        settings = dict(settings)
        self.check = bool(settings.pop("check", False))
        self.log_interval = float(settings.pop("log_interval", 60))
        self.report = Report(settings.pop("stats_dir", None), cfg)
        seqs = cfg.scheduler_config.max_num_seqs
        rows = settings.get("max_rows")
        if rows is not None and rows < seqs:
            raise ValueError(f"trimpass: max_rows={rows} is below vLLM's max_num_seqs={seqs}: "
                             "every live request needs its own row; raise max_rows or drop it")
        if settings.get("vocab") is None:
            settings["max_rows"] = rows or seqs
        self.cfg = front.checked_config(settings, V)
        self.model, self.V = model, V
        weight = model.lm_head.weight
        if self.cfg.dynamic:
            self.state = ActiveState(self.cfg.settings)
            self.state.build(V, weight.device)
        else:
            self.state = None
            idx, cnt = self.cfg.settings.index(V, weight.device)
            self.static = (idx, cnt)
        self.rows = RequestRows(self.state)
        self.batch: list | None = None  # request ids of the proposal under way
        self.own: list = []  # check mode: each batch row's own tokens (the isolation check)
        self.keys: list = []  # check mode: each batch row's (first tokens, length)
        self.first: dict = {}  # check mode: "first tokens|length" -> the first draft's logits
        self._first_call = False
        self.calls = self.fallbacks = self.steps = self.checked = self.violations = 0
        self.foreign = self.missing = self.isolation_checked = 0
        self.rows_s = self.head_s = 0.0  # seconds following rows / in the trimmed head
        self.active_sum = self.row_calls = self.union_sum = 0
        self.max_abs_err = 0.0
        self.want_top, self.top = False, None  # each row's softmax maximum, for a Budget
        self.seen: dict = {}
        self._last_log = time.monotonic()
        self._plain = model.compute_logits
        model.compute_logits = self.compute_logits  # this instance only
        _log().info("trimpass: the drafter's head (V=%d) is trimmed: %s mode, %d request rows of "
                    "%d bytes", V, "dynamic" if self.state else "static",
                    self.cfg.settings.max_rows if self.state else 0,
                    self.state.bytes_per_row() if self.state else 0)

    # ---- rows that follow the runner's batch --------------------------------------------------
    def begin(self, runner, sampled=None) -> None:
        t0 = time.perf_counter()
        try:
            self._begin(runner, sampled)
        finally:
            self.rows_s += time.perf_counter() - t0

    def _begin(self, runner, sampled) -> None:
        ib = runner.input_batch
        req_ids = list(ib.req_ids[:ib.num_reqs])
        self.batch, self.steps = req_ids, self.steps + 1
        if self.state is None:
            return
        n = [int(ib.num_tokens_no_spec[i]) for i in range(len(req_ids))]
        self.rows.follow(req_ids, n, lambda i, a, b: ib.token_ids_cpu[i, a:b].copy())
        if self.check:
            self.own = [set(ib.token_ids_cpu[i, :n[i]].tolist()) for i in range(len(req_ids))]
            got = emitted(sampled)  # not yet in the batch's tokens: the first draft follows them
            got += [0] * (len(req_ids) - len(got))
            self.keys = [f"{ib.token_ids_cpu[i, :4].tolist()}|{n[i] + got[i]}"
                         for i in range(len(req_ids))]
            self._first_call = True
        if self.log_interval and time.monotonic() - self._last_log > self.log_interval:
            self._last_log = time.monotonic()
            s = self.stats()
            _log().info("trimpass: %d trimmed head calls (%d plain), %.0f active ids per row of "
                        "V=%d, %.0f computed per call, %d live request rows", s["calls"],
                        s["fallbacks"], s["active_sum"] / max(s["row_calls"], 1), self.V,
                        s["union_sum"] / max(s["calls"], 1), s["rows"])

    def end(self) -> None:
        self.batch = None

    def settle(self, runner, scheduler_output) -> None:
        """After the runner took the scheduler's news: release the row of every request that left
        the batch (finished, aborted, preempted or not scheduled) or resumes (rebuilt from its own
        tokens at its next proposal), then write the stats file if there is one."""
        ib = runner.input_batch
        left = set(scheduler_output.scheduled_cached_reqs.resumed_req_ids)
        self.rows.keep_only([r for r in ib.req_ids[:ib.num_reqs] if r not in left])
        self.report.write(self)

    def active(self, B: int):
        if self.state is None:
            return self.static
        return self.state.active(B)

    # ---- the drafter's logits ------------------------------------------------------------------
    def compute_logits(self, hidden_states: torch.Tensor):
        t0 = time.perf_counter()
        try:
            return self._logits(hidden_states)
        finally:
            self.head_s += time.perf_counter() - t0

    def _logits(self, hidden_states: torch.Tensor):
        model, h = self.model, hidden_states
        proc, head = model.logits_processor, model.lm_head
        W = getattr(head, "weight", None)
        if (self.batch is None or h.dim() != 2 or h.shape[0] != len(self.batch)
                or proc.logits_as_input or W is None or W.dtype != h.dtype
                or proc.head_dtype not in (None, h.dtype)
                or type(head.quant_method).__name__ != "UnquantizedEmbeddingMethod"):
            self.fallbacks += 1
            return self._plain(h)
        B = h.shape[0]
        idx, count = self.active(B)
        start = head.shard_indices.org_vocab_start_index
        top = self.want_top and head.tp_size == 1  # a shard's maximum is not the row's
        rows = idx if self.vocab is None else self.vocab.to_draft(idx)
        got = trimmed_logits(h, W, rows, count, start, softcap=proc.soft_cap or 0.0,
                             scale=proc.scale, with_top=top)
        local, U = got[:2]
        self.top = got[2] if top else None
        logits = proc._gather_logits(local) if head.tp_size > 1 else local
        if logits is not None:
            logits = logits[..., :proc.org_vocab_size]
            if self.vocab is not None:
                logits = self.vocab.to_target(logits)
        self.calls += 1
        cnt = count.reshape(-1)
        self.active_sum += int(cnt.sum()) * (B if cnt.numel() == 1 else 1)
        self.row_calls += B
        self.union_sum += U
        if self.check and logits is not None:
            self._check(h, logits, idx, count)
        return logits

    def _check(self, h, logits, idx, count) -> None:
        """Test mode: each row finite exactly on its active ids, equal there to the plain head."""
        full = self._plain(h)
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
        """Test mode: row ``b``'s ids are its request's own tokens and the shared core only (no id
        of another request), and hold all of its own tokens while they fit. Meaningful where
        nothing else is shared by design: no learned core, no successors."""
        st = self.state
        row = st.requests[self.batch[b]]
        shared = set(st.idx[row, :st.n_core].tolist())
        own = self.own[b]
        self.foreign += len(ids - shared - own)
        if len(shared | own) <= st.settings.capacity:
            self.missing += len(own - ids)
        self.isolation_checked += 1

    def stats(self) -> dict:
        return {"calls": self.calls, "fallbacks": self.fallbacks, "steps": self.steps,
                "rows": len(self.state.requests) if self.state else 0,
                "active_sum": self.active_sum, "row_calls": self.row_calls,
                "union_sum": self.union_sum, "checked": self.checked,
                "violations": self.violations, "max_abs_err": self.max_abs_err,
                "bytes_per_row": self.state.bytes_per_row() if self.state else 0,
                "foreign": self.foreign, "missing": self.missing,
                "isolation_checked": self.isolation_checked, **memory(self),
                "proposals": _proposals[0], "propose_s": _proposals[1], "rows_s": self.rows_s,
                "head_s": self.head_s,
                "seen": {k: sorted(v) for k, v in self.seen.items()}, "first": self.first}


def _trimmer_of(runner):
    return getattr(getattr(runner, "drafter", None), "_trimpass", None)


def _budget_of(runner):
    return getattr(getattr(runner, "drafter", None), "_trimpass_budget", None)


def install() -> None:
    """Wrap vLLM's proposer, runner and worker once per process (idempotent)."""
    global _installed
    if _installed:
        return
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.worker_base import WorkerBase

    load_model = SpecDecodeBaseProposer.load_model
    update_states = GPUModelRunner._update_states
    propose = GPUModelRunner.propose_draft_token_ids
    execute = GPUModelRunner.execute_model
    init_kv = GPUModelRunner.initialize_kv_cache_tensors

    def trim_load_model(self, target_model, *args, **kwargs):
        out = load_model(self, target_model, *args, **kwargs)
        drafter_dir = getattr(self.draft_model_config, "model", None)
        settings = front.resolve(drafter_dir)
        if settings is not None:
            self._trimpass = Trimmer(self, target_model, settings)
        budget = front.resolve_budget(drafter_dir)
        if budget is not None:
            self._trimpass_budget = Budget(self, budget)
            if settings is not None:
                self._trimpass.want_top = True
        if settings is not None or budget is not None:
            self._trimpass_self = vllm_kv.same_model(self.model, target_model)
        return out

    def trim_propose(self, *args, **kwargs):
        t0, t, b = time.perf_counter(), _trimmer_of(self), _budget_of(self)
        sampled = args[1] if len(args) > 1 else kwargs.get("sampled_token_ids")
        if t is not None:
            t.begin(self, sampled)
        if b is not None:
            req_ids = list(self.input_batch.req_ids[:self.input_batch.num_reqs])
            b.observe_acceptance(req_ids, sampled)
        try:
            out = propose(self, *args, **kwargs)
            return out if b is None else b.cut(out, req_ids)
        finally:
            if t is not None:
                t.end()
            _proposals[0] += 1
            _proposals[1] += time.perf_counter() - t0

    def settled_update(self, scheduler_output, *args, **kwargs):
        out = update_states(self, scheduler_output, *args, **kwargs)
        t = _trimmer_of(self)
        if t is not None:
            t.settle(self, scheduler_output)
        return out

    def shared_kv(self, *args, **kwargs):
        out = init_kv(self, *args, **kwargs)
        d, b = getattr(self, "drafter", None), _budget_of(self)
        if getattr(d, "_trimpass_self", False):
            names = d._draft_attn_layer_names
            ctx = self.compilation_config.static_forward_context
            vllm_kv.share_cache(names, ctx)
            d._trimpass_kv = collections.Counter()  # not the budget's: set_budget clears those
            vllm_kv.next_token_first_pass(d, d._trimpass_kv)
            d._trimpass_kv["cache_unused_bytes"] = vllm_kv.unused_bytes(names, ctx)
            if b is not None:
                b.shares_cache = True
            _log().info("trimpass: the drafter is the target; its %d attention layers use the "
                        "target's KV cache, its first forward each request's next token",
                        len(names))
        return out

    def timed_execute(self, scheduler_output, *args, **kwargs):
        b = _budget_of(self)
        if b is None:
            return execute(self, scheduler_output, *args, **kwargs)
        b.forward_began(time.perf_counter())
        if b.table is None:
            b.measure_cost(self)
        # the syncs are no-ops on CPU; the budget's steps read the host anyway
        out, seconds = timed(execute, self, scheduler_output, *args, device=self.device, **kwargs)
        spec = scheduler_output.scheduled_spec_decode_tokens
        b.forward_ended(time.perf_counter(), len(scheduler_output.num_scheduled_tokens),
                        drafted=any(len(v) for v in spec.values()))
        b.observe_step(scheduler_output, seconds)
        return out

    def trimpass_stats(self):
        runner = getattr(self, "model_runner", None)
        t, b = _trimmer_of(runner), _budget_of(runner)
        out = {"proposals": _proposals[0], "propose_s": _proposals[1]}
        kv = getattr(getattr(runner, "drafter", None), "_trimpass_kv", None)
        if kv is not None:  # the target drafting for itself on the target's cache
            out["shared_cache"] = {k: kv[k] for k in ("first_pass_rows", "cache_unused_bytes")}
        if b is not None:
            out["budget"] = b.stats()
        return out if t is None else {**t.stats(), **out}

    def trimpass_budget(self, settings: dict):
        b = _budget_of(getattr(self, "model_runner", None))
        if b is None:
            raise RuntimeError("trimpass: this engine has no budget; start it with "
                               "engine_args(..., budget=...)")
        b.set(settings)
        return b.settings

    SpecDecodeBaseProposer.load_model = trim_load_model
    GPUModelRunner.propose_draft_token_ids = trim_propose
    GPUModelRunner.execute_model = timed_execute
    GPUModelRunner.initialize_kv_cache_tensors = shared_kv
    GPUModelRunner._update_states = settled_update
    WorkerBase.trimpass_stats = trimpass_stats
    WorkerBase.trimpass_budget = trimpass_budget
    _installed = True
