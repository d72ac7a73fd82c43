"""Statistics shared by the sampling tests: two-sample tests of token distributions."""

from __future__ import annotations

import numpy as np


def two_sample_p_value(a: np.ndarray, b: np.ndarray) -> float:
    """Smallest Bonferroni-corrected chi-square p-value over positions (rare tokens pooled)."""
    from scipy.stats import chi2_contingency

    p_values = []
    for pos in range(a.shape[1]):
        tokens, counts_a = np.unique(a[:, pos], return_counts=True)
        table = {t: [c, 0] for t, c in zip(tokens, counts_a, strict=True)}
        for t, c in zip(*np.unique(b[:, pos], return_counts=True), strict=True):
            table.setdefault(t, [0, 0])[1] = c
        rows = sorted(table.values(), key=lambda r: -(r[0] + r[1]))
        kept = [r for r in rows if r[0] + r[1] >= 10]
        rest = [sum(r[0] for r in rows if r not in kept), sum(r[1] for r in rows if r not in kept)]
        if sum(rest) > 0:
            kept.append(rest)
        if len(kept) < 2:
            p_values.append(1.0)
            continue
        p_values.append(chi2_contingency(np.array(kept).T)[1])
    return min(1.0, min(p_values) * len(p_values))
