"""Rules for reductions and per-position dense layers.

A reduction over batch or channel dims (``x.mean(1)`` of a spatial attention gate, ``softmax`` over
classes, ``Linear``/``LayerNorm`` over the channels of a channels-last view) runs on the shard as it
is. A reduction over all spatial dims becomes a global one: partial sums summed over every shard,
in worker order so every replica agrees bit for bit; maxima with the single process's gradient
(shared evenly among every position that attains the maximum, wherever it lives). A reduction over
some spatial dims but not all, or ``Linear`` over a spatial dim, mixes positions across shards and is
refused, as are indices into the whole image (``argmax`` over positions).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..geometry.boxes import all_coords, shard_box
from .context import RuleContext
from .dims import int_dims, neg_dims, nonneg_dims
from .layout import pointwise
from .shards import bind, global_shape, mark, mark_positions, trailing

_SOME_SPATIAL_FIX = "Reduce over all spatial dims at once, or over batch and channel dims only"


RULES: dict = {}
"""This module's rules for calls with a sharded argument (merged by ``bigconv.ops.table``)."""
WHOLE_RULES: dict = {}
"""Its rules for calls without one that may build a sharded result."""
LAYOUT_AWARE: set = set()
"""The functions among them whose rules handle spatial dims wherever they are."""
PROPERTY_RULES: dict = {}
"""Its rules for tensor attributes, by name."""


def _after(mode: RuleContext, x: torch.Tensor, reduced: list[int], keepdim: bool) -> tuple[int, ...]:
    """Where the spatial dims of ``x`` are after removing ``reduced`` dims (none of them spatial)."""
    spatial = nonneg_dims(mode.layout(x), x.dim())
    if keepdim:
        return mode.layout(x)
    return neg_dims([p - sum(r < p for r in reduced) for p in spatial], x.dim() - len(reduced))


def _classify(mode: RuleContext, func, x: torch.Tensor, dim) -> tuple[list[int], str]:
    dims = int_dims(dim, x.dim())
    spatial = set(nonneg_dims(mode.layout(x), x.dim()))
    if not spatial & set(dims):
        return dims, "local"
    if not spatial <= set(dims):
        raise mode.unsupported(func, "it reduces some spatial dims but not all", _SOME_SPATIAL_FIX)
    return dims, "global"


def sum_mean(mode: RuleContext, func, args, kwargs, mean: bool):
    b = bind(("input", "dim", "keepdim"), args, kwargs)
    x, keepdim = b["input"], bool(b.get("keepdim", False))
    if set(b) - {"input", "dim", "keepdim", "dtype"}:
        raise mode.unsupported(func, "of unexpected arguments", "Call sum/mean(dim, keepdim).")
    dims, kind = _classify(mode, func, x, b.get("dim"))
    if kind == "local":
        return mode.tag_outputs(func(*args, **kwargs), global_shape(x), _after(mode, x, dims, keepdim))
    extra = {"dtype": b["dtype"]} if "dtype" in b else {}
    total = mode.executor.allsum(torch.sum(x, dim=dims, keepdim=keepdim, **extra))
    if not mean:
        return total
    size = list(x.shape)
    for d, g in zip(mode.layout(x), global_shape(x)):
        size[d] = g
    count = 1
    for d in dims:
        count *= size[d]
    return total / count


def global_extreme(mode: RuleContext, x: torch.Tensor, dims: list[int], keepdim: bool, largest: bool):
    """The maximum (or minimum) over every shard, with ``amax``'s gradient: shared evenly among all
    positions that attain it, wherever they live.

    The value is exact (the largest of the shards' extremes); the gradient rides on a sum that is
    exactly zero in value, ``sum((x - x.detach()) * mask) / count``, summed over every shard
    differentiably, so every replica's use of the value sends its gradient back to every owner.
    """
    pick = torch.amax if largest else torch.amin
    with torch.no_grad():
        parts = mode.executor.allgather(pick(x, dim=dims, keepdim=True), "global extreme")
        value = pick(torch.stack(parts), dim=0)
        mask = x == value
        count = mode.executor.allsum(mask.sum(dim=dims, keepdim=keepdim).to(x.dtype))
        if not keepdim:
            value = value.reshape(count.shape)
    zero = ((x - x.detach()) * mask).sum(dim=dims, keepdim=keepdim)
    return value + mode.executor.allsum(zero) / count


