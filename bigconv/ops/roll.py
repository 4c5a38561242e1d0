"""``torch.roll`` and ``torch.flip`` on sharded dims: index maps of one tap, exchanges exact both ways.

``torch.flip`` of a sharded dim reverses the image along it: the shards' order reversed and each part
flipped, so a shard's outputs read the mirror shard's inputs (``bigconv.geometry.index_maps.Flip``
through the same ``index_map`` exchange; the middle shard of an odd count reads itself). Batch and
channel dims flip locally. ``fliplr``/``flipud`` are flips of dims 1 and 0.

``torch.roll`` on sharded dims: Swin's cyclic shift as a neighbour exchange, exact both ways.

Rolling a sharded dim by ``s`` moves every position ``s`` places, wrapping around the image: each
shard's output reads the ``|s|`` positions before (or after) its own from the neighbouring shard,
and the first and last shards read each other (``bigconv.geometry.index_maps.Roll`` through the
executor's ``index_map``, the exchange circular padding already uses; shifts larger than a shard
read further owners). Batch and channel dims are whole on every shard, so rolling them is local.
Swin rolls a channels-last map (``x.permute(0, 2, 3, 1)``): the spatial dims are moved last for
the exchange and put back, so any layout works.

A roll without ``dims`` flattens the tensor first, mixing positions of every shard in a global
order no shard holds: refused, with the fix.
"""

from __future__ import annotations

import torch

from ..geometry.index_maps import Flip, Roll
from .context import RuleContext
from .shards import bind, global_shape, mark

RULES: dict = {}
"""This module's rules for calls with a sharded argument (merged by ``bigconv.ops.table``)."""
WHOLE_RULES: dict = {}
LAYOUT_AWARE: set = set()
PROPERTY_RULES: dict = {}


def spatial_shifts(mode: RuleContext, func, x: torch.Tensor, shifts, dims) -> tuple[list[int], dict[int, int]]:
    """(each grid axis's shift, the other dims' shifts by non-negative dim), summing repeated dims as
    ``torch.roll`` does."""
    if dims is None or (not isinstance(dims, int) and len(dims) == 0):
        raise mode.unsupported(func, "without dims it rolls the flattened tensor, whose order mixes every shard's "
                               "positions", "Give dims, e.g. torch.roll(x, shifts=(s, s), dims=(2, 3))")
    shifts = [shifts] if isinstance(shifts, int) else list(shifts)
    dims = [dims] if isinstance(dims, int) else list(dims)
    if len(shifts) != len(dims):
        raise mode.unsupported(func, f"{len(shifts)} shifts for {len(dims)} dims", "Give one shift per dim")
    spatial = [d % x.dim() for d in mode.layout(x)]
    by_axis, other = [0] * len(spatial), {}
    for s, d in zip(shifts, dims):
        d = d % x.dim()
        if d in spatial:
            by_axis[spatial.index(d)] += int(s)
        else:
            other[d] = other.get(d, 0) + int(s)
    return by_axis, other


def _roll(mode: RuleContext, func, args, kwargs):
    b = bind(("input", "shifts", "dims"), args, kwargs)
    x, shape = b["input"], global_shape(b["input"])
    by_axis, other = spatial_shifts(mode, func, x, b["shifts"], b.get("dims"))
    layout = mode.layout(x)
    if other:  # batch or channel dims: whole on every shard
        x = torch.roll(x, tuple(other.values()), tuple(other))
    if all(s % n == 0 for s, n in zip(by_axis, shape)):
        return mark(x.view_as(x), shape, layout)
    spatial = [d % x.dim() for d in layout]
    order = [d for d in range(x.dim()) if d not in spatial] + spatial  # spatial dims last, in grid order
    inverse = [order.index(d) for d in range(x.dim())]
    maps = [Roll(n, s % n) for n, s in zip(shape, by_axis)]
    moved = x.permute(order)
    out = mode.executor.index_map(moved, shape, maps, _gather, mode.where())
    return mark(out.permute(inverse), shape, layout)


def _gather(region: torch.Tensor, taps) -> torch.Tensor:
    """The region's positions each output reads (one tap of weight 1 per output, per spatial dim)."""
    out = region
    dims = len(taps)
    for axis, ((index, _),) in enumerate(taps):
        out = out.index_select(out.dim() - dims + axis, torch.tensor(index, dtype=torch.long, device=out.device))
    return out


def _flip(mode: RuleContext, func, args, kwargs):
    name = func.__name__
    x = args[0] if args else kwargs["input"]
    shape, layout = global_shape(x), mode.layout(x)
    if name in ("fliplr", "flipud"):
        dims = [1 if name == "fliplr" else 0]
    else:
        dims = args[1:] if len(args) > 1 else [kwargs["dims"]]
        dims = list(dims[0]) if len(dims) == 1 and isinstance(dims[0], (list, tuple)) else list(dims)
    spatial = [d % x.dim() for d in layout]
    mine = {d % x.dim() for d in dims}
    other = sorted(mine - set(spatial))
    if other:  # batch or channel dims: whole on every shard
        x = torch.flip(x, other)
    if not mine & set(spatial):
        return mark(x.view_as(x), shape, layout)
    order = [d for d in range(x.dim()) if d not in spatial] + spatial  # spatial dims last, in grid order
    inverse = [order.index(d) for d in range(x.dim())]
    maps = [Flip(n) if d in mine else Roll(n, 0) for n, d in zip(shape, spatial)]
    out = mode.executor.index_map(x.permute(order), shape, maps, _gather, mode.where())
    return mark(out.permute(inverse), shape, layout)


RULES[torch.roll] = _roll
RULES[torch.Tensor.roll] = _roll
LAYOUT_AWARE.update((torch.roll, torch.Tensor.roll))
for _f in (torch.flip, torch.Tensor.flip, torch.fliplr, torch.Tensor.fliplr, torch.flipud, torch.Tensor.flipud):
    RULES[_f] = _flip
    LAYOUT_AWARE.add(_f)
