"""One process's part of ring or gathered attention over a map's positions, timed: for
``experiments/ring_attention.py`` (the benchmark of ``bigconv.ops.global_attention``'s cost).

The process joins a gloo process group (``MASTER_ADDR``/``MASTER_PORT`` set by the caller), holds its
balanced rows of a ``side x side`` map on a ``size x 1`` grid, and runs forward and backward of
``attend`` on a point-to-point link, as a bigconv worker does.
"""

from __future__ import annotations

import resource
import statistics
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

from ..engine.executor import ShardExecutor
from ..geometry.boxes import balanced_bounds
from ..ops.global_attention import RingPlan, attend
from ..transport import WorkerRuntime, new_stats
from ..transport.p2p import P2PLink


def rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def inputs(n: int, heads: int, dim: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(heads, n, dim, generator=g) for _ in range(3)]


def rank_cost(rank: int, size: int, strategy: str, side: int, heads: int, dim: int, steps: int) -> tuple[int, float]:
    """(peak bytes over the baseline after the inputs, median step seconds but the first) of this rank."""
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        q, k, v = inputs(side * side, heads, dim)
        a, b = balanced_bounds(side, size)[rank]
        q, k, v = (t[:, a * side:b * side].contiguous() for t in (q, k, v))
        stats = new_stats()
        rt = WorkerRuntime(index=rank, workers=size, device=torch.device("cpu"), timeout=300.0, stats=stats)
        rt.link = P2PLink(None, list(range(size)), rank, 300.0, stats)
        dist.barrier()
        base = rss_bytes()
        times = []
        for step in range(steps):
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
            dist.barrier()
            start = time.perf_counter()
            plan = RingPlan(SimpleNamespace(executor=ShardExecutor((size, 1), step + 1, rt)), (side, side),
                            dim ** -0.5, "cpu")
            attend(plan, *leaves, (), strategy).sum().backward()
            times.append(time.perf_counter() - start)
        dist.barrier()
        return rss_bytes() - base, statistics.median(times[1:] or times)
    finally:
        dist.destroy_process_group()