def _extreme(mode: RuleContext, func, args, kwargs):
    """amax/amin (any dims), max/min (no dim: the global value; dim: values and indices, channels only)."""
    name = func.__name__
    largest = name in ("amax", "max")
    x = args[0]
    if name in ("max", "min"):
        b = bind(("input", "dim", "keepdim"), args, kwargs)
        if isinstance(b.get("dim"), torch.Tensor) or (len(args) > 1 and isinstance(args[1], torch.Tensor)):
            return pointwise(mode, func, args, kwargs)  # the rule of torch.maximum / minimum
        dim, keepdim = b.get("dim"), bool(b.get("keepdim", False))
        if dim is None:
            return global_extreme(mode, x, list(range(x.dim())), False, largest)
        dims, kind = _classify(mode, func, x, dim)
        if kind == "global":
            raise mode.unsupported(func, "its indices are positions in the whole image, which no shard holds",
                                   "Use amax/amin for the value, or reduce over channels only")
        return mode.tag_outputs(func(*args, **kwargs), global_shape(x), _after(mode, x, dims, keepdim))
    b = bind(("input", "dim", "keepdim"), args, kwargs)
    dims, kind = _classify(mode, func, x, b.get("dim", ()) or None)
    keepdim = bool(b.get("keepdim", False))
    if kind == "global":
        return global_extreme(mode, x, dims, keepdim, largest)
    return mode.tag_outputs(func(*args, **kwargs), global_shape(x), _after(mode, x, dims, keepdim))


def _over_dim(mode: RuleContext, func, args, kwargs):
    """softmax, log_softmax, cumsum, argmax, std, var, logsumexp, prod, norm, any, all over batch or channels."""
    x = args[0]
    name = func.__name__.removeprefix("linalg_")  # torch.linalg.vector_norm's C name is linalg_vector_norm
    keeps = name in ("softmax", "log_softmax", "cumsum", "cumprod", "logcumsumexp")
    names = {"norm": ("input", "p", "dim", "keepdim"), "vector_norm": ("input", "ord", "dim", "keepdim")}
    b = bind(names.get(name, ("input", "dim")), args, kwargs)
    dim = b.get("dim")
    if dim is None and keeps:
        raise mode.unsupported(func, "it runs over all dims of a sharded tensor", "Give dim= a channel dim")
    if name == "cumsum" and len(int_dims(dim, x.dim())) == 1 and int_dims(dim, x.dim())[0] in nonneg_dims(
            mode.layout(x), x.dim()):
        return _prefix_sum(mode, x, int_dims(dim, x.dim())[0], b.get("dtype", kwargs.get("dtype")))
    dims, kind = _classify(mode, func, x, dim)
    if kind == "global":
        if name in ("norm", "vector_norm") and b.get("p", b.get("ord", 2)) in (2, 2.0, "fro", None):
            keepdim = bool(b.get("keepdim", False))
            return mode.executor.allsum(torch.sum(x * x, dim=dims, keepdim=keepdim)).sqrt()
        raise mode.unsupported(func, "it reduces over spatial dims", "Reduce over batch or channel dims only, "
                               "or use sum/mean/amax over all spatial dims")
    keepdim = True if keeps else bool(b.get("keepdim", False))
    return mode.tag_outputs(func(*args, **kwargs), global_shape(x), _after(mode, x, dims, keepdim))


def _prefix_sum(mode: RuleContext, x: torch.Tensor, dim: int, dtype) -> torch.Tensor:
    """``cumsum`` along a sharded spatial dim (EdgeNeXt's positional encoding counts rows with it): this shard's
    own running sum plus the totals of the shards before it along that axis (each shard's last slice, shared
    by an all-gather, differentiably)."""
    shape, layout = global_shape(x), mode.layout(x)
    axis = nonneg_dims(layout, x.dim()).index(dim)
    local = torch.cumsum(x, dim, dtype=dtype)
    total = local.narrow(dim, local.shape[dim] - 1, 1)
    coords = list(all_coords(mode.executor.grid))

    def size(coord):
        out = list(total.shape)
        for d, (a, b) in zip(nonneg_dims(layout, x.dim()), shard_box(shape, mode.executor.grid, coord)):
            out[d] = b - a if d != dim else 1
        return tuple(out)

    parts = mode.executor.allgather(total, "prefix sum", [size(c) for c in coords])
    me = mode.executor.coord
    for c, p in zip(coords, parts):
        if c == me:
            continue
        if c[axis] < me[axis] and all(c[a] == me[a] for a in range(len(me)) if a != axis):
            local = local + p
        else:  # in the graph all the same: every part received must send its (zero) gradient back
            local = local + _zero_tie(p)
    return mark(local, shape, layout)


