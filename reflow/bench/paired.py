"""Paired comparisons over seeds: a claim such as "reflow's eval reward is not below async's" is made on the
per-seed differences (same seed, same eval prompts and sampling seeds), with a one-sided t bound.

For n seeds with differences d_i = a_i - b_i: mean d, sample standard deviation s (n - 1 in the denominator),
and the lower one-sided 95% bound mean - t(0.95, n - 1) s / sqrt(n). The bound is below the true mean
difference in 95% of repetitions when the d_i are independent and roughly normal; with one seed there is none.
"""

from __future__ import annotations

import math

T_95_ONE_SIDED = {
    1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833, 10: 1.812,
    11: 1.796, 12: 1.782, 13: 1.771, 14: 1.761, 15: 1.753, 16: 1.746, 17: 1.740, 18: 1.734, 19: 1.729,
    20: 1.725, 25: 1.708, 30: 1.697, 40: 1.684, 60: 1.671, 120: 1.658,
}
"""Student's t 95% quantile by degrees of freedom (one-sided); between entries the next smaller df is used,
which errs toward a wider bound."""


def t_quantile_95(df: int) -> float:
    if df < 1:
        raise ValueError(f"a t bound needs at least 1 degree of freedom, got {df}")
    return T_95_ONE_SIDED[max(k for k in T_95_ONE_SIDED if k <= df)]


def paired_difference(a: list[float], b: list[float]) -> dict:
    """The per-seed differences a_i - b_i, their mean, sample standard deviation and lower one-sided 95%
    bound (None with a single seed)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired values need the same non-zero number of seeds, got {len(a)} and {len(b)}")
    diffs = [x - y for x, y in zip(a, b)]
    n = len(diffs)
    mean = sum(diffs) / n
    if n == 1:
        return {"differences": diffs, "mean": mean, "std": None, "lower_95": None, "seeds": n}
    std = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    return {"differences": diffs, "mean": mean, "std": std, "lower_95": mean - t_quantile_95(n - 1) * std / math.sqrt(n),
            "seeds": n}


def paired_ratio(a: list[float], b: list[float]) -> dict:
    """Per-seed ratios a_i / b_i of positive figures (throughputs), their geometric mean and the one-sided 95%
    bounds on it, lower and upper (None with a single seed): ``paired_difference`` on the logarithms. Seeds run
    back to back see the same machine, so the ratio cancels what the machine's speed does to both."""
    if len(a) != len(b) or not a or min(a + b) <= 0:
        raise ValueError(f"paired ratios need positive values and the same non-zero number of seeds, got {a} and {b}")
    logs = paired_difference([math.log(x) for x in a], [math.log(y) for y in b])
    mean, lower = logs["mean"], logs["lower_95"]
    bounds = (math.exp(lower), math.exp(2 * mean - lower)) if lower is not None else (None, None)
    return {"ratios": [x / y for x, y in zip(a, b)], "geometric_mean": math.exp(mean), "lower_95": bounds[0],
            "upper_95": bounds[1], "seeds": len(a)}
