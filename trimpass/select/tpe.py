"""Choosing the kept vocabulary: frequency top-K, and a TPE search for the best trade of coverage
against latency.

Utility ``α·coverage(K) + (1−α)·reduction(K)`` subject to ``coverage(K) ≥ c_min``; coverage is the
held-out share of next tokens inside the kept set (averaged over corpora when several are given),
``reduction`` comes from a cost model (:mod:`trimpass.select.costmodel`). Optuna's TPE sampler
searches K on a log scale, and the corpora's mixing weights when several are given; infeasible
trials are handled by its constraint function. :func:`sweep` scores a K grid exhaustively, the
yardstick the search is tested against and the source of the Pareto frontier.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from trimpass.select.counts import coverage_curve, ranking


@dataclass
class Selection:
    K: int
    ids: np.ndarray
    coverage: dict  # corpus -> held-out coverage
    reduction: float
    utility: float
    weights: dict = field(default_factory=dict)
    frontier: list = field(default_factory=list)  # (K, coverage, reduction), Pareto-optimal
    trials: int = 0


def check_args(alpha: float, c_min: float) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha: must be in [0, 1], got {alpha}")
    if not 0.0 < c_min <= 1.0:
        raise ValueError(f"min coverage: must be in (0, 1], got {c_min}")


def _mixed_rank(counts, weights, keep):
    mix = sum(w * c.train / max(c.train.sum(), 1) for w, c in zip(weights, counts, strict=True))
    return ranking(mix, keep)


def _coverages(rank, counts, K):
    return {c.corpus: float(coverage_curve(rank[:K], c.held)[-1]) for c in counts}


def grid(k_max: int) -> np.ndarray:
    return np.unique(np.geomspace(min(16, k_max), k_max, 96).astype(np.int64).clip(1, k_max))


def sweep(counts, cost, alpha: float, c_min: float, k_max: int, keep=()):
    """Exhaustive scoring of the K grid (equal corpus weights): (best K, utility, frontier)."""
    rank = _mixed_rank(counts, [1.0] * len(counts), keep)
    curves = [coverage_curve(rank[:k_max], c.held) for c in counts]
    ks = grid(k_max)
    cov = np.mean([cv[ks - 1] for cv in curves], axis=0)
    red = cost.reduction(ks)
    util = alpha * cov + (1 - alpha) * red
    feasible = cov >= c_min
    if not feasible.any():
        raise ValueError(f"min coverage: {c_min} is not reached by any K <= {k_max} (best "
                         f"{cov.max():.4f}); lower --min-coverage or raise --max-k")
    best = int(np.argmax(np.where(feasible, util, -np.inf)))
    frontier = [(int(k), float(c), float(r)) for k, c, r in zip(ks, cov, red, strict=True)]
    return int(ks[best]), float(util[best]), frontier


def select(counts, cost, alpha: float = 0.5, c_min: float = 0.9, trials: int = 100,
           k_max: int | None = None, keep=(), seed: int = 0) -> Selection:
    """TPE search for the kept vocabulary; raises ValueError if ``c_min`` is out of reach."""
    import optuna
    check_args(alpha, c_min)
    V = counts[0].vocab_size
    k_max = min(k_max or V, V)
    best_k, _, frontier = sweep(counts, cost, alpha, c_min, k_max, keep)  # also checks c_min
    multi = len(counts) > 1

    def objective(trial):
        K = trial.suggest_int("K", min(16, k_max), k_max, log=True)
        w = [trial.suggest_float(f"w{i}", 0.05, 1.0) for i in range(len(counts))] if multi \
            else [1.0]
        rank = _mixed_rank(counts, w, keep)
        cov = float(np.mean(list(_coverages(rank, counts, K).values())))
        trial.set_user_attr("coverage", cov)
        trial.set_constraint("coverage", c_min - cov)
        return alpha * cov + (1 - alpha) * float(cost.reduction(K))

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=min(20, trials))
    study = optuna.create_study(direction="maximize", sampler=sampler)
    study.optimize(objective, n_trials=trials)
    ok = [t for t in study.trials if t.user_attrs.get("coverage", 0.0) >= c_min]
    if not ok:
        raise ValueError(f"min coverage: no trial reached {c_min} in {trials} trials; "
                         "raise --trials or lower --min-coverage")
    t = max(ok, key=lambda t: t.value)
    w = [t.params.get(f"w{i}", 1.0) for i in range(len(counts))]
    K = t.params["K"]
    rank = _mixed_rank(counts, w, keep)
    return Selection(K, np.sort(rank[:K]), _coverages(rank, counts, K),
                     float(cost.reduction(K)), float(t.value),
                     {c.corpus: wi for c, wi in zip(counts, w, strict=True)}, frontier,
                     len(study.trials))
