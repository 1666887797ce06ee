"""Standard errors of evaluation estimates, in plain Python.

The stages compute them into eval.json and the CLI's run report (orchestration/outcomes.py) reads
and combines them; kept free of torch so that `posttrain plan`, `status` and the driver of
`posttrain run` start in a fraction of a second instead of importing the model stack.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def mean_standard_error(values: Sequence[float]) -> float:
    """Standard error of the mean of `values` (sample standard deviation / sqrt(n)); 0.0 below
    two values, where none can be estimated."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def paired_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> tuple[float, float]:
    """(sum numerator / sum denominator, its standard error by the delta method) when both measure
    the same units (a student's and its teacher's accuracy on the same prompts): var(R) ~ var(n_i -
    R d_i) / (units x mean(d)^2), so what the two share (a prompt's difficulty) cancels."""
    if len(numerator) != len(denominator) or len(denominator) < 2:
        raise ValueError(f"need two or more paired units, got {len(numerator)} and {len(denominator)}")
    mean = sum(denominator) / len(denominator)
    if mean <= 0:
        raise ValueError("the denominator's values sum to zero or less: the ratio is undefined")
    ratio = sum(numerator) / sum(denominator)
    residual = [a - ratio * b for a, b in zip(numerator, denominator, strict=True)]
    return ratio, mean_standard_error(residual) / mean


def paired_standard_error(before: Sequence[float], after: Sequence[float]) -> float:
    """Standard error of mean(after) - mean(before) when both measure the same units (episode i of
    each is the same prompt): the error of the mean of the differences."""
    if len(before) != len(after):
        raise ValueError(f"paired values need equal lengths, got {len(before)} and {len(after)}")
    return mean_standard_error([a - b for b, a in zip(before, after, strict=True)])
