"""Losses that train a drafter for speculative-decoding acceptance length. Everything is computed
per position, then combined per window: ``greedy_acceptance`` and ``sampling_acceptance`` reduce the
drafter's logits over C candidate columns (the full vocabulary, or the active ids the caller
gathered, so the head is computed over those only) to one acceptance probability per position,
[B, S], and ``expected_length`` turns them into the expected accepted length of every gamma-token
window, E[L]_i = sum_{k=1..gamma} prod_{j=i..i+k-1} a_j, by an unrolled loop over gamma: no
[B, S, gamma, V] tensor is built. Positions are teacher-forced (position j's distributions are
those on the training text): exact for greedy verification of the target's own greedy text, an
approximation for sampling. With a column subset the target is never renormalized over it
(``target_lse`` is the logsumexp of its FULL logits / T): its mass outside the columns is mass the
drafter cannot match. ``kl_loss`` is the distillation baseline; ``eal_loss`` and ``wtv_loss`` are
-mean E[L] under greedy and sampling verification; ``group_advantages``, ``grpo_objective``,
``simulate_greedy`` and ``simulate_sampling`` are the pieces of a GRPO stage rewarded by the
accepted length of sampled draft windows. Math runs in fp32 whatever the input dtype (bf16 is
fine), -inf logits (inactive columns, even whole rows) give no NaN values or gradients, and bad
input raises ``ValueError`` naming the argument before any compute.
"""
from __future__ import annotations

import math

import torch

from trimpass.spec import verify

__all__ = ["greedy_acceptance", "sampling_acceptance", "expected_length", "kl_loss", "eal_loss",
           "wtv_loss", "group_advantages", "grpo_objective", "simulate_greedy",
           "simulate_sampling"]

_EPS = 1e-6
_NEG_INF = float("-inf")


# ---------------------------------------------------------------- input checks (no compute)
def _tensor(name, x, ndim, kind, what):
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor {what}, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {what} ({ndim} dims), got shape {tuple(x.shape)}")
    ok = {"float": x.is_floating_point(), "int": not x.is_floating_point() and not x.is_complex()
          and x.dtype != torch.bool, "bool": x.dtype == torch.bool,
          "real": not x.is_complex()}[kind]
    if not ok:
        raise ValueError(f"{name} must be a {kind} tensor {what}, got dtype {x.dtype}")


def _logits(name, x):
    _tensor(name, x, 3, "float", "of logits [B, S, C]")
    if x.shape[-1] == 0:
        raise ValueError(f"{name} has an empty column set (C=0): pass at least one candidate "
                         "column (the full vocabulary or the active ids)")


def _pair(draft_logits, target_logits):
    _logits("draft_logits", draft_logits)
    _logits("target_logits", target_logits)
    if draft_logits.shape[-1] != target_logits.shape[-1]:
        raise ValueError(f"drafter and target column counts differ: draft_logits has C="
                         f"{draft_logits.shape[-1]}, target_logits has C={target_logits.shape[-1]};"
                         " gather the same columns (ids) from both")
    if draft_logits.shape != target_logits.shape:
        raise ValueError(f"draft_logits {tuple(draft_logits.shape)} and target_logits "
                         f"{tuple(target_logits.shape)} must have the same [B, S, C] shape")


def _same(name, x, shape, what):
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must be {what} of shape {tuple(shape)}, got {tuple(x.shape)}")


def _mask(mask, shape):
    if mask is None:
        return
    _tensor("mask", mask, len(shape), "bool", "(True = valid)")
    _same("mask", mask, shape, "a bool tensor (True = valid)")


def _gamma(gamma, S):
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
        raise ValueError(f"gamma must be an int >= 1 (tokens drafted per window), got {gamma!r}")
    if gamma > S:
        raise ValueError(f"gamma={gamma} is larger than the sequence length S={S}: no window fits;"
                         " use a smaller gamma or longer sequences")


