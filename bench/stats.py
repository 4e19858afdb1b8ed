"""Intervals for benchmark arms: the mean of repeats with its 95% confidence interval (Student's t), and the
ratio of two arms' means with a 95% interval (delta method on the log ratio, Welch's degrees of freedom).

It owns only arithmetic; a benchmark records every repeat beside what these functions compute.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

# two-sided 97.5% quantiles of Student's t by degrees of freedom (1..30); larger: the normal's 1.96
_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t975(df: float) -> float:
    """Student's t quantile for a two-sided 95% interval at `df` degrees of freedom (rounded down)."""
    return _T975[max(1, int(df)) - 1] if df < 31 else 1.96


def mean_ci95(values: Sequence[float]) -> dict[str, float]:
    """{"mean", "low", "high", "n"}: the mean of `values` (at least 2) and its 95% interval."""
    if len(values) < 2:
        raise ValueError(f"an interval needs at least 2 repeats, got {len(values)}")
    mean = statistics.fmean(values)
    half = t975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": len(values)}


def ratio_ci95(a: Sequence[float], b: Sequence[float]) -> dict[str, float]:
    """{"ratio", "low", "high"}: mean(a) / mean(b) with a 95% interval (positive values, at least 2 of each)."""
    if len(a) < 2 or len(b) < 2:
        raise ValueError("a ratio's interval needs at least 2 repeats per arm")
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    va, vb = statistics.variance(a) / (len(a) * ma * ma), statistics.variance(b) / (len(b) * mb * mb)
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / ((va * va / (len(a) - 1) if va else 0) + (vb * vb / (len(b) - 1) if vb else 0) or 1e-300)
    half = t975(df) * se
    ratio = ma / mb
    return {"ratio": ratio, "low": ratio * math.exp(-half), "high": ratio * math.exp(half)}


def ratio_of_means_ci95(a: Sequence[float], b: Sequence[float]) -> dict[str, float]:
    """{"mean", "low", "high", "n"}: mean(a) / mean(b) with a 95% interval for values of either sign (gains): the
    delta method on the linear scale, var(r) = r^2 (var(mean a) / mean(a)^2 + var(mean b) / mean(b)^2) with
    Welch's degrees of freedom; `n` is the smaller arm. Wide (or unbounded) when mean(b) is near zero: a gain
    ratio is only as sure as its denominator."""
    if len(a) < 2 or len(b) < 2:
        raise ValueError("a ratio's interval needs at least 2 repeats per arm")
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    if mb == 0:
        raise ValueError("the denominator arm's mean is 0: the ratio is undefined")
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    ratio = ma / mb
    ra, rb = (va / (ma * ma) if ma else 0.0), vb / (mb * mb)
    se = abs(ratio) * math.sqrt(ra + rb) if ma else math.sqrt(va) / abs(mb)
    wa, wb = (ra, rb) if ma else (va / (mb * mb), 0.0)
    df = (wa + wb) ** 2 / ((wa * wa / (len(a) - 1)) + (wb * wb / (len(b) - 1)) or 1e-300)
    half = t975(df) * se
    return {"mean": ratio, "low": ratio - half, "high": ratio + half, "n": min(len(a), len(b))}


def interval(values: list[float]) -> dict[str, float] | None:
    """{mean, ci95: [low, high], n} of two or more values; one value alone: its mean, n = 1 (no interval is
    invented)."""
    if len(values) >= 2:
        m = mean_ci95(values)
        return {"mean": m["mean"], "ci95": [m["low"], m["high"]], "n": m["n"]}
    return {"mean": values[0], "n": 1} if values else None


def ratio_interval(a: list[float], b: list[float]) -> dict[str, Any] | None:
    """mean(a) / mean(b) with its 95% interval (2+ repeats a side); one each: the ratio alone."""
    if not a or not b:
        return None
    if len(a) >= 2 and len(b) >= 2:
        r = ratio_ci95(a, b)
        return {"mean": r["ratio"], "ci95": [r["low"], r["high"]], "n": min(len(a), len(b))}
    return {"mean": sum(a) / len(a) / (sum(b) / len(b)), "n": min(len(a), len(b))}
