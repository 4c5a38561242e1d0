"""Slices of spatial dims (crops, strided subsampling): ``x[..., a:b, c:d:2]`` and ``narrow``.

A slice is a window of kernel 1 whose stride is the slice's step and whose (negative) border
padding cuts the image down to ``start .. stop``. The result is re-sharded like every tensor:
balanced over the grid, so a crop taken near one edge of the image moves rows between shards
(``region_op`` carries them) and no shard is left empty. A result smaller than the grid along an
axis is computed whole on every worker, as other small maps are (``ShardMode.windowed_whole``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..geometry.boxes import Window
from .context import RuleContext
from .shards import global_shape, mark, trailing


def spatial_slices(mode: RuleContext, func, index: tuple, spatial: list[int]) -> dict[int, slice] | None:
    """Position in ``index`` -> slice, for the spatial dims it cuts (None when it cuts none)."""
    crops, in_dim = {}, 0
    for pos, i in enumerate(index):
        if i is None:
            continue
        if in_dim in spatial and not (isinstance(i, slice) and i == slice(None)):
            if not isinstance(i, slice):
                raise mode.unsupported(func, "it picks single positions of a spatial dim (an int or tensor index)",
                                       "Slice spatial dims with start:stop:step, or index batch and channel dims only")
            crops[pos] = i
        in_dim += 1
    if not crops:
        return None
    for pos, i in enumerate(index):  # every spatial dim goes to crop(), cut or not
        if i is not None and pos not in crops and sum(j is not None for j in index[:pos]) in spatial:
            crops[pos] = slice(None)
    return crops


def crop(mode: RuleContext, func, x: torch.Tensor, slices: Sequence[slice]) -> torch.Tensor:
    """``x[..., *slices]`` over the spatial dims of sharded ``x`` (which must be trailing)."""
    shape = global_shape(x)
    layout = tuple(mode.layout(x))
    if layout != trailing(mode.dims):
        # A channels-last map (Swin's PatchMerging takes x[..., 0::2, 0::2, :]): the same slices with
        # the spatial dims moved last, and moved back; ``slices`` come in position order.
        if list(layout) != sorted(layout):
            raise mode.unsupported(func, "it slices the spatial dims of a view that reorders them",
                                   "Slice before permuting, or permute back to (N, C, *spatial) first")
        spatial = [d % x.dim() for d in layout]
        order = [d for d in range(x.dim()) if d not in spatial] + spatial
        out = crop(mode, func, mark(x.permute(order), shape), slices)
        back = out.permute([order.index(d) for d in range(x.dim())])
        if global_shape(out) is None:  # smaller than the grid: the whole crop on every shard, as a plain tensor
            return back  # (a join with a sharded map takes this shard's part of it)
        return mark(back, global_shape(out), layout)
    windows, steps, out_shape = [], [], []
    for s, n in zip(slices, shape):
        if s.step is not None and s.step <= 0:
            raise mode.unsupported(func, f"slice step {s.step} is not positive", "Use a positive step")
        start, stop, step = s.indices(n)
        size = len(range(start, stop, step))
        if size == 0:
            raise mode.unsupported(func, f"the slice {s} of a spatial dim of size {n} selects no positions",
                                   "Slice at least one position")
        last = start + (size - 1) * step
        windows.append(Window(1, step, 1, -start, last + 1 - n))
        steps.append(step)
        out_shape.append(size)
    out_shape = tuple(out_shape)
    if out_shape == tuple(shape):
        return mark(x.view_as(x), shape)  # a no-op slice (x[..., 0:H]): nothing moves

    lead = (slice(None),) * (x.dim() - mode.dims)
    every = lead + tuple(slice(None, None, step) for step in steps)

    def whole(t: torch.Tensor) -> torch.Tensor:
        return t[lead + tuple(slices)]

    if not mode.executor.fits(out_shape):
        return mode.windowed_whole(x, shape, out_shape, whole)
    return mark(mode.executor.region_op(x, shape, windows, lambda region, plan: region[every], mode.where()),
                out_shape)