def _temperature(temperature):
    try:
        t = float(temperature)
    except (TypeError, ValueError):
        raise ValueError(f"temperature must be a number > 0, got {temperature!r}") from None
    if not math.isfinite(t) or t <= 0:
        raise ValueError(f"temperature must be finite and > 0, got {temperature!r}; "
                         "use greedy_acceptance / eal_loss for greedy (T -> 0) verification")
    return t


def _index(target_index, draft_logits):
    _tensor("target_index", target_index, 2, "int", "of target columns [B, S]")
    _same("target_index", target_index, draft_logits.shape[:2], "an index tensor [B, S]")
    C = draft_logits.shape[-1]
    if target_index.numel() and (int(target_index.min()) < -1 or int(target_index.max()) >= C):
        raise ValueError(f"target_index must be in [-1, C={C}) (-1 where the target's greedy token "
                         f"is not among the columns), got values in [{int(target_index.min())}, "
                         f"{int(target_index.max())}]")


def _lse(target_lse, target_logits):
    if target_lse is None:
        return
    _tensor("target_lse", target_lse, 2, "float", "[B, S]")
    _same("target_lse", target_lse, target_logits.shape[:2], "the logsumexp of the full logits / T")
    if torch.isnan(target_lse).any() or torch.isposinf(target_lse).any():
        raise ValueError("target_lse has NaN or +inf entries")


# ---------------------------------------------------------------- log-probabilities, NaN-safe
def _log_softmax(x):
    """log_softmax in fp32; a row that is entirely -inf gives -inf (probability 0) and zero grad."""
    x = x.float()
    dead = torch.isneginf(x).all(-1, keepdim=True)
    return torch.log_softmax(x.masked_fill(dead, 0.0), -1).masked_fill(dead, _NEG_INF)


def _target_logp(target_logits, t, target_lse):
    """log p over the columns: softmax(target / T), or target / T - target_lse (not renormalized)"""
    z = target_logits.float() / t
    if target_lse is None:
        return _log_softmax(z)
    lse = target_lse.float()
    with torch.no_grad():
        cols = torch.logsumexp(z, -1)
        tol = 1e-3 + 4 * torch.finfo(target_lse.dtype).eps * lse.abs()
        if (cols > lse + tol).any():
            raise ValueError("target_lse is smaller than the logsumexp of target_logits / "
                             "temperature over the columns (the columns would hold more than "
                             "all the mass): pass logsumexp(full target logits / T, -1)")
    dead = torch.isneginf(lse).unsqueeze(-1)
    return (z - lse.masked_fill(torch.isneginf(lse), 0.0).unsqueeze(-1)).masked_fill(dead, _NEG_INF)


def _masked_mean(x, mask):
    if mask is None:
        return x.sum() / max(x.numel(), 1)
    return torch.where(mask, x, 0.0).sum() / mask.sum().clamp_min(1)


# ---------------------------------------------------------------- per-position acceptance
def greedy_acceptance(draft_logits, target_index):
    """q_j(y*_j) [B, S] (fp32): the drafter's probability of the target's greedy token.

    ``draft_logits`` [B, S, C] over C candidate columns, ``target_index`` [B, S] the column of the
    target's greedy token y*_j, -1 where y*_j is not among the columns (acceptance 0: the drafter
    can only propose its columns). It is the probability that a drafter sampling from q is accepted
    by greedy verification (a smooth surrogate for a greedy drafter). Computed as the exp of the
    gathered log_softmax; -inf columns and all -inf rows (acceptance 0) give finite gradients.
    """
    _logits("draft_logits", draft_logits)
    _index(target_index, draft_logits)
    logq = _log_softmax(draft_logits)
    a = logq.gather(-1, target_index.clamp_min(0).unsqueeze(-1)).squeeze(-1).exp()
    return torch.where(target_index >= 0, a, 0.0)


