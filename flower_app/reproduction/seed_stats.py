"""Statistics over a cell's seeds: the 95% interval of a mean, and Welch's test of two means."""

from __future__ import annotations

import math

ALPHA = 0.05  # two-sided significance level of each pairwise test


def ci95_half_width(std: float | None, n: int) -> float | None:
    """Half-width of the 95% Student-t interval of a mean of ``n`` values with sample std ``std``
    (None below two values)."""
    if std is None or n < 2:
        return None
    from scipy.stats import t

    return float(t.ppf(0.975, n - 1)) * std / n**0.5


def differ(a: dict, b: dict) -> bool:
    """Whether rows ``a`` and ``b`` (mean, std, n over seeds) differ significantly: Welch's two-sided
    t-test at ``ALPHA``. Two spreads of zero differ exactly when their means do."""
    from scipy.stats import ttest_ind_from_stats

    if a["std"] == 0 and b["std"] == 0:
        return a["mean"] != b["mean"]
    p = ttest_ind_from_stats(a["mean"], a["std"], a["n"], b["mean"], b["std"], b["n"], equal_var=False).pvalue
    return bool(not math.isnan(p) and p < ALPHA)
