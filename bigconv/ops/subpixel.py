"""Rules for sub-pixel layers: ``pixel_shuffle`` (depth to space) and ``pixel_unshuffle`` (space to depth).

Each output pixel reads one input pixel, so both are windowed ops without arithmetic: the shard
of ``pixel_shuffle``'s output (balanced over the grid, like every tensor) reads input rows
``o // r``, the arithmetic of a transposed convolution with kernel = stride = r; a shard of
``pixel_unshuffle``'s output reads input rows ``[o * r, o * r + r)``, a window with kernel = stride
= r. ``region_op`` joins those rows from their owners, so shard borders need not fall on multiples
of the factor: an uneven grid is fixed up by the same exchange that carries convolution halos.
PyTorch's ops are 2D only (they act on the last two dims), so both need a 2D grid.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..geometry.boxes import TransposedWindow, Window
from .context import RuleContext
from .shards import bind, global_shape, mark, trailing, with_input


RULES: dict = {}
"""This module's rules for calls with a sharded argument (merged by ``bigconv.ops.table``)."""
WHOLE_RULES: dict = {}
"""Its rules for calls without one that may build a sharded result."""
LAYOUT_AWARE: set = set()
"""The functions among them whose rules handle spatial dims wherever they are (none: both need them last)."""
PROPERTY_RULES: dict = {}
"""Its rules for tensor attributes, by name."""


def _factor(mode: RuleContext, func, args, kwargs, name: str) -> int:
    b = bind(("input", name), args, kwargs)
    if mode.dims != 2:
        raise mode.unsupported(func, f"PyTorch's {func.__name__} rearranges the last two dims, but the grid has "
                               f"{mode.dims} spatial dims", "Use it on a 2D image with a 2D grid")
    return int(b[name])


def _pixel_shuffle(mode: RuleContext, func, args, kwargs):
    """Depth to space: out[c, h*r + i, w*r + j] = in[c*r*r + i*r + j, h, w]."""
    r = _factor(mode, func, args, kwargs, "upscale_factor")
    x = args[0] if args else kwargs["input"]
    shape = global_shape(x)
    windows = [TransposedWindow(r, r)] * 2
    out_shape = tuple(w.out_size(n) for w, n in zip(windows, shape))
    if x.dim() < 3 or x.shape[-3] % (r * r):
        return func(*args, **kwargs)  # PyTorch's own error
    if not mode.executor.fits(out_shape):
        return mode.windowed_whole(x, shape, out_shape, with_input(func, args, kwargs))

    def op(region, plan):
        out = func(region, r)
        crop = []
        for axis in reversed(range(2)):  # F.pad lists the last dim first
            (o0, o1), (i0, _) = plan.out_box[axis], plan.need[axis]
            start = o0 - i0 * r
            crop += [-start, -(out.shape[out.dim() - 2 + axis] - start - (o1 - o0))]
        return F.pad(out, crop)

    return mark(mode.executor.region_op(x, shape, windows, op, mode.where(), fill=None), out_shape)


