"""The halo exchange's adjoint (dot-product) test, run on a live World: a check of the transport on its own.

``halo_adjoint`` is the dot-product test of the halo exchange F, which maps a sharded image to each
shard's zero-padded input window: <F x, y> must equal <x, F^T y>, where F^T is what distributed
autograd runs backward. It catches backward bugs that forward checks miss.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

from . import transport
from .transport import rpc as rpc_link
from .engine.executor import ShardExecutor, split_shards
from .geometry.boxes import Window, all_coords, halo_plan
from .runtime.world import World

_probe_calls = itertools.count(10**9)  # never collides with a model's call numbers
_LEAVES: dict[int, torch.Tensor] = {}


def _exchange(call: int, grid, shape, windows, x_local: torch.Tensor, y_local: torch.Tensor):
    x_local.requires_grad_(True)
    _LEAVES[call] = x_local
    try:
        rt = transport.runtime()
        window = ShardExecutor(grid, call, rt).gather_window(x_local, shape, windows)
        return window.detach().clone(), (window * y_local).sum()
    finally:
        rpc_link.flush(rt)


def _adjoint_half(call: int, context_id: int) -> tuple[torch.Tensor, float]:
    x = _LEAVES.pop(call)
    grad = dist_autograd.get_gradients(context_id)[x]
    return grad, float((x.detach() * grad).sum())


def halo_adjoint(world: World, x: torch.Tensor, grid: Sequence[int], windows: Sequence[Window],
                 seed: int = 0) -> dict:
    """Run F and F^T on ``x`` (global, ``(N, C, *spatial)``) and random windows; return both sides."""
    grid, shape = tuple(grid), tuple(x.shape[2:])
    call = next(_probe_calls)
    gen = torch.Generator().manual_seed(seed)
    ys = []
    for coord in all_coords(grid):
        plan = halo_plan(shape, grid, coord, windows)
        size = [hi - lo + p0 + p1 for (lo, hi), (p0, p1) in zip(plan.need, plan.pad)]
        ys.append(torch.randn(*x.shape[:2], *size, generator=gen, dtype=x.dtype))
    xs = split_shards(x, grid)
    with world.autograd_context() as ctx:
        futures = [rpc.rpc_async(n, _exchange, args=(call, grid, shape, tuple(windows), xi, yi),
                                 timeout=world.rpc_timeout)
                   for n, xi, yi in zip(world.names, xs, ys)]
        results = world.wait(futures, "halo adjoint forward")
        forward = sum(r[1] for r in results)
        dist_autograd.backward(ctx, [forward])
        back = world.wait([rpc.rpc_async(n, _adjoint_half, args=(call, ctx), timeout=world.rpc_timeout)
                           for n in world.names],
                          "halo adjoint backward")
    return {
        "windows": [r[0] for r in results],
        "dual_windows": ys,
        "forward_inner": forward.detach().item(),
        "adjoint_inner": sum(b[1] for b in back),
        "adjoint_grads": [b[0] for b in back],
    }
