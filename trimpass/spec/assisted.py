"""Measure Hugging Face assisted generation with a drafter, without editing the loop.

The drafter's forward calls are timed by wrapping the callable that ``nn.Module.compile`` installs
(``_compiled_call_impl``), and the target's verification passes are counted with a forward hook;
``generate`` itself is called exactly as a user would. From these: draft ms per call, mean tokens
emitted per verification (MAT), acceptance rate, tokens/s, and whether the output equals the
target's own greedy output (lossless).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from trimpass.progress import progress


@dataclass
class RunStats:
    name: str
    new_tokens: int = 0
    seconds: float = 0.0
    draft_calls: int = 0
    draft_s: float = 0.0
    verifications: int = 0
    lossless: bool = True
    active: list = field(default_factory=list)
    draft_ms_each: list = field(default_factory=list)

    @property
    def draft_ms(self) -> float:  # median: robust to the first (compiling) calls
        return statistics.median(self.draft_ms_each) if self.draft_ms_each else float("nan")

    @property
    def mat(self) -> float:
        return self.new_tokens / max(self.verifications, 1)

    @property
    def acceptance(self) -> float:
        return (self.new_tokens - self.verifications) / max(self.draft_calls, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / max(self.seconds, 1e-9)


class _Timer:
    def __init__(self, fn, stats: RunStats, on_call=None):
        self.fn, self.stats, self.on_call = fn, stats, on_call

    def __call__(self, *args, **kwargs):
        sync()
        t0 = time.perf_counter()
        out = self.fn(*args, **kwargs)
        sync()  # CUDA launches are asynchronous: time the work, not the launch
        dt = time.perf_counter() - t0
        self.stats.draft_calls += 1
        self.stats.draft_s += dt
        self.stats.draft_ms_each.append(dt * 1e3)
        if self.on_call:
            self.on_call()
        return out


def sync() -> None:
    """Wait for queued CUDA work, if CUDA is in use (a no-op on CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def compile_drafter(draft, backend) -> None:
    """Compile ``draft`` in place (as ``trimpass.trim`` does) with any backend."""
    draft.compile(backend=backend)


@torch.no_grad()
def run(target, draft, prompts, max_new: int, name: str, references=None,
        on_draft_call=None) -> tuple[RunStats, list]:
    """Greedy ``target.generate`` over ``prompts`` (lists of ids), assisted by ``draft`` if given."""
    st = RunStats(name)
    hook = target.register_forward_hook(lambda *a: setattr(st, "verifications",
                                                           st.verifications + 1))
    wrapped = None
    if draft is not None:
        wrapped = draft._compiled_call_impl or draft._call_impl
        draft._compiled_call_impl = _Timer(wrapped, st, on_draft_call)
    outs = []
    device = next(target.parameters()).device
    try:
        for k, p in enumerate(progress(prompts, desc=name)):
            ids = torch.tensor([p], device=device)
            kw = dict(assistant_model=draft) if draft is not None else {}
            t0 = time.perf_counter()
            out = target.generate(ids, do_sample=False, max_new_tokens=max_new,
                                  min_new_tokens=max_new, **kw)
            st.seconds += time.perf_counter() - t0
            st.new_tokens += out.shape[1] - ids.shape[1]
            outs.append(out)
            if references is not None and not torch.equal(out, references[k]):
                st.lossless = False
    finally:
        hook.remove()
        if draft is not None:
            draft._compiled_call_impl = None if wrapped is draft._call_impl else wrapped
    return st, outs
