"""Rules for windowed ops beyond convolution: pooling, transposed convolution, padding, upsampling.

Each rule computes, for this shard's part of the output, exactly what a single process computes
there: the input it reads is joined from its owners (``region_op``, ``index_map``), and the global
image border is reproduced explicitly (``-inf`` for max pooling, global divisors for average
pooling, output padding for transposed convolution). A result whose spatial size would be smaller
than the grid is computed whole on every worker instead (see ``ShardMode.windowed_whole``).
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ..geometry.boxes import TransposedWindow, Window, shard_box
from ..geometry.index_maps import PadMap, Resize, resize_sizes
from .context import RuleContext
from .reduce import sum_mean
from .shards import UnsupportedOperation, bind, global_shape, mark, ntuple, trailing, with_input


RULES: dict = {}
"""This module's rules for calls with a sharded argument (merged by ``bigconv.ops.table``)."""
WHOLE_RULES: dict = {}
"""Its rules for calls without one that may build a sharded result."""
LAYOUT_AWARE: set = set()
"""The functions among them whose rules handle spatial dims wherever they are."""
PROPERTY_RULES: dict = {}
"""Its rules for tensor attributes, by name."""


def conv_windows(kernel: Sequence[int], stride, padding, dilation) -> list[Window]:
    """One ``Window`` per dim of a convolution (``'same'``, ``'valid'`` or numbers): the run's and
    ``bigconv.check``'s."""
    n = len(kernel)
    expand = lambda v: [v] * n if isinstance(v, int) else list(v)  # noqa: E731
    stride, dilation = expand(stride), expand(dilation)
    windows = []
    for k, s, d, p in zip(kernel, stride, dilation, expand(0 if padding == "valid" else padding)
                          if not padding == "same" else [None] * n):
        if p is None:  # 'same': PyTorch puts the odd extra pad on the high side
            total = d * (k - 1)
            windows.append(Window(k, s, d, total // 2, total - total // 2))
        else:
            windows.append(Window(k, s, d, p, p))
    return windows


def _conv(mode: RuleContext, func, args, kwargs):
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    b = dict(zip(names, args), **kwargs)
    x, weight = b["input"], b["weight"]
    shape = global_shape(x)
    if shape is None or global_shape(weight) is not None:
        raise mode.unsupported(func, "its weight is sharded", "Convolve a sharded input with an ordinary weight.")
    stride, dilation, groups = b.get("stride", 1), b.get("dilation", 1), b.get("groups", 1)
    windows = conv_windows(weight.shape[2:], stride, b.get("padding", 0), dilation)
    if len(windows) != mode.dims:
        raise mode.unsupported(func, f"it is {len(windows)}D on a {mode.dims}D grid",
                               "Use a grid with one axis per spatial dim.")

    def op(region: torch.Tensor, padding=0, bias: bool = True) -> torch.Tensor:
        return func(region, weight, b.get("bias") if bias else None, stride, padding, dilation, groups)

    out_shape = tuple(w.out_size(n) for w, n in zip(windows, shape))
    if all(m > 0 for m in out_shape) and not mode.executor.fits(out_shape):
        return mode.windowed_whole(x, shape, out_shape, with_input(func, args, kwargs))
    return mode.executor.windowed(x, shape, windows, op, mode.where())



def _pool_windows(mode: RuleContext, b: dict, dilation=1) -> list[Window]:
    n = mode.dims
    kernel = ntuple(b["kernel_size"], n)
    stride = ntuple(b.get("stride") or kernel, n)  # PyTorch: stride None or [] means the kernel size
    padding, dilation = ntuple(b.get("padding", 0), n), ntuple(dilation, n)
    ceil = bool(b.get("ceil_mode", False))
    return [Window(k, s, d, p, p, ceil) for k, s, d, p in zip(kernel, stride, dilation, padding)]


def _out_shape(windows, shape):
    return tuple(w.out_size(n) for w, n in zip(windows, shape))


_MAX_NAMES = ("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")


def _max_pool(mode: RuleContext, func, args, kwargs):
    b = bind(_MAX_NAMES, args, kwargs)
    x, shape = b["input"], global_shape(b["input"])
    if b.get("return_indices", False) or "with_indices" in getattr(func, "__name__", ""):
        raise mode.unsupported(func, "its indices are positions in the whole image, which no shard holds",
                               "Use return_indices=False (MaxUnpool is not supported)")
    windows = _pool_windows(mode, b, b.get("dilation", 1))
    out_shape = _out_shape(windows, shape)
    whole = with_input(func, args, kwargs)
    if not mode.executor.fits(out_shape):
        return mode.windowed_whole(x, shape, out_shape, whole)

    def op(region, plan):
        k = [w.kernel for w in windows]
        s = [w.stride for w in windows]
        d = [w.dilation for w in windows]
        return func(region, k, s, 0, d, False)

    return mark(mode.executor.region_op(x, shape, windows, op, mode.where(), fill=-math.inf), out_shape)


_AVG_NAMES = ("input", "kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override")


def _divisors(windows, shape, out_box, count_include_pad: bool) -> list[list[int]]:
    """Per dim, how many positions each output of ``out_box`` averages over (PyTorch's rule)."""
    per_dim = []
    for w, n, (o0, o1) in zip(windows, shape, out_box):
        counts = []
        for o in range(o0, o1):
            start = o * w.stride - w.pad_lo
            end = min(start + w.kernel, n + w.pad_hi)
            counts.append(end - start if count_include_pad else min(end, n) - max(start, 0))
        per_dim.append(counts)
    return per_dim


def _avg_pool(mode: RuleContext, func, args, kwargs):
    b = bind(_AVG_NAMES, args, kwargs)
    x, shape = b["input"], global_shape(b["input"])
    windows = _pool_windows(mode, b)
    out_shape = _out_shape(windows, shape)
    whole = with_input(func, args, kwargs)
    if not mode.executor.fits(out_shape):
        return mode.windowed_whole(x, shape, out_shape, whole)
    count_include_pad = b.get("count_include_pad", True)
    override = b.get("divisor_override")

    def op(region, plan):
        k = [w.kernel for w in windows]
        # The local window has no padding, so it averages over the whole kernel; rescale to the
        # divisor the single process uses at this output (different near the border).
        out = func(region, k, [w.stride for w in windows], 0, False, True)
        volume = math.prod(k)
        if override:
            return out * (volume / override)
        divisor, uniform = None, 1
        for axis, counts in enumerate(_divisors(windows, shape, plan.out_box, count_include_pad)):
            if all(c == counts[0] for c in counts):
                uniform *= counts[0]
                continue
            view = [1] * out.dim()
            view[out.dim() - mode.dims + axis] = -1
            t = _constant(tuple(counts), out.dtype, out.device).view(view)
            divisor = t if divisor is None else divisor * t
        if divisor is None:
            return out if uniform == volume else out * (volume / uniform)
        return out * (volume / (divisor * uniform))

    return mark(mode.executor.region_op(x, shape, windows, op, mode.where(), fill=0.0), out_shape)


def _adaptive(mode: RuleContext, func, args, kwargs, kind: str):
    x = args[0]
    shape = global_shape(x)
    size = args[1] if len(args) > 1 else kwargs["output_size"]
    sizes = [size] * mode.dims if isinstance(size, int) or size is None else list(size)
    sizes = [n if s is None else s for s, n in zip(sizes, shape)]
    return_indices = (args[2] if len(args) > 2 else kwargs.get("return_indices", False)) if kind == "max" else False
    if return_indices:
        raise mode.unsupported(func, "its indices are positions in the whole image, which no shard holds",
                               "Use return_indices=False")
    whole = with_input(func, args, kwargs)
    if all(s == 1 for s in sizes) and kind == "avg":
        spatial = list(range(x.dim() - mode.dims, x.dim()))
        return sum_mean(mode, torch.mean, (x, spatial, True), {}, mean=True)
    if all(n % s == 0 for n, s in zip(shape, sizes)):
        # Equal windows: adaptive pooling is plain pooling with kernel = stride = n / size.
        kernel = [n // s for n, s in zip(shape, sizes)]
        plain = {1: (F.avg_pool1d, F.max_pool1d), 2: (F.avg_pool2d, F.max_pool2d),
                 3: (F.avg_pool3d, F.max_pool3d)}[mode.dims][kind == "max"]
        rule = _avg_pool if kind == "avg" else _max_pool
        return rule(mode, plain, (x, kernel, kernel), {})
    # Unequal windows overlap irregularly: compute on the whole (small) map, on every worker.
    return mode.windowed_whole(x, shape, tuple(sizes), whole)


_CONVT_NAMES = ("input", "weight", "bias", "stride", "padding", "output_padding", "groups", "dilation")


def _conv_transpose(mode: RuleContext, func, args, kwargs):
    b = bind(_CONVT_NAMES, args, kwargs)
    x, weight, bias = b["input"], b["weight"], b.get("bias")
    shape = global_shape(x)
    n = mode.dims
    if weight.dim() - 2 != n:
        raise mode.unsupported(func, f"it is {weight.dim() - 2}D on a {n}D grid",
                               "Use a grid with one axis per spatial dim.")
    kernel = weight.shape[2:]
    stride, padding = ntuple(b.get("stride", 1), n), ntuple(b.get("padding", 0), n)
    out_pad, dilation = ntuple(b.get("output_padding", 0), n), ntuple(b.get("dilation", 1), n)
    groups = b.get("groups", 1)
    windows = [TransposedWindow(k, s, d, p, op) for k, s, d, p, op in zip(kernel, stride, dilation, padding, out_pad)]
    out_shape = _out_shape(windows, shape)
    whole = with_input(func, args, kwargs)
    if not mode.executor.fits(out_shape):
        return mode.windowed_whole(x, shape, out_shape, whole)

    def op(region, plan):
        lead = x.shape[: x.dim() - n]
        size = tuple(b_ - a for a, b_ in plan.out_box)
        if region is None:  # only output padding here: no input writes into this shard
            out = weight.new_zeros((*lead[:-1], weight.shape[1] * groups, *size))
        else:
            out = func(region, weight, None, stride, 0, 0, groups, dilation)
            pads = []
            for axis, (w, (o0, o1), (i0, _)) in enumerate(zip(windows, plan.out_box, plan.need)):
                start = o0 - w.output_origin(i0)
                have = out.shape[out.dim() - n + axis]
                pads.append((start, have - start - (o1 - o0)))
            # Negative pads crop; a positive high pad is the output padding, which no input reaches.
            out = F.pad(out, [-p for lo_hi in reversed(pads) for p in lo_hi])
        if bias is not None:
            out = out + bias.view(-1, *([1] * n))
        return out

    return mark(mode.executor.region_op(x, shape, windows, op, mode.where(), fill=None), out_shape)


def _constant(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small index or weight tensor that depends on geometry only, made once per device and dtype.

    Built from a Python list on every call it is a host-to-device copy (a sync on CUDA) in the hot path.
    Under a tracer (``torch.compile``, a fake or other dispatch mode) it is built afresh, so no traced
    tensor is kept.
    """
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return torch.tensor(values, dtype=dtype, device=device)
    return _cached_constant(values, dtype, device)


@functools.lru_cache(maxsize=4096)
def _cached_constant(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Made outside inference mode, so a tensor first built while predicting can still be saved for a
    # later backward; callers only read it.
    with torch.inference_mode(False):
        return torch.tensor(values, dtype=dtype, device=device)


def _apply_taps(region: torch.Tensor, taps, dims: int) -> torch.Tensor:
    out = region
    for axis, axis_taps in enumerate(taps):
        dim = out.dim() - dims + axis
        total = None
        for idx, weights in axis_taps:
            index = _constant(tuple(idx), torch.long, out.device)
            picked = out.index_select(dim, index)
            if weights is not None:
                view = [1] * out.dim()
                view[dim] = -1
                picked = picked * _constant(tuple(weights), out.dtype, out.device).view(view)
            total = picked if total is None else total + picked
        out = total
    return out


def _index_map(mode: RuleContext, x, shape, maps, whole):
    out_shape = tuple(m.n_out for m in maps)
    if not mode.executor.fits(out_shape):
        return mode.windowed_whole(x, shape, out_shape, whole)
    out = mode.executor.index_map(x, shape, maps, lambda r, t: _apply_taps(r, t, mode.dims), mode.where())
    return mark(out, out_shape)


_PAD_NAMES = ("input", "pad", "mode", "value")


def _pad(mode: RuleContext, func, args, kwargs):
    b = bind(_PAD_NAMES, args, kwargs)
    x, shape = b["input"], global_shape(b["input"])
    pad, kind = list(b["pad"]), b.get("mode", "constant") or "constant"
    value = b.get("value") or 0.0
    whole = with_input(func, args, kwargs)
    if len(pad) % 2 or len(pad) // 2 > x.dim():
        return whole(x)  # let PyTorch raise its own error
    if tuple(mode.layout(x)) != trailing(mode.dims):
        return _pad_moved(mode, func, x, shape, pad, kind, value)
    per_dim = [(0, 0)] * (x.dim() - len(pad) // 2) + [(pad[2 * i], pad[2 * i + 1]) for i in
                                                        reversed(range(len(pad) // 2))]
    lead, spatial = per_dim[: x.dim() - mode.dims], per_dim[x.dim() - mode.dims:]
    if any(p != (0, 0) for p in lead):
        if kind == "constant" and all(p == (0, 0) for p in spatial):  # channel padding (HighResNet): per position
            return mode.tag_outputs(whole(x), shape)
        raise mode.unsupported(func, "it pads the batch or channel dims and the spatial dims of a sharded tensor at once",
                               "Pad channels and spatial dims in two calls.")
    if kind == "constant":
        windows = [Window(1, 1, 1, lo, hi) for lo, hi in spatial]
        out_shape = _out_shape(windows, shape)
        if not mode.executor.fits(out_shape):
            return mode.windowed_whole(x, shape, out_shape, whole)
        def take(region, plan):
            if region is None:  # this shard's part is all padding (Swin v2 pads a 4x4 map to a window of 8)
                box = [b - a for a, b in plan.out_box]
                return torch.full((*x.shape[: x.dim() - mode.dims], *box), value, dtype=x.dtype, device=x.device)
            return region

        out = mode.executor.region_op(x, shape, windows, take, mode.where(), fill=value)
        # A shard whose part needs no padding gets its input back: mark a view, never the input
        # itself, which other code still holds with its own global shape (smp's EfficientNet returns
        # its input as the first feature after padding it).
        return mark(out.view_as(out) if out is x else out, out_shape)
    if any(lo < 0 or hi < 0 for lo, hi in spatial):
        raise mode.unsupported(func, f"negative padding in mode {kind!r}", "Crop with mode='constant' first.")
    if kind == "reflect" and any(max(lo, hi) >= n for (lo, hi), n in zip(spatial, shape)):
        return whole(x)  # PyTorch's own error: reflection needs padding < size
    maps = [PadMap(n, lo, hi, kind) for (lo, hi), n in zip(spatial, shape)]
    return _index_map(mode, x, shape, maps, whole)


def _pad_moved(mode: RuleContext, func, x, shape, pad: list, kind: str, value):
    """``F.pad`` of a map whose spatial dims are not last (Swin pads a channels-last map): the same
    padding with the spatial dims moved last, and moved back."""
    per_dim = [(0, 0)] * (x.dim() - len(pad) // 2) + [(pad[2 * i], pad[2 * i + 1])
                                                      for i in reversed(range(len(pad) // 2))]
    layout = mode.layout(x)
    spatial = [d % x.dim() for d in layout]
    order = [d for d in range(x.dim()) if d not in spatial] + spatial
    moved_pad = [p for d in reversed(order) for p in per_dim[d]]
    out = _pad(mode, func, (mark(x.permute(order), shape), moved_pad, kind, value), {})
    return mark(out.permute([order.index(d) for d in range(x.dim())]), global_shape(out), layout)


_INTERP_NAMES = ("input", "size", "scale_factor", "mode", "align_corners", "recompute_scale_factor", "antialias")
_LINEAR = {"linear": 1, "bilinear": 2, "trilinear": 3}
_CUBIC = {"bicubic": 2}
_MODES = "'nearest', 'nearest-exact', 'linear', 'bilinear', 'trilinear' or 'bicubic'"


def _resize_maps(mode: RuleContext, func, args, kwargs, shape):
    """One ``Resize`` per spatial dim for ``F.interpolate`` of a map of spatial ``shape``; None for a mode of the
    wrong rank (PyTorch's own error follows). Refused: other modes, antialiased downsampling, antialiased bicubic
    (another kernel, renormalized at the border)."""
    b = bind(_INTERP_NAMES, args, kwargs)
    kind = b.get("mode", "nearest")
    if kind not in ("nearest", "nearest-exact") and kind not in _LINEAR and kind not in _CUBIC:
        raise mode.unsupported(func, f"mode {kind!r} is not supported on sharded tensors", f"Use mode {_MODES}")
    if {**_LINEAR, **_CUBIC}.get(kind, mode.dims) != mode.dims:
        return None  # PyTorch's own error for a mode of the wrong rank
    sizes, scales = resize_sizes(shape, b.get("size"), b.get("scale_factor"), b.get("recompute_scale_factor"))
    if b.get("antialias") and kind in _CUBIC:
        raise mode.unsupported(func, "antialiased bicubic resampling of a sharded map (another kernel, A = -0.5, its "
                               "taps renormalized at the border) is not split", "Use antialias=False (the 2-pixel "
                               "halo of plain bicubic), or resample a whole small tensor (a position embedding), "
                               "which every shard computes whole and cuts")
    if b.get("antialias") and any(s < n for s, n in zip(sizes, shape)):
        raise mode.unsupported(func, "antialiased downsampling", "Use antialias=False, or pool instead")
    tap_mode = "linear" if kind in _LINEAR else "cubic" if kind in _CUBIC else kind
    return [Resize(n, s, tap_mode, bool(b.get("align_corners")), sc) for n, s, sc in zip(shape, sizes, scales)]


def _interpolate(mode: RuleContext, func, args, kwargs):
    x = args[0] if args else kwargs["input"]
    shape = global_shape(x)
    maps = _resize_maps(mode, func, args, kwargs, shape)
    whole = with_input(func, args, kwargs)
    return whole(x) if maps is None else _index_map(mode, x, shape, maps, whole)


def _first_copy(mode: RuleContext, out: torch.Tensor) -> torch.Tensor:
    """``out``, a whole result every shard computed alike, as shard 0's copy (an all-gather from it; the others
    send one element). Its backward brings every shard's cotangent to shard 0, which assembles the whole one (each
    element from one shard: exact in any dtype) and runs the op's backward once, as one process does. Summing
    each shard's own backward instead rounds differently where the op runs in float32 inside a float64 model
    (timm's ``resample_abs_pos_embed`` casts to float32): 2e-7 in a position embedding's gradient, seen."""
    workers = math.prod(mode.executor.grid)
    if workers == 1:
        return out
    first = all(c == 0 for c in mode.executor.coord)
    flat = out.reshape(-1)
    parts = mode.executor.allgather(flat if first else flat[:1], "whole result from shard 0",
                         [tuple(flat.shape)] + [(1,)] * (workers - 1))
    return parts[0].view(out.shape)


def _interpolate_whole(mode: RuleContext, func, args, kwargs, replicated: bool):
    """A whole map (a pooled context vector, a replicated deep map, a ViT's position embedding) resized to a
    shardable size.

    Each shard evaluates only its own outputs' taps on the whole input it already holds (ASPP's
    image pooling, PSP's pyramid, LRASPP's gate upsampled back to the image): no full-size map is
    built, and no data moves. A mode without taps here (timm's ``resample_abs_pos_embed``: bicubic with
    antialias, in float32) runs whole, torch's own kernel on every shard, and each keeps its part: one
    process's values bit for bit.
    """
    x = args[0] if args else kwargs["input"]
    if x.dim() != mode.dims + 2:
        return func(*args, **kwargs)
    shape = tuple(x.shape[2:])
    b = bind(_INTERP_NAMES, args, kwargs)
    sizes, _ = resize_sizes(shape, b.get("size"), b.get("scale_factor"), b.get("recompute_scale_factor"))
    out_shape = tuple(sizes)
    if not mode.executor.fits(out_shape) or not (replicated or out_shape in mode.known):
        out = func(*args, **kwargs)
        return mode.after_replicated(out) if replicated else out
    try:
        maps = _resize_maps(mode, func, args, kwargs, shape)
    except UnsupportedOperation:  # no taps for it: computed whole, this shard's part kept
        return mark(mode.executor.local_part(_first_copy(mode, func(*args, **kwargs)), out_shape), out_shape)
    if maps is None:
        return func(*args, **kwargs)
    box = shard_box(out_shape, mode.executor.grid, mode.executor.coord)
    taps = [m.taps(o) for m, o in zip(maps, box)]
    return mark(_apply_taps(x, taps, mode.dims), out_shape)


for _f in (F.conv1d, F.conv2d, F.conv3d):
    RULES[_f] = _conv
for _f in (F.max_pool1d, F.max_pool2d, F.max_pool3d, F.max_pool1d_with_indices, F.max_pool2d_with_indices,
           F.max_pool3d_with_indices):
    RULES[_f] = _max_pool
for _f in (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d):
    RULES[_f] = _avg_pool
for _f in (F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d):
    RULES[_f] = lambda mode, func, args, kwargs: _adaptive(mode, func, args, kwargs, "avg")
for _f in (F.adaptive_max_pool1d, F.adaptive_max_pool2d, F.adaptive_max_pool3d):
    RULES[_f] = lambda mode, func, args, kwargs: _adaptive(mode, func, args, kwargs, "max")
for _f in (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d):
    RULES[_f] = _conv_transpose
RULES[F.pad] = _pad
LAYOUT_AWARE.add(F.pad)
RULES[F.interpolate] = _interpolate
WHOLE_RULES[F.interpolate] = _interpolate_whole


def _grid_sample(mode: RuleContext, func, args, kwargs):
    """Refused with its true reason: each output samples the input at positions its grid names (a spatial
    transformer, VoxelMorph's warp), anywhere in the image and known only from the data, so no halo bounds
    what a shard reads."""
    raise mode.unsupported(func, "each output samples the input at positions its grid names, anywhere in the image "
                           "and known only from the data, so no halo bounds what a shard reads",
                           "Apply the warp outside the parallelized model, to its joined output")


RULES[F.grid_sample] = _grid_sample
LAYOUT_AWARE.add(F.grid_sample)
