"""The planner's three questions: which grid on N GPUs, how few GPUs fit, how large an image fits N.

Each answer is a search over ``cost_model.estimate`` (one dry run of a proxy grid per new shard size,
cached). The counts and sizes between probes are guessed from the last two probes' memory, which falls
about linearly with the shard's pixels, and every answer is a probe that fits next to one that does not:
the guesses only choose where to look.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..geometry.boxes import _factorizations, choose_grid
from .cost_model import Cluster, Estimate, Profiler, estimate

MAX_COUNT = 1 << 17
"""Counts beyond this are not searched (131,072 GPUs)."""


def with_gpus(cluster: Cluster, gpus: int) -> Cluster:
    """The same cluster with ``gpus`` processes on nodes of the same size."""
    nodes = -(-gpus // cluster.gpus_per_node)
    inter = cluster.inter or _default_inter(cluster)
    return replace(cluster, gpus=gpus, nodes=nodes, inter=inter if nodes > 1 else cluster.inter)


def _default_inter(cluster: Cluster):
    from .devices import link

    return link(cluster.device.inter)


def candidates(spatial: tuple[int, ...], gpus: int, batch: int, keep: int = 3) -> list[tuple[tuple[int, ...], int]]:
    """(grid, replicas) worth pricing: the ``keep`` grids of least cut surface for one replica (the first is
    ``choose_grid``'s), and the balanced grid for each other replica count the batch allows."""
    volume = math.prod(spatial)
    grids = sorted((sum((g - 1) * volume / n for g, n in zip(grid, spatial)), grid)
                   for grid in _factorizations(gpus, len(spatial)) if all(g <= n for g, n in zip(grid, spatial)))
    found = [(grid, 1) for _, grid in grids[:keep]]
    for r in range(2, min(batch, gpus) + 1):
        if gpus % r == 0:
            found.append((choose_grid(spatial, gpus // r), r))
    return found


def choose(profiler: Profiler, shape: tuple[int, ...], cluster: Cluster, grid=None, replicas: int | None = None
           ) -> tuple[Estimate, list[Estimate]]:
    """The plan for ``cluster.gpus``: the given grid, or the fastest candidate that fits (the smallest if
    none fits; within 1% of it, the one of least cut surface); and every candidate priced."""
    spatial = tuple(shape[2:])
    if grid is not None:
        r = replicas or cluster.gpus // math.prod(grid)
        return (e := estimate(profiler, shape, cluster, tuple(grid), r)), [e]
    options = candidates(spatial, cluster.gpus, shape[0])
    if replicas is not None:
        options = [(g, r) for g, r in options if r == replicas] or \
            [(choose_grid(spatial, cluster.gpus // replicas), replicas)]
    priced = [estimate(profiler, shape, cluster, g, r) for g, r in options]
    fitting = [e for e in priced if e.fits]
    pool, key = (fitting, lambda e: e.time["step"]) if fitting else (priced, lambda e: e.memory["total"])
    # Within 1% of the best, the first in the candidates' order (the least cut surface) wins: the proxies of
    # different grids round their shards differently, by less than that.
    floor = min(key(e) for e in pool)
    best = next(e for e in pool if key(e) <= 1.01 * floor)
    return best, priced


def smallest_count(profiler: Profiler, shape: tuple[int, ...], cluster: Cluster, limit: int = MAX_COUNT
                   ) -> tuple[int | None, Estimate | None]:
    """The fewest GPUs (balanced grid, one replica) whose largest shard fits the device's memory: a count
    that fits next to one less that does not (memory assumed to fall as the count grows)."""
    spatial = tuple(shape[2:])
    limit = min(limit, math.prod(spatial))
    probes: dict[int, Estimate] = {}

    def fits(n: int) -> bool:
        if n not in probes:
            probes[n] = estimate(profiler, shape, with_gpus(cluster, n), choose_grid(spatial, n))
        return probes[n].fits

    if fits(1):
        return 1, probes[1]
    lo, hi = 1, max(2, min(cluster.gpus, limit))
    while not fits(hi):  # jump to where the line through the last two probes (memory against 1/n) crosses
        if hi >= limit:
            return None, None
        guess = _cross(lo if lo > 1 else hi, hi, probes, lambda k: 1 / k)
        lo, hi = hi, min(limit, max(hi + 1, math.ceil(1.02 * guess) if guess else 4 * hi))
    n = _bracket(lo, hi, fits, probes, lambda k: 1 / k, 1, smallest=True)
    return n, probes[n]


def max_size(profiler: Profiler, shape: tuple[int, ...], cluster: Cluster, multiple: int = 8, grid=None,
             limit: int | None = None) -> tuple[tuple[int, ...] | None, Estimate | None]:
    """The largest input of ``shape``'s proportions (spatial dims scaled together, each a multiple of
    ``multiple``) whose largest shard fits on ``cluster.gpus`` GPUs; the balanced grid at each size unless
    ``grid`` is given."""
    spatial = tuple(shape[2:])
    first = spatial[0]
    limit = limit or {1: 1 << 34, 2: 1 << 22, 3: 1 << 16}.get(len(spatial), 1 << 12)
    probes: dict[int, Estimate] = {}

    def sized(edge: int) -> tuple[int, ...]:
        return (*shape[:2], *(max(multiple, round(n * edge / first / multiple) * multiple) for n in spatial))

    def fits(edge: int) -> bool:
        if edge not in probes:
            s = sized(edge)
            try:
                probes[edge] = estimate(profiler, s, cluster, tuple(grid) if grid else choose_grid(s[2:], cluster.gpus))
            except ValueError:  # a shape the model or the grid cannot take (too small for the grid)
                return False
        return probes[edge].fits

    def x(k: float) -> float:  # memory grows with the pixels
        return k ** len(spatial)

    lo = hi = max(multiple, first // multiple * multiple)
    if fits(hi):
        while fits(hi):
            if hi >= limit:
                return sized(hi), probes[hi]
            guess = _cross(lo, hi, probes, x)
            lo, hi = hi, min(limit, max(hi + multiple, _down(1.02 * guess, multiple) if guess else 2 * hi))
    else:
        while not fits(lo):
            if lo <= multiple:
                return None, None
            guess = _cross(lo, hi, probes, x)
            hi, lo = lo, max(multiple, min(lo - multiple, _down(0.98 * guess, multiple) if guess else lo // 2))
    e = _bracket(lo, hi, fits, probes, x, multiple, smallest=False)
    return sized(e), probes[e]


def _down(value: float, step: int) -> int:
    return max(step, int(value) // step * step)


FIXED = ("parameters", "optimizer", "autocast_weights", "reserve")
"""Memory parts that do not change with the shard's size."""


def _cross(a: int, b: int, probes: dict, x) -> float | None:
    """Where the line through the probes at ``a`` and ``b`` (memory over budget against ``x``) crosses zero,
    as a value of the searched variable; with one probe (``a == b``), the line through it and no memory
    beyond the fixed parts at ``x = 0``. None when the probes cannot tell."""
    pa, pb = probes.get(a), probes.get(b)
    if pa is None or pb is None:
        return None
    if a == b:
        fixed = sum(pa.memory[k] for k in FIXED)
        grows = pa.memory["total"] - fixed
        if grows <= 0 or pa.memory["budget"] <= fixed:
            return None
        t = x(a) * (pa.memory["budget"] - fixed) / grows
    else:
        if x(a) == x(b):
            return None
        ma, mb = pa.memory["total"] - pa.memory["budget"], pb.memory["total"] - pb.memory["budget"]
        if ma == mb:
            return None
        t = x(a) + (x(b) - x(a)) * -ma / (mb - ma)
    left, right = 1e-9, 1e12  # x is monotone: invert it by bisection on a log scale
    rising = x(2.0) > x(1.0)
    for _ in range(200):
        m = (left * right) ** 0.5
        if (x(m) < t) == rising:
            left = m
        else:
            right = m
    return left if 0 < left < 1e12 else None


def _bracket(lo: int, hi: int, fits, probes: dict, x, step: int, smallest: bool) -> int:
    """Narrow [lo, hi] (one end fits, the other not) to neighbours ``step`` apart: guess where the line
    through the two ends crosses the budget and probe the guess's neighbour on the other side too, so a good
    guess settles it in two probes; bisect whenever a guess did not halve the interval."""
    good, bad = (hi, lo) if smallest else (lo, hi)
    while abs(good - bad) > step:
        width = abs(good - bad)
        guess = _cross(lo, hi, probes, x)
        g = round(guess / step) * step if guess else (lo + hi) // 2 // step * step
        g = min(max(g, min(lo, hi) + step), max(lo, hi) - step)
        if fits(g):
            good = g
            other = g - step if smallest else g + step
            if other != bad and not fits(other):
                bad = other
        else:
            bad = g
            other = g + step if smallest else g - step
            if other != good and fits(other):
                good = other
        lo, hi = (bad, good) if smallest else (good, bad)
        if abs(good - bad) > width / 2 and abs(good - bad) > step:
            mid = (lo + hi) // 2 // step * step
            if mid not in (lo, hi):
                if fits(mid):
                    good = mid
                else:
                    bad = mid
                lo, hi = (bad, good) if smallest else (good, bad)
    return good
