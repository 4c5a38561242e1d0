"""Means with 95% intervals over seeds, and paired differences: what the reports and figures state.

The interval is Student's t over the seeds (two-sided 95%): mean ± t(0.975, n - 1) · s / √n. A paired
difference takes, seed by seed, one row's value minus the other's (both trained with that seed), and gives the
same interval for the mean difference. With one seed there is no interval (``None``).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045,
        2.042)
"""t(0.975, df) for df = 1 ... 30 (the two-sided 95% quantile of Student's t); beyond 30 the normal's 1.96
is within 4%."""


def t975(df: int) -> float:
    if df < 1:
        raise ValueError(f"a t interval needs at least 2 values (df >= 1), got df {df}")
    return T975[df - 1] if df <= len(T975) else 1.96 + 2.4 / df


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float | None
    high: float | None
    n: int

    @property
    def half(self) -> float | None:
        return None if self.low is None else (self.high - self.low) / 2

    def excludes(self, value: float = 0.0) -> bool:
        """Whether the whole interval lies on one side of ``value`` (False without an interval)."""
        return self.low is not None and (self.low > value or self.high < value)

    def text(self, scale: float = 1.0, digits: int = 1, sign: bool = False) -> str:
        f = f"{{:{'+' if sign else ''}.{digits}f}}"
        if self.low is None:
            return f"{f.format(scale * self.mean)} (n={self.n}, no interval)"
        return (f"{f.format(scale * self.mean)} [{f.format(scale * self.low)}, {f.format(scale * self.high)}] "
                f"(n={self.n})")


def interval(values: list[float]) -> Interval:
    """Mean and two-sided 95% t interval of ``values`` (no interval for one value)."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("no values")
    mean = statistics.fmean(values)
    if len(values) == 1:
        return Interval(mean, None, None, 1)
    half = t975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return Interval(mean, mean - half, mean + half, len(values))


def paired(a: dict, b: dict) -> Interval | None:
    """The interval of a - b over the keys (seeds) both hold; None when they share none."""
    common = sorted(set(a) & set(b))
    return interval([a[k] - b[k] for k in common]) if common else None