def sampling_acceptance(draft_logits, target_logits, temperature=1.0, target_lse=None):
    """alpha_j = sum_v min(p_j(v), q_j(v)) [B, S] (fp32), the acceptance probability of speculative
    sampling (1 - alpha is the total-variation distance between p and q).

    Both logits are [B, S, C] over the same columns. q = softmax(draft / T) over the columns (the
    drafter can only propose those). p = softmax(target / T), or, when the columns are a subset of
    the vocabulary, exp(target / T - target_lse) with ``target_lse`` [B, S] the logsumexp of the
    target's FULL logits / T: its mass outside the columns is never matched (not renormalized).
    A ``target_lse`` smaller than the columns' own logsumexp raises ValueError.
    """
    _pair(draft_logits, target_logits)
    t = _temperature(temperature)
    _lse(target_lse, target_logits)
    logq = _log_softmax(draft_logits.float() / t)
    logp = _target_logp(target_logits, t, target_lse)
    return torch.minimum(logp, logq).exp().sum(-1)


# ---------------------------------------------------------------- per-window expected length
def expected_length(acceptance, gamma, mask=None):
    """E[L] [B, S - gamma + 1]: the expected number of accepted drafted tokens of the gamma-token
    window starting at each position, E[L]_i = sum_{k=1..gamma} prod_{j=i..i+k-1} a_j.

    ``acceptance`` [B, S] per-position acceptance probabilities, assumed independent given the
    (teacher-forced) prefix; ``mask`` [B, S] bool, True = valid: a masked position has acceptance
    0, so a window ends at its first masked position (a window starting on one has E[L] = 0). The
    count excludes the target's own extra token: tokens per verification = 1 + E[L]. An unrolled
    loop of gamma running products (gamma is small): differentiable, O(gamma * B * S) memory.
    """
    _tensor("acceptance", acceptance, 2, "float", "of acceptance probabilities [B, S]")
    _gamma(gamma, acceptance.shape[1])
    _mask(mask, acceptance.shape)
    a = acceptance.float()
    if mask is not None:
        a = torch.where(mask, a, 0.0)
    W = a.shape[1] - gamma + 1
    run = torch.ones_like(a[:, :W])
    total = torch.zeros_like(run)
    for k in range(gamma):
        run = run * a[:, k:k + W]
        total = total + run
    return total


def _window_mean(length, mask):
    """Mean of E[L] over windows that start on a valid position."""
    return _masked_mean(length, None if mask is None else mask[:, :length.shape[1]])


# ---------------------------------------------------------------- losses
def kl_loss(draft_logits, target_logits, temperature=1.0, target_lse=None, mask=None):
    """KL(p || q) at temperature T, the distillation baseline: mean over valid positions (no T^2).

    Same column semantics as :func:`sampling_acceptance`. The sum runs over the columns where the
    drafter is finite: the target's mass outside the columns (subset) or on the drafter's -inf
    columns (inactive ids) would make the KL infinite, yet it is a term the drafter's logits cannot
    change, so it is dropped; p is not renormalized, so a position weighs by the mass it covers.
    """
    _pair(draft_logits, target_logits)
    t = _temperature(temperature)
    _lse(target_lse, target_logits)
    _mask(mask, draft_logits.shape[:2])
    logq = _log_softmax(draft_logits.float() / t)
    logp = _target_logp(target_logits, t, target_lse)
    ok = torch.isfinite(logp) & torch.isfinite(logq)
    lp, lq = logp.masked_fill(~ok, 0.0), logq.masked_fill(~ok, 0.0)
    kl = torch.where(ok, lp.exp() * (lp - lq), 0.0).sum(-1)
    return _masked_mean(kl, mask)


def eal_loss(draft_logits, target_index, gamma, mask=None):
    """-mean E[L] under greedy verification (acceptance :func:`greedy_acceptance`), the mean over
    the full windows that start on a valid position (the last gamma - 1 positions start none; they
    count inside earlier windows). Not divided by gamma: the value is minus the
    expected accepted length itself (so 1 - loss is the expected tokens per verification); the
    gradient grows with gamma, so retune the learning rate when gamma changes."""
    _logits("draft_logits", draft_logits)
    _index(target_index, draft_logits)
    _gamma(gamma, draft_logits.shape[1])
    _mask(mask, draft_logits.shape[:2])
    return -_window_mean(expected_length(greedy_acceptance(draft_logits, target_index), gamma,
                                         mask), mask)


