"""A reference speculative loop, gpt-fast style: chain drafting of ``gamma`` tokens, then one
target pass that verifies them — greedily, or by rejection sampling that keeps the target's
distribution exactly (Leviathan et al., Chen et al.). Batch 1, no KV cache (each call sees the
whole sequence), so it fits on one screen and works with any ``model(ids) -> logits`` callable:
a plain module, an HF model, a compiled or trimmed drafter. Nothing in it knows about trimming.
"""
from __future__ import annotations

import time

import torch

from trimpass.loops.stats import LoopStats
from trimpass.measure import Stopwatch
from trimpass.spec import verify


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    return (out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple) else out)


def exact_accept(p_target: torch.Tensor, q_draft: torch.Tensor, x: int, u: float) -> bool:
    """Speculative sampling's rule (:func:`trimpass.spec.verify.kept`) for drafted ``x``."""
    return bool(verify.kept(p_target[x], q_draft[x], u))


@torch.no_grad()
def generate(target, draft, ids: torch.Tensor, max_new: int, gamma: int = 4,
             temperature: float = 0.0, generator: torch.Generator | None = None,
             accept=exact_accept) -> tuple[torch.Tensor, LoopStats]:
    """Speculative decoding of ``max_new`` tokens after ``ids[1, S]``; greedy when temperature 0."""
    st = LoopStats("chain")
    draft_call, target_call = Stopwatch(ms=st.draft_ms_each), Stopwatch(ms=st.target_ms_each)
    greedy = temperature == 0.0
    t0 = time.perf_counter()

    def dist(logits):
        return torch.softmax(logits.double() / temperature, dim=-1)

    def pick(p):
        return int(torch.multinomial(p, 1, generator=generator))

    while st.emitted < max_new:
        n = min(gamma, max_new - st.emitted - 1) if max_new - st.emitted > 1 else 0
        seq, qs = ids, []
        for _ in range(n):  # draft
            lg = draft_call(logits_of, draft, seq)[0, -1]
            q = None if greedy else dist(lg)
            tok = int(lg.argmax()) if greedy else pick(q)
            qs.append(q)
            seq = torch.cat([seq, seq.new_tensor([[tok]])], dim=1)
        tl = target_call(logits_of, target, seq)[0, ids.shape[1] - 1:]  # [n + 1, V]
        drafts = seq[0, ids.shape[1]:].tolist()
        if greedy:  # the target's own logits: no second product to be row-invariant against
            out, n_acc, _ = verify.greedy_round(lambda z: z, tl, seq[0, ids.shape[1]:])
        else:
            n_acc = 0
            for i, x in enumerate(drafts):  # one uniform per drafted token, as the paper draws
                u = float(torch.rand(1, generator=generator, dtype=torch.float64))
                if not accept(dist(tl[i]), qs[i], x, u):
                    break
                n_acc += 1
            out = drafts[:n_acc] + [
                verify.residual_sample(dist(tl[n_acc]), qs[n_acc], generator)
                if n_acc < len(drafts) else pick(dist(tl[n_acc]))]
        st.rounds += 1
        st.drafted += len(drafts)
        st.accepted += n_acc
        st.emitted += len(out)
        st.per_round.append(len(out))
        ids = torch.cat([ids, ids.new_tensor([out])], dim=1)
    st.seconds = time.perf_counter() - t0
    return ids, st
