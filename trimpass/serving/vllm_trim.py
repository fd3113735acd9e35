"""One vLLM drafter's trimmed head: request rows that follow the runner's batch, and the drafter's
logits from :func:`trimpass.serving.head.trimmed_logits` over each request's active ids, on the
``draft_model`` and the EAGLE routes (an EAGLE-3 head with its own ``d2t`` vocabulary trims
inside it: :class:`DraftVocab`). It reads vLLM only through what
:mod:`trimpass.serving.vllm_compat` takes out of it (:class:`~trimpass.serving.vllm_compat.Head`,
:class:`~trimpass.serving.vllm_compat.Batch`). Rows are bound before each proposal (each new
request's row built from its own tokens) and released in the engine step the runner learns a
request left the batch or resumes (:meth:`Trimmer.settle`); the pool has one row per
``max_num_seqs``. The check mode is a subclass (:mod:`trimpass.serving.vllm_check`)."""
from __future__ import annotations

import time

from trimpass.dynamic.state import ActiveState
from trimpass.serving import vllm_settings as front
from trimpass.serving.head import DraftVocab, RequestRows, trimmed_logits
from trimpass.serving.vllm_report import Report, memory


class Trimmer:
    """One drafter's trimming: its rows, its counters, its logits. ``settings`` are checked
    trimpass settings; ``drafter`` is :class:`trimpass.serving.vllm_compat.Drafter`."""

    def __init__(self, drafter, settings: dict, log=None):
        head = drafter.head
        if drafter.model is drafter.target:
            raise RuntimeError("trimpass: the drafter is the target model object; trimming it "
                               "would trim the target's head")
        if head is None:
            raise RuntimeError(f"trimpass: the drafter {type(drafter.model).__name__} has no "
                               "compute_logits, lm_head or logits_processor; trimpass trims vLLM "
                               "causal-LM drafters with a LogitsProcessor")
        V, Vt = head.vocab, drafter.target_vocab
        self.vocab = None if drafter.d2t is None else DraftVocab(drafter.d2t, Vt)
        if self.vocab is None and V != Vt:
            raise ValueError(f"trimpass: vocab size: the drafter has {V} ids but the target has "
                             f"{Vt} and no d2t map; trimpass serves a drafter of the target's "
                             "vocabulary, or an EAGLE-3 drafter with its d2t map")
        settings = dict(settings)
        settings.pop("check", None)
        self.log_interval = float(settings.pop("log_interval", 60))
        self.report = Report(settings.pop("stats_dir", None), drafter.rank)
        self.beside = None  # () -> the counters of what drafts beside the trimmed head
        seqs = drafter.max_num_seqs
        rows = settings.get("max_rows")
        if rows is not None and rows < seqs:
            raise ValueError(f"trimpass: max_rows={rows} is below vLLM's max_num_seqs={seqs}: "
                             "every live request needs its own row; raise max_rows or drop it")
        if settings.get("vocab") is None:
            settings["max_rows"] = rows or seqs
        self.cfg = front.checked_config(settings, Vt)
        self.head, self.V, self._log = head, Vt, log
        device = head.weight.device if head.weight is not None else "cpu"
        if self.cfg.dynamic:
            self.state = ActiveState(self.cfg.settings)
            self.state.build(Vt, device)
        else:
            self.state = None
            self.static = self.cfg.settings.index(Vt, device)
        self.rows = RequestRows(self.state)
        self.batch: list | None = None  # request ids of the proposal under way
        self.calls = self.fallbacks = self.steps = 0
        self.rows_s = self.head_s = 0.0  # seconds following rows / in the trimmed head
        self.active_sum = self.row_calls = self.union_sum = 0
        self._last_log = time.monotonic()
        if log is not None:
            log.info("trimpass: the drafter's head (V=%d) is trimmed: %s mode, %d request rows "
                     "of %d bytes", Vt, "dynamic" if self.state else "static",
                     self.cfg.settings.max_rows if self.state else 0,
                     self.state.bytes_per_row() if self.state else 0)

    # ---- rows that follow the runner's batch ---------------------------------------------------
    def begin(self, batch, emitted: list[int]) -> None:
        """Before a proposal over ``batch`` (:class:`~trimpass.serving.vllm_compat.Batch`):
        bind new requests' rows and admit each request's new tokens. ``emitted``: each request's
        tokens emitted this step, not yet in the batch's tokens."""
        t0 = time.perf_counter()
        self.batch, self.steps = batch.req_ids, self.steps + 1
        if self.state is not None:
            self.rows.follow(batch.req_ids, batch.lengths, batch.tokens)
        self.rows_s += time.perf_counter() - t0
        if self._log is not None and self.log_interval and \
                time.monotonic() - self._last_log > self.log_interval:
            self._last_log = time.monotonic()
            self._log.info("trimpass: %d trimmed head calls (%d plain), %.0f active ids per row "
                           "of V=%d, %.0f computed per call, %d live request rows", self.calls,
                           self.fallbacks, self.active_sum / max(self.row_calls, 1), self.V,
                           self.union_sum / max(self.calls, 1), self.rows.live)

    def end(self) -> None:
        self.batch = None

    def settle(self, keep) -> None:
        """The runner's batch now holds ``keep`` (scheduled this step, not resuming): release
        every other request's row (finished, aborted, preempted, not scheduled, or resuming:
        rebuilt from its own tokens at its next proposal); then write the stats file."""
        self.rows.keep_only(keep)
        self.report.write(self)

    def active(self, B: int):
        return self.static if self.state is None else self.state.active(B)

    # ---- the drafter's logits ------------------------------------------------------------------
    def logits(self, h, with_top: bool = False):
        """The drafter's logits for hidden states ``h`` [B, d], and each row's softmax maximum
        where ``with_top`` and the head is not sharded (else None)."""
        t0 = time.perf_counter()
        try:
            return self._logits(h, with_top)
        finally:
            self.head_s += time.perf_counter() - t0

    def _logits(self, h, with_top: bool):
        hd = self.head
        if (hd.unusable or self.batch is None or h.dim() != 2 or h.shape[0] != len(self.batch)
                or hd.weight.dtype != h.dtype or hd.head_dtype not in (None, h.dtype)):
            self.fallbacks += 1
            return hd.plain(h), None
        B = h.shape[0]
        idx, count = self.active(B)
        top = with_top and hd.tp_size == 1  # a shard's maximum is not the row's
        rows = idx if self.vocab is None else self.vocab.to_draft(idx)
        got = trimmed_logits(h, hd.weight, rows, count, hd.start, softcap=hd.softcap,
                             scale=hd.scale, with_top=top)
        local, U = got[:2]
        logits = hd.gather(local) if hd.gather is not None else local
        if logits is not None:
            logits = logits[..., :hd.vocab]
            if self.vocab is not None:
                logits = self.vocab.to_target(logits)
        self.calls += 1
        cnt = count.reshape(-1)
        self.active_sum += int(cnt.sum()) * (B if cnt.numel() == 1 else 1)
        self.row_calls += B
        self.union_sum += U
        self.checked_call(h, logits, idx, count)
        return logits, got[2] if top else None

    def checked_call(self, h, logits, idx, count) -> None:
        """Nothing here; the check mode compares the call with the plain head."""

    def stats(self) -> dict:
        return {"calls": self.calls, "fallbacks": self.fallbacks, "steps": self.steps,
                "rows": self.rows.live, "active_sum": self.active_sum,
                "row_calls": self.row_calls, "union_sum": self.union_sum,
                "bytes_per_row": self.state.bytes_per_row() if self.state else 0,
                "rows_s": self.rows_s, "head_s": self.head_s, **memory(self),
                **(self.beside() if self.beside is not None else {})}