def _cum_extreme(mode: RuleContext, func, args, kwargs):
    """``cummax``/``cummin``: along a batch or channel dim, local; along a sharded spatial dim, a prefix scan as
    ``cumsum``'s (``_prefix_sum``): this shard's own running extreme, then the running extreme of the shards
    before it along that axis (their last slices' values and global indices, by an all-gather, folded in axis
    order), taken where it wins. Ties and NaNs go as torch's sequential scan decides: the later position wins a
    tie, a NaN wins and stays."""
    b = bind(("input", "dim"), args, kwargs)
    x, dim = b["input"], int_dims(b["dim"], b["input"].dim())[0]
    shape, layout = global_shape(x), mode.layout(x)
    spatial = nonneg_dims(layout, x.dim())
    largest = func.__name__ == "cummax"
    if dim not in spatial:
        out = func(*args, **kwargs)
        return getattr(torch.return_types, func.__name__)((mark(out.values, shape, layout),
                                                           mark(out.indices, shape, layout)))
    axis = spatial.index(dim)
    values, indices = func(x, dim)
    box = shard_box(shape, mode.executor.grid, mode.executor.coord)
    indices = indices + box[axis][0]  # global positions along the axis
    last = values.narrow(dim, values.shape[dim] - 1, 1)
    coords = list(all_coords(mode.executor.grid))

    def size(coord):
        out = list(last.shape)
        for d, (a, b_) in zip(spatial, shard_box(shape, mode.executor.grid, coord)):
            out[d] = b_ - a if d != dim else 1
        return tuple(out)

    sizes = [size(c) for c in coords]
    parts = mode.executor.allgather(last, f"{func.__name__} totals", sizes)
    places = mode.executor.allgather(indices.narrow(dim, indices.shape[dim] - 1, 1).contiguous(),
                                     f"{func.__name__} positions", sizes)
    me = mode.executor.coord
    before = [i for i, c in enumerate(coords) if c[axis] < me[axis]
              and all(c[a] == me[a] for a in range(len(me)) if a != axis)]
    prev_value = prev_index = None
    for i in sorted(before, key=lambda i: coords[i][axis]):  # the shards before, in axis order
        if prev_value is None:
            prev_value, prev_index = parts[i], places[i]
            continue
        take = _wins(parts[i], prev_value, largest)
        prev_value = torch.where(take, parts[i], prev_value)
        prev_index = torch.where(take, places[i], prev_index)
    for i, p in enumerate(parts):  # every part received sends its (zero) gradient back, as in _prefix_sum
        if i not in before and coords[i] != me:
            values = values + _zero_tie(p)
    if prev_value is not None:
        take = _wins(values, prev_value, largest)
        values = torch.where(take, values, prev_value)
        indices = torch.where(take, indices, prev_index)
    return getattr(torch.return_types, func.__name__)((mark(values, shape, layout), mark(indices, shape, layout)))


def _wins(new: torch.Tensor, old: torch.Tensor, largest: bool) -> torch.Tensor:
    """Where torch's sequential scan takes ``new`` over the running ``old``: a NaN, or not worse (ties: later)."""
    better = new >= old if largest else new <= old
    return torch.isnan(new) | (~torch.isnan(old) & better)


def _zero_tie(p: torch.Tensor) -> torch.Tensor:
    """0, in the graph of ``p`` (its gradient zero), whatever ``p`` holds: ``0 * p`` would be NaN where ``p`` is NaN
    or infinite, and carry another shard's NaN into this one's result."""
    return torch.where(torch.zeros_like(p, dtype=torch.bool), p, torch.zeros_like(p)).sum()


def _linear(mode: RuleContext, func, args, kwargs):
    """Linear over the last dim: per position when that dim is channels (a channels-last view)."""
    x = args[0] if args else kwargs["input"]
    if -1 in mode.layout(x):
        raise mode.unsupported(func, "it mixes the positions along a spatial dim",
                               "Apply Linear after global pooling (AdaptiveAvgPoolNd(1) + Flatten), or over the "
                               "channels of a channels-last view, or use a 1x1 convolution")
    return mode.tag_outputs(func(*args, **kwargs), global_shape(x), mode.layout(x))


def _einsum(mode: RuleContext, func, args, kwargs):
    """``torch.einsum`` of sharded maps: per position when the output keeps every spatial letter (SAM's relative
    position terms, ``einsum("bhwc,hkc->bhwk", q_map, Rh)``: an ordinary operand indexed by a spatial letter spans
    the whole image along it, and this shard's part of it is used); a global sum when it keeps none."""
    equation, operands = args[0], list(args[1:])
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    if not isinstance(equation, str) or "..." in equation or "->" not in equation:
        raise mode.unsupported(func, "its equation is not explicit", "Write the equation with '->' and no '...'")
    inputs, output = equation.replace(" ", "").split("->")
    terms = inputs.split(",")
    sharded = [(term, t) for term, t in zip(terms, operands) if global_shape(t) is not None]
    shape = mode.one_shape(func, [t for _, t in sharded])
    axes = {tuple(term[d] for d in mode.layout(t)) for term, t in sharded}
    if len(axes) != 1:
        raise mode.unsupported(func, "its sharded operands hold the spatial dims under different letters",
                               "Give every sharded operand the same letter for each spatial dim")
    letters = axes.pop()
    local = []
    for term, t in zip(terms, operands):
        if global_shape(t) is None and any(c in term for c in letters):
            dims = [term.index(c) - len(term) for c in letters if c in term]
            sizes = [shape[letters.index(c)] for c in letters if c in term]
            if any(t.shape[d] != n for d, n in zip(dims, sizes)):
                raise mode.unsupported(func, f"an unsharded operand of shape {tuple(t.shape)} ('{term}') runs along a "
                                       "spatial letter but not over the whole image", "Give it the image's size there")
            box = shard_box(shape, mode.executor.grid, mode.executor.coord)
            index = [slice(None)] * t.dim()
            for c in letters:
                if c in term:
                    index[term.index(c)] = slice(*box[letters.index(c)])
            t = t[tuple(index)]
        local.append(t)
    out = func(equation, *local)
    kept = [c for c in letters if c in output]
    if not kept:
        return mode.executor.allsum(out)
    if len(kept) != len(letters):
        raise mode.unsupported(func, "it sums over some spatial letters but not all", _SOME_SPATIAL_FIX)
    return mark(out, shape, tuple(output.index(c) - len(output) for c in letters))