def _pixel_unshuffle(mode: RuleContext, func, args, kwargs):
    """Space to depth: out[c*r*r + i*r + j, h, w] = in[c, h*r + i, w*r + j]."""
    r = _factor(mode, func, args, kwargs, "downscale_factor")
    x = args[0] if args else kwargs["input"]
    shape = global_shape(x)
    if any(n % r for n in shape):
        raise mode.unsupported(func, f"the image's spatial shape {shape} is not a multiple of the factor {r}",
                               "Pad or crop the image to a multiple of the factor first")
    windows = [Window(r, r)] * 2
    out_shape = tuple(n // r for n in shape)
    if not mode.executor.fits(out_shape):
        return mode.windowed_whole(x, shape, out_shape, with_input(func, args, kwargs))
    return mark(mode.executor.region_op(x, shape, windows, lambda region, plan: func(region, r), mode.where()),
                out_shape)


RULES[F.pixel_shuffle] = _pixel_shuffle
RULES[F.pixel_unshuffle] = _pixel_unshuffle


# -- the same rearrangements written as reshapes and permutes (MONAI's pixelshuffle, timm's SpaceToDepth) --
def _interleave(lead: int, d: int) -> list[int]:
    """The permutation from (lead, r_1..r_d, n_1..n_d) to (lead, n_1, r_1, ..., n_d, r_d)."""
    return list(range(lead)) + [p for k in range(d) for p in (lead + d + k, lead + k)]


def _gather_factors(lead: int, d: int) -> list[int]:
    """The permutation from (lead, n_1, r_1, ..., n_d, r_d) to (lead, r_1..r_d, n_1..n_d)."""
    return list(range(lead)) + [lead + 2 * k + 1 for k in range(d)] + [lead + 2 * k for k in range(d)]


def block_factors(mode: RuleContext, x: torch.Tensor, target: list) -> tuple[bool, list[int]] | None:
    """(True, r's) for a reshape of (lead, n_1, r_1, ..., n_d, r_d), spatial dims at the n's, into
    (lead, n_1*r_1, ..., n_d*r_d); (False, r's) for one of (lead, n_1, ..., n_d), spatial dims trailing,
    into (lead, n_1/r_1, r_1, ..., n_d/r_d, r_d); else None."""
    shape, d, n = global_shape(x), mode.dims, x.dim()
    spatial = [p % n for p in mode.layout(x)]
    lead = n - 2 * d
    if (lead >= 0 and spatial == [lead + 2 * k for k in range(d)] and len(target) == lead + d
            and list(target[:lead]) == list(x.shape[:lead])
            and all(target[lead + k] == g * x.shape[lead + 2 * k + 1] for k, g in enumerate(shape))):
        return True, [x.shape[lead + 2 * k + 1] for k in range(d)]
    lead = n - d
    if (mode.layout(x) == trailing(d) and len(target) == n + d and list(target[:lead]) == list(x.shape[:lead])
            and all(isinstance(t, int) and t > 0 for t in target[lead:])
            and all(target[lead + 2 * k] * target[lead + 2 * k + 1] == g for k, g in enumerate(shape))
            and any(target[lead + 2 * k + 1] != 1 for k in range(d))):
        return False, [target[lead + 2 * k + 1] for k in range(d)]
    return None


def merge_spatial(mode: RuleContext, func, x, factors: list[int]):
    """``reshape`` of (lead, n_1, r_1, ..., n_d, r_d), spatial dims at the n's, into (lead, n_1*r_1, ...):
    depth to space, as MONAI's ``pixelshuffle`` ends. Output row ``h*r + i`` reads row ``h``, factor ``i``."""
    shape, d = global_shape(x), len(factors)
    lead = x.dim() - 2 * d
    y = x.permute(_gather_factors(lead, d))  # (lead, r..., n...): the spatial dims trailing
    windows = [TransposedWindow(r, r) for r in factors]
    out_shape = tuple(n * r for n, r in zip(shape, factors))

    def shuffle(region):
        out = region.permute(_interleave(lead, d))
        return out.reshape(*out.shape[:lead], *(out.shape[lead + 2 * k] * r for k, r in enumerate(factors)))

    if not mode.executor.fits(out_shape):
        return mode.windowed_whole(y, shape, out_shape, shuffle)

    def op(region, plan):
        out = shuffle(region)
        for k, (r, (o0, o1), (i0, _)) in enumerate(zip(factors, plan.out_box, plan.need)):
            out = out.narrow(lead + k, o0 - i0 * r, o1 - o0)
        return out

    return mark(mode.executor.region_op(y, shape, windows, op, mode.where(), fill=None), out_shape)


def split_spatial(mode: RuleContext, func, x, factors: list[int]):
    """``view`` of (lead, n_1, ..., n_d), spatial dims trailing, as (lead, n_1/r_1, r_1, ..., n_d/r_d, r_d):
    space to depth, as timm's ``SpaceToDepth`` begins. The result's spatial dims are the n/r's, and the
    shard borders of that image fall on multiples of r of the input, wherever the input's fell."""
    shape, d = global_shape(x), len(factors)
    lead = x.dim() - d
    out_shape = tuple(n // r for n, r in zip(shape, factors))
    if not mode.executor.fits(out_shape):
        raise mode.unsupported(func, f"it splits the spatial dims {shape} into blocks of {tuple(factors)}, leaving "
                               "fewer positions than the grid has shards", "Use a smaller grid for this image")

    if lead == 0:
        raise mode.unsupported(func, "it splits the spatial dims of a tensor without batch or channel dims",
                               "Keep the batch and channel dims when splitting")
    blocks = 1
    for r in factors:
        blocks *= r

    def op(region, plan):
        split = region.reshape(*region.shape[:lead], *(v for n, r in zip(region.shape[lead:], factors)
                                                       for v in (n // r, r)))
        split = split.permute(_gather_factors(lead, d))  # (lead, r..., n/r...)
        # region_op joins its pieces along the input's spatial dims: keep the input's rank, the
        # factors folded into the last lead dim
        return split.reshape(*split.shape[: lead - 1], -1, *split.shape[lead + d:])

    y = mode.executor.region_op(x, shape, [Window(r, r) for r in factors], op, mode.where())
    y = y.reshape(*y.shape[: lead - 1], x.shape[lead - 1], *factors, *y.shape[lead:])
    out = y.permute(_interleave(lead, d))
    return mark(out, out_shape, [lead + 2 * k - out.dim() for k in range(d)])
