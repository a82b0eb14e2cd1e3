"""Noise, measured: the mean of a few seeds with its confidence interval, and the interval of a difference between
two settings, so that a lesson states how sure it is instead of typing a threshold.

    from my_utils.core.stats import difference, mean_interval
    mean_interval([0.81, 0.86, 0.79])          # 0.820 [0.730, 0.910], 95% Student's t interval of the mean
    d = difference([0.81, 0.86, 0.79], [0.95, 0.99, 0.91])
    d.excludes(0)                               # True: the data separates the two settings
    d.inside(-0.05, 0.05)                       # an equivalence margin, stated by the claim
    noise = pooled_noise([[0.81, 0.86, 0.79], [0.95, 0.99, 0.91]])  # seeds measured beside one-seed settings
    noise.difference(0.70, 0.88)                # two one-seed settings, judged by that noise

With 3 seeds the interval is wide (Student's t with 2 degrees of freedom is 4.30): a claim that survives it is
a claim the data makes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import mean, stdev

from my_utils import JobFailed

# Two-sided 95% quantiles of Student's t distribution, by degrees of freedom; beyond 30 the normal's 1.96 is within
# 4% (2.04 at 30), rounded up to 2.0.
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
       11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086,
       21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048, 29: 2.045, 30: 2.042}


def t95(df: float) -> float:
    """The two-sided 95% quantile of Student's t with ``df`` degrees of freedom (rounded down: the wider interval)."""
    return T95.get(max(1, math.floor(df)), 2.0)


@dataclass(frozen=True)
class Interval:
    """A mean (of values, or of a difference) with its 95% confidence interval and the values behind it."""

    mean: float
    low: float
    high: float
    n: int

    def excludes(self, value: float) -> bool:
        return not self.low <= value <= self.high

    def inside(self, low: float, high: float) -> bool:
        return low <= self.low and self.high <= high

    def __str__(self) -> str:
        return f"{self.mean:.3f} [{self.low:.3f}, {self.high:.3f}]"


def mean_interval(values) -> Interval:
    """The mean of ``values`` (2 or more) and its 95% Student's t interval."""
    values = _numbers(values)
    half = t95(len(values) - 1) * stdev(values) / math.sqrt(len(values))
    return Interval(mean(values), mean(values) - half, mean(values) + half, len(values))


def difference(a, b) -> Interval:
    """mean(a) - mean(b) and its 95% interval (Welch: the two settings may be noisier than each other)."""
    a, b = _numbers(a), _numbers(b)
    va, vb = stdev(a) ** 2 / len(a), stdev(b) ** 2 / len(b)
    d = mean(a) - mean(b)
    if va + vb == 0:
        return Interval(d, d, d, len(a) + len(b))
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))  # Welch-Satterthwaite
    half = t95(df) * math.sqrt(va + vb)
    return Interval(d, d - half, d + half, len(a) + len(b))


@dataclass(frozen=True)
class Noise:
    """The spread between seeds of one setting, pooled over several settings: its standard deviation and degrees of
    freedom. It judges settings that ran one seed each (a sweep's cells) against the seeds measured beside them."""

    sd: float
    df: int

    def difference(self, a: float, b: float, n_a: int = 1, n_b: int = 1) -> Interval:
        """a - b, each a mean of ``n_a`` and ``n_b`` seeds, with its 95% interval from this noise."""
        half = t95(self.df) * self.sd * math.sqrt(1 / n_a + 1 / n_b)
        return Interval(a - b, a - b - half, a - b + half, n_a + n_b)


def pooled_noise(groups) -> Noise:
    """The pooled standard deviation of several groups of seeds (each a list of 2 or more values of one setting)."""
    groups = [_numbers(g) for g in groups]
    df = sum(len(g) - 1 for g in groups)
    if not df:
        raise ValueError("pooled noise needs at least one group of 2 or more values")
    return Noise(math.sqrt(sum((len(g) - 1) * stdev(g) ** 2 for g in groups) / df), df)


def _numbers(values) -> list[float]:
    values = [float(v) for v in values]
    if len(values) < 2:
        raise ValueError(f"an interval needs 2 or more values, got {len(values)}")
    return values


def check_tolerances(summary: dict, what: str) -> None:
    """A claim of equality judged by its stated tolerance: ``summary["tolerances"]`` maps each difference in
    ``summary`` (a number, or a dict of numbers, each judged) to the largest that still counts as equal.
    The first difference over its tolerance (or not a number: NaN) raises JobFailed in one sentence; the summary,
    tolerances included, is written before, so the run's figures stay to read."""
    for name, tolerance in summary["tolerances"].items():
        value = summary[name]
        over = [v for v in (value.values() if isinstance(value, dict) else [value]) if not v <= tolerance]
        if over:
            raise JobFailed(f"{what} differ by {over[0]:.1e} ({name}), over the tolerance {tolerance:g} that counts "
                            "as equal; the results folder's summary.json holds every difference.")
