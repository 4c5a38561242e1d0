"""The halo exchange's adjoint (dot-product) test, run on a live World: a check of the transport on its own.

``halo_adjoint`` is the dot-product test of the halo exchange F, which maps a sharded image to each
shard's zero-padded input window: <F x, y> must equal <x, F^T y>, where F^T is what distributed
autograd runs backward. It catches backward bugs that forward checks miss.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed.autograd as dist_autograd

from .transport import rpc as rpc_link
from .engine.executor import ShardExecutor, split_shards
from .geometry.boxes import Window, all_coords, halo_plan
from .runtime.world import World

PROBE_CALLS = 10**9
"""Probes' call numbers start here (plus the probe's part id): never one of a model's (they count from 1)."""


class HaloProbe:
    """A part of each worker's host (``bigconv.runtime.host``): the two halves of the adjoint test."""

    def __init__(self, host, call: int) -> None:
        self.rt, self.call = host.rt, call
        self.leaf: torch.Tensor | None = None

    def exchange(self, grid, shape, windows, x_local: torch.Tensor, y_local: torch.Tensor):
        self.leaf = x_local.requires_grad_(True)
        try:
            window = ShardExecutor(grid, self.call, self.rt).gather_window(x_local, shape, windows)
            return window.detach().clone(), (window * y_local).sum()
        finally:
            rpc_link.flush(self.rt)

    def adjoint_half(self, context_id: int) -> tuple[torch.Tensor, float]:
        x, self.leaf = self.leaf, None
        grad = dist_autograd.get_gradients(context_id)[x]
        return grad, float((x.detach() * grad).sum())


def halo_adjoint(world: World, x: torch.Tensor, grid: Sequence[int], windows: Sequence[Window],
                 seed: int = 0) -> dict:
    """Run F and F^T on ``x`` (global, ``(N, C, *spatial)``) and random windows; return both sides."""
    grid, shape = tuple(grid), tuple(x.shape[2:])
    gen = torch.Generator().manual_seed(seed)
    ys = []
    for coord in all_coords(grid):
        plan = halo_plan(shape, grid, coord, windows)
        size = [hi - lo + p0 + p1 for (lo, hi), (p0, p1) in zip(plan.need, plan.pad)]
        ys.append(torch.randn(*x.shape[:2], *size, generator=gen, dtype=x.dtype))
    xs = split_shards(x, grid)
    probe = world.install(HaloProbe, [(PROBE_CALLS + world.parts_installed,)] * world.workers,
                          "installing the halo probes")
    try:
        with world.autograd_context() as ctx:
            results = world.call_part(probe, "exchange", [(grid, shape, tuple(windows), xi, yi) for xi, yi in zip(xs, ys)],
                                      "halo adjoint forward")
            forward = sum(r[1] for r in results)
            dist_autograd.backward(ctx, [forward])
            back = world.call_part(probe, "adjoint_half", [(ctx,)] * world.workers, "halo adjoint backward")
    finally:
        world.retire(probe)
    return {
        "windows": [r[0] for r in results],
        "dual_windows": ys,
        "forward_inner": forward.detach().item(),
        "adjoint_inner": sum(b[1] for b in back),
        "adjoint_grads": [b[0] for b in back],
    }
