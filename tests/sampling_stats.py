"""Statistics shared by the sampling tests: two-sample tests of token distributions and their power.

Samples are integer arrays ``[num_samples, num_positions]`` (one generated sequence per row). Each
position is tested on its own with a two-sample chi-square test of homogeneity: tokens whose
combined count is at least ``min_count`` get their own cell, the rest share one cell.

The power of that test against a given alternative is computed with the usual noncentral
chi-square approximation: for sample sizes ``n_a``, ``n_b`` and cell probabilities ``p`` (first
sample) and ``q`` (second), the statistic is approximately noncentral chi-square with
``cells - 1`` degrees of freedom and noncentrality
``lambda = n_a * n_b / (n_a + n_b) * sum_k (p_k - q_k)^2 / m_k``, ``m_k = (n_a p_k + n_b q_k) /
(n_a + n_b)``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def contingency_table(
    a: np.ndarray, b: np.ndarray, min_count: int = 10, max_cells: int | None = None
) -> np.ndarray:
    """``[cells, 2]`` counts of two 1-D token samples. Tokens rarer than ``min_count`` (both
    samples together), and with ``max_cells`` all but the ``max_cells`` most frequent ones, are
    pooled into one cell."""
    tokens = np.union1d(a, b)
    index_a = np.searchsorted(tokens, a)
    index_b = np.searchsorted(tokens, b)
    table = np.zeros((len(tokens), 2), dtype=np.int64)
    np.add.at(table[:, 0], index_a, 1)
    np.add.at(table[:, 1], index_b, 1)
    return _pool_rare(table, min_count, max_cells)


def _pool_rare(table: np.ndarray, min_count: float, max_cells: int | None) -> np.ndarray:
    totals = table.sum(axis=1)
    keep = totals >= min_count
    if max_cells is not None and keep.sum() > max_cells:
        keep[np.argsort(-totals, kind="stable")[max_cells:]] = False
    kept = table[keep]
    rest = table[~keep].sum(axis=0, keepdims=True)
    if rest.sum() > 0:
        kept = np.concatenate([kept, rest])
    return kept


def chi_square_p_value(table: np.ndarray) -> float:
    """p-value of the chi-square test of homogeneity of a ``[cells, 2]`` table (1.0 when it has
    fewer than two non-empty cells)."""
    from scipy.stats import chi2_contingency

    table = table[table.sum(axis=1) > 0]
    if len(table) < 2:
        return 1.0
    return float(chi2_contingency(table.T, correction=False)[1])


def position_p_values(
    a: np.ndarray, b: np.ndarray, min_count: int = 10, max_cells: int | None = None
) -> np.ndarray:
    """Unadjusted p-value of every position (column) of two samples."""
    assert a.ndim == b.ndim == 2 and a.shape[1] == b.shape[1], (a.shape, b.shape)
    return np.array([
        chi_square_p_value(contingency_table(a[:, t], b[:, t], min_count, max_cells))
        for t in range(a.shape[1])
    ])


def two_sample_p_value(a: np.ndarray, b: np.ndarray) -> float:
    """Smallest Bonferroni-corrected chi-square p-value over positions (rare tokens pooled)."""
    p_values = position_p_values(a, b)
    return float(min(1.0, p_values.min() * len(p_values)))


# --- power ---------------------------------------------------------------------------------------


def shift_token_ids(p: np.ndarray) -> np.ndarray:
    """The alternative ``r`` used for power statements: ``p`` with every token's probability
    handed to the next token id (``r[x] = p[x - 1]``, cyclic), an off-by-one token-id bug. The
    model's random weights make ``p[x - 1]`` unrelated to ``p[x]``, so ``r`` is ``p`` with its
    probabilities on other tokens: same entropy, clearly different tokens."""
    return np.roll(p, 1)


def point_mass_on_rank(rank: int) -> Callable[[np.ndarray], np.ndarray]:
    """The alternative ``r`` = a point mass on the token of ``p`` at ``rank`` (0 = most likely):
    a plausible but wrong token."""

    def alternative(p: np.ndarray) -> np.ndarray:
        r = np.zeros_like(p)
        r[np.argsort(-p, kind="stable")[rank]] = 1.0
        return r

    return alternative


def empirical_distribution(samples: np.ndarray, vocab_size: int) -> np.ndarray:
    """Token frequencies of a 1-D sample over the whole vocabulary."""
    return np.bincount(samples, minlength=vocab_size).astype(np.float64) / len(samples)


def mixture_power(
    p: np.ndarray,
    n_a: int,
    n_b: int,
    alpha: float,
    weight: float = 0.05,
    alternative: Callable[[np.ndarray], np.ndarray] = shift_token_ids,
    min_count: int = 10,
    max_cells: int | None = None,
) -> float:
    """Probability that :func:`chi_square_p_value` < ``alpha`` when the first sample (``n_a``)
    follows ``p`` and the second (``n_b``) ``(1 - weight) * p + weight * r``,
    ``r = alternative(p)``, by the noncentral chi-square approximation (cells as the test forms
    them from the expected counts)."""
    from scipy.stats import chi2, ncx2

    q = (1.0 - weight) * p + weight * alternative(p)
    table = _pool_rare(np.stack([n_a * p, n_b * q], axis=1), min_count, max_cells)
    cells = table[table.sum(axis=1) > 0]
    if len(cells) < 2:
        return 0.0
    p_cells = cells[:, 0] / n_a
    q_cells = cells[:, 1] / n_b
    m_cells = cells.sum(axis=1) / (n_a + n_b)
    noncentrality = n_a * n_b / (n_a + n_b) * float(np.sum((p_cells - q_cells) ** 2 / m_cells))
    df = len(cells) - 1
    return float(ncx2.sf(chi2.isf(alpha, df), df, noncentrality))
