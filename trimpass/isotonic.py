"""Isotonic (monotone non-decreasing) least-squares fits, shared by the cost models.

:func:`pav` fits a line (weighted pool adjacent violators); :func:`isotonic_grid` fits a 2-D grid
non-decreasing along both axes (Brunk's minimum lower sets, each found by Dinkelbach's iteration
over a dynamic program on staircases). Both are monotone by construction, never clamped; select's
measured head cost and D-Cut's verification cost table use them. Not scipy's
``scipy.optimize.isotonic_regression``: it fits a line only, so the grid fit is needed anyway, and
scipy is not otherwise a dependency of trimpass or of vLLM's CPU build, in whose workers the
calibration runs (a ~40 MB install for the 20 lines of ``pav``).
"""
from __future__ import annotations

import numpy as np


def _weights(y: np.ndarray, w) -> np.ndarray:
    if not np.isfinite(y).all():
        raise ValueError("isotonic: values must be finite")
    w = np.ones_like(y) if w is None else np.asarray(w, dtype=np.float64)
    if w.shape != y.shape:
        raise ValueError(f"isotonic: weights shape {w.shape} != values shape {y.shape}")
    if not (np.isfinite(w).all() and (w > 0).all()):
        raise ValueError("isotonic: weights must be positive and finite")
    return w


def pav(y, w=None) -> np.ndarray:
    """Weighted least-squares non-decreasing fit of the 1-D ``y`` (pool adjacent violators).

    Blocks are kept as (sum w*y, sum w); a new value pools with the blocks before it while their
    mean is >= its own, so block means strictly increase and the fit is exactly non-decreasing.
    """
    y = np.asarray(y, dtype=np.float64)
    if y.ndim != 1:
        raise ValueError(f"pav: expected 1-D values, got shape {y.shape}")
    w = _weights(y, w)
    blocks: list[list[float]] = []  # [sum_wy, sum_w, count]
    for yi, wi in zip(y.tolist(), w.tolist(), strict=True):
        swy, sw, n = yi * wi, wi, 1
        while blocks and blocks[-1][0] / blocks[-1][1] >= swy / sw:
            pwy, pw, pn = blocks.pop()
            swy, sw, n = swy + pwy, sw + pw, n + pn
        blocks.append([swy, sw, n])
    return np.repeat([b[0] / b[1] for b in blocks], [b[2] for b in blocks]).astype(np.float64)


def _min_lower_set(G: np.ndarray, H: np.ndarray) -> tuple[float, np.ndarray]:
    """Minimum of sum g over lower sets of the cells not yet assigned, and its staircase.

    ``G`` [nb, nk+1]: per-row prefix sums of g; ``H``: row b's cells t < H[b] are assigned (H
    non-increasing). A lower set is {(b, t): H[b] <= t < h[b]} with h non-increasing, h >= H.
    """
    nb, n1 = G.shape
    cols = np.arange(n1)
    rows = []
    for b in range(nb):
        rc = G[b] - G[b, H[b]]
        rc[cols < H[b]] = np.inf
        rows.append(rc)
    D = [None] * nb
    D[-1] = rows[-1]
    for b in range(nb - 2, -1, -1):
        D[b] = rows[b] + np.minimum.accumulate(D[b + 1])
    h = np.empty(nb, dtype=np.int64)
    h[0] = int(np.argmin(D[0]))
    for b in range(1, nb):
        h[b] = int(np.argmin(D[b][: h[b - 1] + 1]))
    return float(D[0][h[0]]), h


def isotonic_grid(y, w=None) -> np.ndarray:
    """Weighted least-squares fit of the 2-D ``y`` non-decreasing along both axes.

    Minimum lower sets (Brunk): the lower set of the unassigned cells with the smallest weighted
    mean takes that mean, then the rest is fitted the same way. The smallest-mean lower set is found
    by Dinkelbach's iteration, each step a dynamic program over staircases. A block whose mean is
    not above the previous block's (rounding) is pooled into it, so block means strictly increase
    and the fit is exactly monotone. With one row or column it equals :func:`pav`.
    """
    y = np.asarray(y, dtype=np.float64)
    if y.ndim != 2 or 0 in y.shape:
        raise ValueError(f"isotonic_grid: expected a non-empty 2-D grid, got shape {y.shape}")
    w = _weights(y, w)
    nb, nk = y.shape
    z = np.zeros((nb, 1))
    cw = np.concatenate([z, np.cumsum(w, axis=1)], axis=1)
    cwy = np.concatenate([z, np.cumsum(w * y, axis=1)], axis=1)
    tol = 1e-12 * float(np.abs(w * y).sum() + w.sum())
    rows = np.arange(nb)

    def sums(lo, hi):
        return (float((cwy[rows, hi] - cwy[rows, lo]).sum()),
                float((cw[rows, hi] - cw[rows, lo]).sum()))

    H = np.zeros(nb, dtype=np.int64)
    blocks: list[tuple[np.ndarray, np.ndarray, float, float]] = []  # lo, hi, sum_wy, sum_w
    while (H < nk).any():
        h = np.full(nb, nk, dtype=np.int64)
        swy, sw = sums(H, h)
        for _ in range(nb * nk + 2):  # Dinkelbach: the mean strictly falls, over finitely many sets
            val, hh = _min_lower_set(cwy - (swy / sw) * cw, H)
            if val >= -tol:
                break
            nwy, nw = sums(H, hh)
            if nwy / nw >= swy / sw:
                break
            h, swy, sw = hh, nwy, nw
        lo = H.copy()
        while blocks and blocks[-1][2] / blocks[-1][3] >= swy / sw:
            plo, _, pwy, pw = blocks.pop()
            lo, swy, sw = plo, swy + pwy, sw + pw
        blocks.append((lo, h, swy, sw))
        H = h
    out = np.empty_like(y)
    for lo, hi, swy, sw in blocks:
        for b in range(nb):
            out[b, lo[b]:hi[b]] = swy / sw
    return out