def _flatten(mode: RuleContext, func, args, kwargs):
    b = bind(("input", "start_dim", "end_dim"), args, kwargs)
    x, shape = b["input"], global_shape(b["input"])
    start, end = b.get("start_dim", 0) % x.dim(), b.get("end_dim", -1) % x.dim()
    spatial = nonneg_dims(mode.layout(x), x.dim())
    if not set(spatial) & set(range(start, end + 1)):
        out_dims = [p - (end - start) if p > end else p for p in spatial]
        return mode.tag_outputs(func(*args, **kwargs), shape, neg_dims(out_dims, x.dim() - (end - start)))
    if start == x.dim() - mode.dims and end == x.dim() - 1 and mode.layout(x) == trailing(mode.dims):
        # x.flatten(2): this shard's positions in one dim (bigconv.ops.positions; of a 1D map, its positions as
        # they are); reductions over them and attention are global, anything else gathers them whole as below
        return mark_positions(x.reshape(*x.shape[:start], -1), shape, -1, gather=True)
    if end != x.dim() - 1 or mode.layout(x) != trailing(mode.dims):
        raise mode.unsupported(func, "it merges spatial dims into others but keeps some after them",
                               "Flatten through the last dim (end_dim=-1)")
    # A flatten into a dense head (VGG-style): the map is gathered whole on every worker, exactly
    # as a single process sees it; only worker 0's copy reaches the loss.
    return func(mode.executor.gather_all(x, shape), *args[1:], **kwargs)


def _elementwise_loss(mode: RuleContext, func, args, kwargs):
    """``F.mse_loss``/``F.l1_loss`` of sharded maps inside forward (MONAI SegResNetVAE's reconstruction loss):
    the pointwise error, then a global mean or sum over every dim."""
    b = bind(("input", "target", "size_average", "reduce", "reduction"), args, kwargs)
    if b.get("size_average") is not None or b.get("reduce") is not None:
        raise mode.unsupported(func, "of its deprecated size_average/reduce arguments", "Give reduction= instead")
    reduction = b.get("reduction", "mean")
    error = pointwise(mode, torch.sub, (b["input"], b["target"]), {})
    error = pointwise(mode, torch.square if func is F.mse_loss else torch.abs, (error,), {})
    if reduction == "none":
        return error
    return sum_mean(mode, torch.mean if reduction == "mean" else torch.sum, (error, list(range(error.dim()))), {},
                    mean=reduction == "mean")


def _register() -> None:
    table = {
        (lambda m, f, a, k: sum_mean(m, f, a, k, mean=False)): (torch.sum, torch.Tensor.sum, torch.nansum),
        (lambda m, f, a, k: sum_mean(m, f, a, k, mean=True)): (torch.mean, torch.Tensor.mean),
        _extreme: tuple(getattr(o, n) for o in (torch, torch.Tensor) for n in ("amax", "amin", "max", "min")),
        _over_dim: tuple(getattr(o, n) for o in (torch, torch.Tensor)
                         for n in ("softmax", "log_softmax", "cumsum", "argmax", "argmin", "std", "var", "logsumexp",
                                   "prod", "norm", "any", "all")) + (F.softmax, F.log_softmax, torch.linalg.vector_norm),
        _linear: (F.linear,),
        _flatten: (torch.flatten, torch.Tensor.flatten),
        _elementwise_loss: (F.mse_loss, F.l1_loss),
        _einsum: (torch.einsum,),
        _cum_extreme: (torch.cummax, torch.Tensor.cummax, torch.cummin, torch.Tensor.cummin),
    }
    for rule, funcs in table.items():
        for f in funcs:
            RULES[f] = rule
            LAYOUT_AWARE.add(f)


_register()
