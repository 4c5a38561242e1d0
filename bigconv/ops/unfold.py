"""``Tensor.unfold`` of a sharded dim: the overlapping blocks of halo attention, a halo exchange.

``x.unfold(dim, size, step)`` replaces ``dim`` (``n`` positions) by the ``(n - size) // step + 1``
windows that start every ``step`` positions, and appends a dim of ``size`` holding each window's
positions. Along a spatial dim that is sharded, the windows are a map of their own, balanced over the
shards as any map is: each shard computes its windows from the input range they read, joined from
the owners by the exchange a convolution of kernel ``size`` and stride ``step`` uses (``region_op``;
backward returns each halo's gradient to its owner). So timm's ``HaloAttn`` (``F.pad`` by the halo,
then ``unfold(2, block + 2 * halo, block)`` twice: each block's keys with a halo around it) gets the
same windows as its queries' block partition (``bigconv.ops.windows``), shard by shard, and the
attention inside each block is per window. Along a batch or channel dim it is local.

A map with fewer windows than shards along the unfolded dim is gathered whole, unfolded on every
shard, and marked as windows held whole (``bigconv.ops.windows.on_whole``), as a window partition of
such a map is.

``F.unfold`` (im2col: ``(N, C * kh * kw, L)``, one column per output position) is the same exchange
with a convolution's window (kernel, dilation, padding, stride): each shard's columns are its own
output positions, flattened in its own order as ``x.flatten(2)`` flattens them (``bigconv.ops.
positions``), so a reshape back into ``(N, C * kh * kw, H', W')`` is this shard's part of the map.

``F.fold`` (col2im, ``nn.Fold``), its inverse, sums every block that covers an output: on shards, the
columns (each shard's own blocks) are a map of the blocks, and each block writes as an input of a
transposed convolution of the same window does (``TransposedWindow``), so each shard gathers the columns
of every block that reaches its outputs and folds them (``region_op``; backward returns each column's
gradient to its owner): overlaps across shards summed as one process sums them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..geometry.boxes import TransposedWindow, Window
from .context import RuleContext
from .dims import neg_dims, nonneg_dims
from .shards import (
    REPLICATED_ATTR, WHOLE_WINDOWS_ATTR, WindowGrid, bind, global_shape, mark, mark_positions, ntuple, positions,
)

RULES: dict = {}
"""This module's rules for calls with a sharded argument (merged by ``bigconv.ops.table``)."""
WHOLE_RULES: dict = {}
LAYOUT_AWARE: set = set()
PROPERTY_RULES: dict = {}
POSITION_RULES: dict = {}
"""Rules for calls given flattened positions: ``F.fold`` of columns (merged by ``bigconv.ops.table``)."""


def _unfold(mode: RuleContext, func, args, kwargs):
    b = bind(("input", "dimension", "size", "step"), args, kwargs)
    x, shape = b["input"], global_shape(b["input"])
    dim, size, step = b["dimension"] % x.dim(), int(b["size"]), int(b["step"])
    layout = mode.layout(x)
    spatial = nonneg_dims(layout, x.dim())
    out_layout = neg_dims(spatial, x.dim() + 1)  # the window's positions are appended last
    if dim not in spatial:
        return mark(x.unfold(dim, size, step), shape, out_layout)
    axis = spatial.index(dim)
    n = shape[axis]
    if size > n:
        return x.unfold(dim, size, step)  # torch's own error, with its own words
    out_shape = list(shape)
    out_shape[axis] = (n - size) // step + 1
    out_shape = tuple(out_shape)
    order = [d for d in range(x.dim()) if d not in spatial] + spatial  # spatial dims last, in grid order
    inverse = [order.index(d) for d in range(x.dim())] + [x.dim()]
    first = x.dim() - mode.dims
    moved = mark(x.permute(order), shape)

    def local(t: torch.Tensor) -> torch.Tensor:  # the window dim appended last: spatial dims stay put
        return t.unfold(first + axis, size, step)

    if not mode.executor.fits(out_shape):  # fewer windows than shards: the whole map's windows on every shard
        out = local(mode.executor.gather_all(moved, shape)).permute(inverse)
        setattr(out, WHOLE_WINDOWS_ATTR, (tuple(out_shape), tuple(layout), x.dim() + 1))
        return out
    windows = [Window(size, step, 1, 0, 0) if a == axis else Window(1, 1, 1, 0, 0) for a in range(mode.dims)]
    out = mode.executor.region_op(moved, shape, windows, lambda region, plan: local(region), mode.where())
    return mark(out.permute(inverse), out_shape, out_layout)


