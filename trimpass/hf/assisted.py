"""Measure Hugging Face assisted generation with a drafter, without editing the loop.

The drafter's calls are timed by :func:`trimpass.measure.time_calls` (a wrapper where
``nn.Module.__call__`` dispatches, so an in-place compiled drafter runs its compiled forward), and
the target's verification passes are counted with a forward hook; ``generate`` itself is called
exactly as a user would. From these: draft ms per call, mean tokens emitted per verification
(MAT), acceptance rate, tokens/s, and whether the output equals the target's own greedy output
(lossless). :func:`warm_up` compiles the drafter outside the timing.
"""
from __future__ import annotations

import contextlib
import time

import torch

from trimpass.loops.stats import LoopStats
from trimpass.measure import Stopwatch, compiled_graphs, time_calls
from trimpass.progress import progress


def compile_drafter(draft, backend) -> None:
    """Compile ``draft`` in place (as ``trimpass.trim`` does) with any backend."""
    draft.compile(backend=backend)


@torch.no_grad()
def run(target, draft, prompts, max_new: int, name: str, references=None,
        on_draft_call=None, temperature: float = 0.0, seed: int = 0) -> tuple[LoopStats, list]:
    """Greedy ``target.generate`` over ``prompts`` (lists of ids), assisted by ``draft`` if given;
    with ``temperature`` > 0, HF's sampling path (speculative sampling when assisted), seeded by
    ``seed`` + the prompt's index. Called as a user calls it: a reply may end at an end-of-turn
    token before ``max_new`` (HF's ``min_new_tokens`` would cost each call a pass over the whole
    vocabulary, more often assisted than alone, so it is not passed).

    Each drafter call drafts one token, and each verification emits the target's own token after
    the accepted ones, so ``drafted`` is the number of drafter calls and ``accepted`` the tokens
    emitted beyond one per verification. ``on_draft_call()`` runs after each drafter call.
    """
    st = LoopStats(name)

    def verified(*_):
        st.rounds += 1

    hook = target.register_forward_hook(verified)
    device = next(target.parameters()).device
    timing = (time_calls(draft, Stopwatch(device, st.draft_ms_each), on_draft_call)
              if draft is not None else contextlib.nullcontext())
    outs = []
    try:
        with timing:
            for k, p in enumerate(progress(prompts, desc=name)):
                ids = torch.tensor([p], device=device)
                kw = dict(assistant_model=draft) if draft is not None else {}
                if temperature > 0:
                    torch.manual_seed(seed + k)
                    kw.update(temperature=temperature, top_k=None, top_p=None)
                t0 = time.perf_counter()
                out = target.generate(ids, do_sample=temperature > 0, max_new_tokens=max_new, **kw)
                st.seconds += time.perf_counter() - t0
                st.emitted += out.shape[1] - ids.shape[1]
                outs.append(out)
                if references is not None and not torch.equal(out, references[k]):
                    st.lossless = False
    finally:
        hook.remove()
    st.drafted = st.draft_calls
    st.accepted = st.emitted - st.rounds
    return st, outs


def warm_up(model, draft, prompts, tries: int = 4) -> None:
    """Compile outside the timing: generate a few tokens from every prompt until a pass compiles
    no new graph (Dynamo recompiles as lengths turn dynamic and as the state of HF's cache
    differs between calls), at most ``tries`` passes."""
    for _ in range(tries):
        before = compiled_graphs()
        run(model, draft, prompts, 8, "warm-up")
        if compiled_graphs() == before:
            return
