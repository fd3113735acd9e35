"""Comparing trained drafters the way speculative decoding rewards them: E[L] from the formulas on
held-out text (greedy and sampling, :func:`expected_lengths`), real acceptance in Hugging Face
assisted generation prompt by prompt (:func:`per_prompt`), and paired bootstrap confidence
intervals over prompts (:func:`paired_bootstrap`): every drafter runs on the same prompts, so the
difference of two drafters is resampled prompt by prompt, not each mean on its own.
"""
from __future__ import annotations

import torch

from trimpass.train import losses
from trimpass.train.trainer import draft_logits

__all__ = ["paired_bootstrap", "expected_lengths", "per_prompt"]


def paired_bootstrap(a, b, resamples: int = 4000, seed: int = 0, level: float = 0.95):
    """Mean of ``b - a`` over paired samples and its percentile bootstrap interval (what
    ``scipy.stats.bootstrap(..., paired=True, method="percentile")`` computes; scipy is not a
    dependency of trimpass, and these ten lines on torch are the whole of it)."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    if a.shape != b.shape or a.dim() != 1 or len(a) < 2:
        raise ValueError("a and b must be 1-D, paired (same length) and hold >= 2 samples")
    d = b - a
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(d), (resamples, len(d)), generator=g)
    means = d[idx].mean(1)
    tail = (1 - level) / 2
    lo, hi = torch.quantile(means, torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
    return float(d.mean()), lo, hi


@torch.no_grad()
def expected_lengths(drafter, cache, gamma: int = 4, temperature: float = 1.0,
                     rows: int | None = None) -> dict:
    """Mean E[L] over every window of the cache's sequences (full-vocabulary drafter logits):
    ``greedy`` against the target's greedy tokens, ``sampling`` at the cache's temperature (the
    target's cached top-k with its full logsumexp: mass outside the top-k counts as unmatched,
    so this is a lower bound)."""
    n = len(cache.ids) if rows is None else min(rows, len(cache.ids))
    g, s = [], []
    for i in range(n):
        ids = cache.ids[i:i + 1]
        d = draft_logits(drafter, ids, None).float()
        g.append(losses.expected_length(losses.greedy_acceptance(d, cache.greedy[i:i + 1]),
                                        gamma).mean())
        tgt = torch.full_like(d, -torch.inf).scatter_(-1, cache.topk_ids[i:i + 1].long(),
                                                     cache.topk_logits[i:i + 1])
        a = losses.sampling_acceptance(d, tgt, temperature, target_lse=cache.lse[i:i + 1])
        s.append(losses.expected_length(a, gamma).mean())
    return {"greedy": float(torch.stack(g).mean()), "sampling": float(torch.stack(s).mean())}


def per_prompt(target, draft, prompts, max_new: int, name: str, temperature: float = 0.0,
               references=None):
    """Run assisted generation prompt by prompt: ``[(MAT, acceptance, lossless), ...]`` and the
    summed stats (draft ms per call, tokens/s)."""
    from trimpass.hf import assisted
    from trimpass.loops.stats import LoopStats
    out, total = [], LoopStats(name)
    for k, p in enumerate(prompts):
        ref = None if references is None else [references[k]]
        st, _ = assisted.run(target, draft, [p], max_new, name, ref, temperature=temperature,
                             seed=1000 * k)
        out.append((st.mat, st.acceptance, st.lossless))
        total.merge(st)
    return out, total