def _im2col(mode: RuleContext, func, args, kwargs):
    b = bind(("input", "kernel_size", "dilation", "padding", "stride"), args, kwargs)
    x, shape = b["input"], global_shape(b["input"])
    if mode.dims != 2 or x.dim() != 4:
        raise mode.unsupported(func, f"it unfolds a {x.dim()}D input on a {mode.dims}D grid (F.unfold is 2D)",
                               "Unfold a (N, C, H, W) map on a 2D grid, or use Tensor.unfold per dim")
    kernel, dilation = ntuple(b["kernel_size"], 2), ntuple(b.get("dilation", 1), 2)
    padding, stride = ntuple(b.get("padding", 0), 2), ntuple(b.get("stride", 1), 2)
    windows = [Window(k, s, d, p, p) for k, s, d, p in zip(kernel, stride, dilation, padding)]
    out_shape = tuple(w.out_size(n) for w, n in zip(windows, shape))
    n, c = x.shape[:2]

    def columns(region: torch.Tensor, pad=(0, 0)) -> torch.Tensor:  # as a map: (N, C * kh * kw, H', W')
        cols = F.unfold(region, kernel, dilation, pad, stride)
        size = [(m + 2 * p - d * (k - 1) - 1) // s + 1
                for m, p, d, k, s in zip(region.shape[2:], pad, dilation, kernel, stride)]
        return cols.reshape(n, cols.shape[1], *size)

    if not mode.executor.fits(out_shape):  # fewer positions than shards: whole on every shard
        out = mode.windowed_whole(x, shape, out_shape, lambda t: columns(t, padding))
        whole = out.reshape(n, out.shape[1], -1)
        setattr(whole, REPLICATED_ATTR, True)
        return whole
    out = mode.executor.region_op(x, shape, windows, lambda region, plan: columns(region), mode.where())
    return mark_positions(out.reshape(n, out.shape[1], -1), WindowGrid(out_shape), -1)


def _fold(mode: RuleContext, func, args, kwargs):
    """``F.fold`` (col2im, ``nn.Fold``) of columns that are an image's flattened positions, one per block
    (``F.unfold``'s own, or a map's ``flatten(2)``): the inverse of unfold, each output summing every block that covers it. A block
    writes like an input of a transposed convolution of the same window (``TransposedWindow``): each shard gathers
    the columns of every block that reaches its outputs from their owners (``region_op``), folds them and keeps its
    own part, so overlaps are summed across shards as one process sums them; backward returns each column's
    gradient to its owner."""
    b = bind(("input", "output_size", "kernel_size", "dilation", "padding", "stride"), args, kwargs)
    x = b["input"]
    shape, dim = positions(x)
    if mode.dims != 2 or x.dim() != 3:
        raise mode.unsupported(func, f"it folds a {x.dim()}D input on a {mode.dims}D grid (F.fold makes 2D maps)",
                               "Fold (N, C * kh * kw, L) columns into a map on a 2D grid")
    out_size, kernel = ntuple(b["output_size"], 2), ntuple(b["kernel_size"], 2)
    dilation, padding = ntuple(b.get("dilation", 1), 2), ntuple(b.get("padding", 0), 2)
    stride = ntuple(b.get("stride", 1), 2)
    blocks = tuple((o + 2 * p - d * (k - 1) - 1) // s + 1
                   for o, p, d, k, s in zip(out_size, padding, dilation, kernel, stride))
    if (dim % x.dim() != 2 or tuple(shape) != blocks or getattr(shape, "lead", 1) * getattr(shape, "trail", 1) != 1
            or getattr(shape, "prefix", 0)):
        raise mode.unsupported(func, f"its columns are not the {blocks} blocks of its window flattened in the last dim "
                               f"(they hold an image's positions {shape!r} in dim {dim})", "Fold the columns of "
                               "F.unfold with the same window, or a (N, C * kh * kw, bh, bw) map's flatten(2)")
    windows = [TransposedWindow(k, s, d, p, o - TransposedWindow(k, s, d, p).out_size(m))
               for k, s, d, p, o, m in zip(kernel, stride, dilation, padding, out_size, blocks)]
    n, ckk = x.shape[:2]
    c = ckk // (kernel[0] * kernel[1])
    local = mark(x.reshape(n, ckk, *mode.executor.local_shape(blocks)), blocks)

    def op(region, plan):
        size = tuple(b_ - a for a, b_ in plan.out_box)
        if region is None:  # only output padding here: no block writes into this shard
            return x.new_zeros((n, c, *size))
        extent = [(m - 1) * s + d * (k - 1) + 1 for m, s, d, k in zip(region.shape[2:], stride, dilation, kernel)]
        out = F.fold(region.reshape(n, ckk, -1), extent, kernel, dilation, 0, stride)
        pads = []
        for w, (o0, o1), (i0, _), have in zip(windows, plan.out_box, plan.need, extent):
            start = o0 - w.output_origin(i0)
            pads.append((start, have - start - (o1 - o0)))
        return F.pad(out, [-p for lo_hi in reversed(pads) for p in lo_hi])  # crop; a positive high pad: no block

    if not mode.executor.fits(tuple(out_size)):
        raise mode.unsupported(func, f"its output {tuple(out_size)} is smaller than the grid", "Use fewer shards")
    return mark(mode.executor.region_op(local, blocks, windows, op, mode.where(), fill=None), tuple(out_size))


RULES[torch.Tensor.unfold] = _unfold
LAYOUT_AWARE.add(torch.Tensor.unfold)
RULES[F.unfold] = _im2col
POSITION_RULES[F.fold] = _fold