def wtv_loss(draft_logits, target_logits, gamma, temperature=1.0, target_lse=None, mask=None):
    """-mean E[L] under speculative sampling (acceptance 1 - TV(p, q) per position, a window-level
    total-variation loss), same windows and normalization (none) as :func:`eal_loss`, same column
    semantics as :func:`sampling_acceptance`."""
    _pair(draft_logits, target_logits)
    _temperature(temperature)
    _lse(target_lse, target_logits)
    _gamma(gamma, draft_logits.shape[1])
    _mask(mask, draft_logits.shape[:2])
    a = sampling_acceptance(draft_logits, target_logits, temperature, target_lse)
    return -_window_mean(expected_length(a, gamma, mask), mask)


# ---------------------------------------------------------------- GRPO
def group_advantages(rewards):
    """(r - mean) / (std + 1e-6) within each group of G samples, [N, G] -> [N, G] fp32.

    The std is the population std (correction 0), defined for any G. A group whose rewards are
    all equal carries no signal and gets exactly 0 (not rounding noise over eps).
    """
    _tensor("rewards", rewards, 2, "real", "of rewards [N, G]")
    if rewards.shape[1] < 1:
        raise ValueError("rewards must have at least one sample per group (G >= 1)")
    r = rewards.detach().float()
    adv = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True, correction=0) + _EPS)
    equal = (r.amax(1, keepdim=True) == r.amin(1, keepdim=True))
    return torch.where(equal, 0.0, adv)


def grpo_objective(logp_new, logp_old, logp_ref, advantages, mask=None, clip=0.2, kl_coef=0.05):
    """The GRPO loss to minimize (scalar): -(clipped surrogate - kl_coef * KL).

    ``logp_*`` [N, G, L]: per-token log-probabilities of the sampled draft windows under the current
    policy (differentiable), the behaviour policy that sampled them and the frozen reference (the
    drafter before this stage; both detached here). ``advantages`` [N, G] (see
    :func:`group_advantages`), ``mask`` [N, G, L] bool, True = token counts (e.g. mask the tokens
    after a window's first rejection, which do not change its reward). Per token: ratio =
    exp(new - old), surrogate min(ratio * A, clamp(ratio, 1 - clip, 1 + clip) * A), KL by the k3
    estimator exp(ref - new) - (ref - new) - 1. Averaged over each window's valid tokens, then over
    the windows that have any (GRPO's 1/G sum_i 1/|o_i| sum_t).
    """
    _tensor("logp_new", logp_new, 3, "float", "of log-probs [N, G, L]")
    for name, x in (("logp_old", logp_old), ("logp_ref", logp_ref)):
        _tensor(name, x, 3, "float", "of log-probs [N, G, L]")
        _same(name, x, logp_new.shape, "log-probs like logp_new")
    _tensor("advantages", advantages, 2, "real", "[N, G]")
    _same("advantages", advantages, logp_new.shape[:2], "one advantage per window [N, G]")
    _mask(mask, logp_new.shape)
    if not (isinstance(clip, (int, float)) and clip > 0):
        raise ValueError(f"clip must be a number > 0 (the PPO ratio clip), got {clip!r}")
    if not (isinstance(kl_coef, (int, float)) and kl_coef >= 0):
        raise ValueError(f"kl_coef must be a number >= 0, got {kl_coef!r}")
    new, old, ref = logp_new.float(), logp_old.detach().float(), logp_ref.detach().float()
    if mask is not None:  # masked tokens may hold -inf: zero them before any arithmetic
        new, old, ref = (x.masked_fill(~mask, 0.0) for x in (new, old, ref))
    A = advantages.detach().float().unsqueeze(-1)
    ratio = torch.exp(new - old)
    surrogate = torch.minimum(ratio * A, ratio.clamp(1 - clip, 1 + clip) * A)
    d = ref - new
    per_token = -(surrogate - kl_coef * (torch.exp(d) - d - 1))
    if mask is None:
        return per_token.mean()
    count = mask.sum(-1)
    per_window = torch.where(mask, per_token, 0.0).sum(-1) / count.clamp_min(1)
    return _masked_mean(per_window, count > 0)


@torch.no_grad()
def simulate_greedy(draft_ids, target_ids):
    """Accepted length [N, G] (int64) of each draft window under greedy verification.

    ``draft_ids`` [N, G, L]: G sampled windows per prompt; ``target_ids`` [N, L]: the target's
    greedy tokens at the same positions. A window is accepted while draft == target; the first
    mismatch ends it (exact: an accepted prefix equals the target's own greedy text).
    """
    _tensor("draft_ids", draft_ids, 3, "int", "[N, G, L]")
    _tensor("target_ids", target_ids, 2, "int", "[N, L]")
    N, _, L = draft_ids.shape
    _same("target_ids", target_ids, (N, L), "the target's greedy tokens [N, L]")
    return verify.accepted(draft_ids == target_ids.unsqueeze(1))


@torch.no_grad()
def simulate_sampling(draft_ids, draft_probs, target_probs, generator=None):
    """Accepted length [N, G] (int64) of each draft window under speculative sampling's exact rule:
    draft token x is accepted with probability min(1, p(x) / q(x)); the first rejection ends it.

    ``draft_ids`` [N, G, L] columns in [0, C); ``draft_probs`` [N, G, L, C] the drafter's q at each
    drafted token's prefix; ``target_probs`` the target's p over the same columns (its FULL-vocab
    probabilities, not renormalized over a subset), either [N, G, L, C], scored on each window's own
    prefix, or [N, L, C], scored once on the teacher-forced text and shared by the group.
    What it approximates: with [N, G, L, C] the count has exactly the distribution of the real
    loop's accepted length. With [N, L, C] it is approximate: an accepted token x may differ from
    the text, and the target's later distributions should then be conditioned on x, not on the
    text. In both cases it counts the accepted prefix only: after a rejection the real loop samples
    a corrected token from norm(max(p - q, 0)) and continues from there, a continuation that
    differs from the teacher-forced text and is not simulated.
    """
    _tensor("draft_ids", draft_ids, 3, "int", "[N, G, L]")
    _tensor("draft_probs", draft_probs, 4, "float", "[N, G, L, C]")
    N, G, L, C = draft_probs.shape
    _same("draft_ids", draft_ids, (N, G, L), "drafted columns matching draft_probs [N, G, L]")
    if C == 0:
        raise ValueError("draft_probs has an empty column set (C=0)")
    if not isinstance(target_probs, torch.Tensor) or target_probs.dim() not in (3, 4):
        raise ValueError("target_probs must be a tensor [N, G, L, C] or [N, L, C]")
    _tensor("target_probs", target_probs, target_probs.dim(), "float", "[N, G, L, C] or [N, L, C]")
    if target_probs.dim() == 3:
        _same("target_probs", target_probs, (N, L, C), "teacher-forced target probabilities")
        target_probs = target_probs.unsqueeze(1).expand(N, G, L, C)
    _same("target_probs", target_probs, (N, G, L, C), "target probabilities over the columns")
    if draft_ids.numel() and (int(draft_ids.min()) < 0 or int(draft_ids.max()) >= C):
        raise ValueError(f"draft_ids must be columns in [0, C={C})")
    idx = draft_ids.unsqueeze(-1)
    q = draft_probs.gather(-1, idx).squeeze(-1).float()
    p = target_probs.gather(-1, idx).squeeze(-1).float()
    u = torch.rand(q.shape, generator=generator, device=q.device)
    return verify.accepted(verify.kept(p, q, u))
