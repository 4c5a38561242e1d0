"""Window partitions as local reshapes: window attention (Swin's W-MSA, MONAI SwinUNETR's) on shards.

A reshape that splits a sharded spatial dim of ``n`` positions into ``(n / w, w)`` (a window
partition) is local when every shard's extent along that dim is a multiple of ``w``: each shard
then holds whole windows, and the result is a sharded map whose spatial dim is the window count
(``n / w`` windows, the shard's own ones), ``w`` an ordinary dim beside it. The permutes that
follow are layout ops; a reshape that merges the window dims with the batch in front of them
(``reshape(B * nW, w * w, C)``) gives the windows as *flattened positions* (``bigconv.ops.
positions``) of the window grid, with the batch as a whole leading factor (``shards.WindowGrid``):
the attention inside a window is per position of that grid (``F.linear``, batched ``matmul``,
``softmax`` over the keys, ``scaled_dot_product_attention`` with the windows as a batch dim), and
masks built for the whole image (Swin's shifted-window mask, one row per window) are cut to this
shard's windows. The reverse (unflattening the windows back into ``(B, nH, nW, ...)``, then merging
``(nH, w)`` into ``n``) is local too. Any number of spatial dims.

Balanced shards are a multiple of ``w`` exactly when ``n`` is a multiple of ``w`` times the shards
along that dim. At other sizes a partition of every spatial dim is re-sharded by whole windows with
an exchange (``bigconv.ops.subpixel``'s space-to-depth, the spatial dims moved last), and the merge
back by its inverse; a map with fewer windows than shards along a dim is gathered whole on every
shard (as small maps are) and the window attention runs on whole tensors until they join a sharded
map, where each shard takes its part. A partition of only some spatial dims at a size whose shards
cut windows is refused, naming the window and the sizes that work.

Windows held as the batch (HIPT's regions: ``x.unfold`` by whole regions, then ``(B * nW, C, r, r)``) go
through convolutions and poolings item by item, so per window; ``torch.cat`` of windows' tokens along
another dim (a class token per window, ``cls_token.expand(B * nW, -1, -1)``) takes this shard's windows
of an operand as long as all of them. A ``cat`` along the windows themselves stays refused.
"""

from __future__ import annotations

import math

import torch

from ..geometry.boxes import balanced_bounds
from . import subpixel
from .context import RuleContext
from .dims import neg_dims, nonneg_dims
from .shards import (
    WHOLE_WINDOWS_ATTR,
    AttentionNote,
    WindowGrid,
    bind,
    global_shape,
    global_size,
    mark,
    mark_positions,
    positions,
    tree_flatten,
)
from .shards import lead as items_before
from .shards import trail as items_behind

FIX = ("Window attention needs every shard to hold whole windows: give the map a size along that dim that is a "
       "multiple of the window times the shards along it")


def resolve(target: list, total: int) -> list[int]:
    """A reshape's target sizes with its -1 worked out from the whole tensor's ``total``."""
    if -1 not in target:
        return [int(t) for t in target]
    known = math.prod(t for t in target if t != -1)
    return [total // known if t == -1 else int(t) for t in target]


def groups(sizes: list[int], target: list[int]) -> list[tuple[range, range]] | None:
    """The reshape as groups of input dims that become groups of output dims of the same product, each
    group as small as can be (size-1 dims kept apart where they can be); None when sizes disagree."""
    out, i, j = [], 0, 0
    while i < len(sizes) or j < len(target):
        if i < len(sizes) and j < len(target) and sizes[i] == target[j]:
            out.append((range(i, i + 1), range(j, j + 1)))
            i, j = i + 1, j + 1
            continue
        a, b, pa, pb = i, j, 1, 1
        while True:
            if pa <= pb and a < len(sizes):
                pa *= sizes[a]
                a += 1
            elif b < len(target):
                pb *= target[b]
                b += 1
            else:
                return None
            if pa == pb and a > i and b > j:
                break
        out.append((range(i, a), range(j, b)))
        i, j = a, b
    return out


def reshape_map(mode: RuleContext, func, x: torch.Tensor, target: list):
    """A window partition, window merge or windows-with-batch flatten of a sharded map; None when the
    reshape is none of these (the caller refuses it)."""
    shape = global_shape(x)
    size = list(global_size(x, mode.dims))
    target = resolve(list(target), math.prod(size))
    found = groups(size, target)
    if found is None:
        return None
    spatial = nonneg_dims(mode.layout(x), x.dim())
    axis_of = {p: k for k, p in enumerate(spatial)}
    out_spatial: dict[int, int] = {}  # grid axis -> output dim
    out_shape = list(shape)
    windows: dict[int, int] = {}  # grid axis -> window split off it
    merges: dict[int, int] = {}  # grid axis -> window merged into it
    flat = None
    for ins, outs in found:
        axes = [axis_of[p] for p in ins if p in axis_of]
        if not axes:
            continue
        if len(ins) == 1 and len(outs) == 1:
            out_spatial[axes[0]] = outs[0]
        elif len(ins) == 1 and len(outs) == 2:  # (n) -> (n / w, w): a window partition
            out_spatial[axes[0]] = outs[0]
            windows[axes[0]] = target[outs[1]]
            out_shape[axes[0]] = target[outs[0]]
        elif len(ins) == 2 and len(outs) == 1 and ins[0] in axis_of and ins[1] not in axis_of:  # (n/w, w) -> n
            out_spatial[axes[0]] = outs[0]
            out_shape[axes[0]] = target[outs[0]]
            merges[axes[0]] = size[ins[1]]
        elif (len(axes) == mode.dims and axes == list(range(mode.dims)) and list(ins)[-mode.dims:] == spatial
              and target[outs[-1]] % math.prod(shape) == 0):
            # (lead, nH, nW) -> lead * nH * nW: windows as positions; with outer factors of the lead split off in
            # dims of their own (Hiera's Unroll: (B * 64, nH, nW) -> (B, 64 * nH * nW))
            flat = (outs[-1], target[outs[-1]] // math.prod(shape))
        else:
            return None
    if flat is not None:
        if out_spatial:
            return None
        k, lead = flat
        local_target = list(target)
        local_target[k] = lead * math.prod(mode.executor.local_shape(shape))
        return mark_positions(_call(func, x, local_target), WindowGrid(shape, lead), k - len(target))
    if windows and not all(aligned(mode, shape[a], w, a) for a, w in windows.items()):
        if all(aligned(mode, shape[a], w, a) or shape[a] // w < mode.executor.grid[a] for a, w in windows.items()):
            return _split_whole(mode, func, x, target)  # fewer windows than shards: held whole
        if len(windows) == mode.dims and _plain_elsewhere(found, axis_of):  # re-sharded by whole windows
            return _exchange(mode, func, x, found, axis_of, target, [windows[a] for a in range(mode.dims)], True)
        for axis, w in windows.items():
            check_aligned(mode, func, shape[axis], w, axis)
    local_target = list(target)
    local_out = mode.executor.local_shape(tuple(out_shape))
    for axis, d in out_spatial.items():
        local_target[d] = local_out[axis]
    if any(math.prod(x.shape[p] for p in ins) != math.prod(local_target[q] for q in outs)
           for ins, outs in found):  # windows merged off the image's shards
        if len(merges) == mode.dims and _plain_elsewhere(found, axis_of, merging=True):
            return _exchange(mode, func, x, found, axis_of, target, [merges[a] for a in range(mode.dims)], False)
        return None
    out = _call(func, x, local_target)
    dims = [out_spatial[a] for a in range(mode.dims)]
    return mark(out, tuple(out_shape), neg_dims(dims, len(target)))


def _plain_elsewhere(found, axis_of: dict, merging: bool = False) -> bool:
    """Every group of the reshape without a spatial dim keeps its one dim as it is."""
    return all(len(ins) == 1 and len(outs) == 1 for ins, outs in found
               if not any(p in axis_of for p in ins))


def _exchange(mode: RuleContext, func, x: torch.Tensor, found, axis_of: dict, target: list, factors: list[int],
              split: bool) -> torch.Tensor:
    """A window partition (``split``) or merge whose windows the shards do not hold whole: the spatial dims
    moved last, the space-to-depth (or depth-to-space) rule of ``bigconv.ops.subpixel``, which re-shards
    by whole windows (or back to the image's shards) with an exchange, and the dims put where the
    reshape puts them. Exact both ways; what follows holds whole windows."""
    shape = global_shape(x)
    plain = [p for ins, _ in found for p in ins if not any(q in axis_of for q in ins)]
    by_axis = {axis_of[p]: ins for ins, _ in found for p in ins if p in axis_of}
    if split:
        order = plain + [p for a in range(mode.dims) for p in by_axis[a]]
        out = subpixel.split_spatial(mode, func, mark(x.permute(order), shape), factors)
        # out: (plain..., n1/r1, r1, n2/r2, r2, ...)
        index, k = {}, len(plain)
        for ins, outs in found:
            if ins[0] in axis_of:
                index[outs[0]], index[outs[1]] = k + 2 * axis_of[ins[0]], k + 2 * axis_of[ins[0]] + 1
            else:
                index[outs[0]] = plain.index(ins[0])
    else:
        order = plain + [p for a in range(mode.dims) for p in by_axis[a]]
        out = subpixel.merge_spatial(mode, func, mark(x.permute(order), shape), factors)
        # out: (plain..., n1*r1, n2*r2, ...)
        index = {}
        for ins, outs in found:
            index[outs[0]] = len(plain) + axis_of[ins[0]] if ins[0] in axis_of else plain.index(ins[0])
    perm = [index[j] for j in range(len(target))]
    spatial_out = global_shape(out)
    if spatial_out is None:  # smaller than the grid: whole, as the rule left it
        return out.permute(perm)
    at = [perm.index(len(plain) + (2 * a if split else a)) for a in range(mode.dims)]
    return mark(out.permute(perm), spatial_out, neg_dims(at, len(target)))


def aligned(mode: RuleContext, n: int, w: int, axis: int) -> bool:
    return all((b - a) % w == 0 for a, b in balanced_bounds(n, mode.executor.grid[axis]))


def _split_whole(mode: RuleContext, func, x: torch.Tensor, target: list) -> torch.Tensor:
    """The window partition of the whole map, gathered on every shard (differentiably: each shard's
    gradient of its copy returns to the owners); what follows runs on whole tensors (``on_whole``) up to
    their join with a sharded map, where each shard keeps its part."""
    shape, layout = global_shape(x), tuple(mode.layout(x))
    spatial = nonneg_dims(layout, x.dim())
    order = [d for d in range(x.dim()) if d not in spatial] + spatial
    whole = mode.executor.gather_all(x.permute(order), shape).permute([order.index(d) for d in range(x.dim())])
    out = _call(func, whole, target)
    setattr(out, WHOLE_WINDOWS_ATTR, (tuple(shape), layout, x.dim()))
    return out


def on_whole(mode: RuleContext, func, args, kwargs, held: tuple, draws=None):
    """A call on windows of a map held whole (``_split_whole``): as it is, every tensor output whole too.
    They become shards again where they join a sharded map (Swin's residual ``shortcut + x``: the
    pointwise rule takes this shard's part of an operand of the image's size), not at the merge back,
    which a one-window map cannot tell from the windows themselves ((B * 1, w, w, C) is (B, H, W, C)).
    Random draws (``draws``, the rule of ``bigconv.ops.random``: a drop path) are bigconv's, as one
    process draws them."""
    out = draws(mode, func, args, kwargs, False) if draws is not None else func(*args, **kwargs)
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor):
            setattr(t, WHOLE_WINDOWS_ATTR, held)
    return out


def check_aligned(mode: RuleContext, func, n: int, w: int, axis: int) -> None:
    """Every shard's extent along ``axis`` is a multiple of the window ``w``, else a refusal naming
    the sizes that work."""
    g = mode.executor.grid[axis]
    extents = [b - a for a, b in balanced_bounds(n, g)]
    if all(e % w == 0 for e in extents):
        return
    step = w * g
    below, above = (n // step) * step, (n // step + 1) * step
    near = ", ".join(str(s) for s in (below, above) if s > 0)
    raise mode.unsupported(
        func, f"it partitions spatial dim {axis} of {n} positions into windows of {w}, but the {g} shards along it "
        f"hold {extents} positions, not whole windows", f"{FIX} ({step}: e.g. {near} instead of {n}), or at most "
        f"{w * (g - 1)} positions (fewer windows than shards: held whole), e.g. by choosing the input size")


def positions_to_map(mode: RuleContext, func, x: torch.Tensor, grid: WindowGrid, dim: int, target: list):
    """A reshape of windows flattened with whole items in front (``grid.lead``) and behind (``grid.trail``):
    the dims beside the positions merged into them (``(B, nW, w, C) -> (B * nW * w, C)``: the items in
    front and behind grow), or the positions split into whole items, the windows and whole items (the
    reverse), or into a map of the windows (``(lead, nH, nW, trail)``: a sharded map again); None if the
    reshape mixes the windows with anything else."""
    size = list(x.shape)
    pos = dim % x.dim()
    cells = math.prod(grid)
    size[pos] = grid.lead * cells * grid.trail
    target = resolve(list(target), math.prod(size))
    found = groups(size, target)
    if found is None:
        return None
    ins, outs = next((i, o) for i, o in found if pos in i)
    lead = math.prod(size[ins[0]:pos]) * grid.lead  # whole items of the group in front of the windows
    trail = grid.trail * math.prod(size[pos + 1:ins[-1] + 1])
    local = list(target)
    outs = list(outs)
    d = len(grid)
    for j in range(len(outs) - d + 1):  # the windows as dims of their own: a map of windows
        front, back = math.prod(target[outs[0]:outs[j]]), math.prod(target[outs[j] + d:outs[-1] + 1])
        if tuple(target[outs[j]:outs[j] + d]) == tuple(grid) and front == lead and back == trail:
            local[outs[j]:outs[j] + d] = mode.executor.local_shape(tuple(grid))
            at = tuple(range(outs[j] - len(target), outs[j] + d - len(target)))
            return mark(_call(func, x, local), tuple(grid), at)
    for j in outs:  # the windows inside one dim, whole items around them
        front = math.prod(target[outs[0]:j])
        if lead % front or target[j] % (lead // front * cells):
            continue
        inner = target[j] // (lead // front * cells)  # whole items behind the windows in this dim
        if trail % inner or math.prod(target[j + 1:outs[-1] + 1]) != trail // inner:
            continue
        local[j] = target[j] // cells * math.prod(mode.executor.local_shape(tuple(grid)))
        return mark_positions(_call(func, x, local), WindowGrid(tuple(grid), lead // front, inner), j - len(target))
    return None


def _call(func, x, sizes):
    return torch.reshape(x, sizes) if func is torch.reshape else func(x, sizes)


def local_windows(mode: RuleContext, t: torch.Tensor, grid: WindowGrid, dim: int) -> torch.Tensor:
    """This shard's windows of ``t``, whose ``dim`` holds every window of the image (with whole items in
    front and behind, when the grid has them), in the flattened order of ``grid``."""
    k = dim % t.dim()
    moved = t.movedim(k, -1)
    behind = items_behind(grid)  # 1 for plain flattened positions (a ViT's tokens)
    lead = moved.shape[-1] // (math.prod(grid) * behind)
    whole = moved.reshape(*moved.shape[:-1], lead, *grid, behind)
    part = mode.executor.local_part(whole, tuple(grid), tuple(range(-len(grid) - 1, -1)))
    return part.reshape(*moved.shape[:-1], -1).movedim(-1, k)



# -- per window: the attention inside each window, the windows flattened as positions --------------------
RULES: dict = {}
"""This module's rules for calls with a sharded argument (none: window reshapes go through ``layout``)."""
WHOLE_RULES: dict = {}
LAYOUT_AWARE: set = set()
PROPERTY_RULES: dict = {}
POSITION_RULES: dict = {}
"""Rules for flattened positions (merged with ``bigconv.ops.positions``'s own by ``bigconv.ops.table``)."""


def _refuse(mode: RuleContext, func, reason: str):
    return mode.unsupported(func, f"it acts on windows (or an image's positions) flattened into one dim, which each "
                            f"shard holds its own part of, and {reason}", "Keep window attention per window: act on "
                            "the other dims, with the windows as a batch dim")


def _pos(x: torch.Tensor) -> tuple:
    p = positions(x)
    return p[0], p[1] % x.dim()


def _same(mode: RuleContext, func, args, kwargs, x: torch.Tensor, dims: list[int]):
    """``func`` acting along ``dims`` of ``x`` only (not its positions): per position, positions stay put."""
    shape, pos = _pos(x)
    if pos in [d % x.dim() for d in dims]:
        raise _refuse(mode, func, "it acts along the positions themselves")
    out = func(*args, **kwargs)
    if isinstance(out, torch.Tensor) and out.dim() == x.dim():
        mark_positions(out, shape, pos - x.dim())
    return out


def _linear(mode: RuleContext, func, args, kwargs):
    x = bind(("input",), args, kwargs)["input"]
    return _same(mode, func, args, kwargs, x, [-1])


def _normalize(mode: RuleContext, func, args, kwargs):
    """``F.normalize`` over other dims: per position; over the positions (EdgeNeXt's cross-covariance
    attention normalizes each channel over the image): the norm is a global sum over every shard."""
    b = bind(("input", "p", "dim", "eps"), args, kwargs)
    x = b["input"]
    shape, pos = _pos(x)
    if b.get("dim", 1) % x.dim() != pos:
        return _same(mode, func, args, kwargs, x, [b.get("dim", 1)])
    p = float(b.get("p", 2.0))
    if not p > 0 or p == float("inf"):
        raise _refuse(mode, func, f"it takes a {p}-norm over the positions (finite positive p only)")
    total = mode.executor.allsum(x.abs().pow(p).sum(dim=pos, keepdim=True))
    norm = total.pow(1 / p).clamp_min(b.get("eps", 1e-12)).expand_as(x)
    return mark_positions(x / norm, shape, pos - x.dim())


def _layer_norm(mode: RuleContext, func, args, kwargs):
    b = bind(("input", "normalized_shape"), args, kwargs)
    n = len(b["normalized_shape"]) if not isinstance(b["normalized_shape"], int) else 1
    return _same(mode, func, args, kwargs, b["input"], list(range(-n, 0)))


def _dropout(mode: RuleContext, func, args, kwargs):
    b = bind(("input", "p", "training"), args, kwargs)
    if b.get("p", 0.5) and b.get("training", True):
        raise _refuse(mode, func, "its mask would be drawn per shard (dropout on positions flattened into one dim)")
    return _same(mode, func, args, kwargs, b["input"], [])


def _factory(mode: RuleContext, func, args, kwargs):
    """``x.new_zeros((H, W))`` of flattened windows (Swin's mask): an ordinary tensor, whole."""
    return func(*args, **kwargs)


def _getitem(mode: RuleContext, func, args, kwargs):
    """``qkv[0]``: ints and slices of dims other than the positions, and new dims (``None``: SAM's
    ``rel_h[:, :, :, :, None]``)."""
    x, index = args[0], args[1]
    shape, pos = _pos(x)
    index = index if isinstance(index, tuple) else (index,)
    used = sum(i is not None for i in index) - (Ellipsis in index)
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (x.dim() - used) + index[at + 1:]
    index = index + (slice(None),) * (x.dim() - sum(i is not None for i in index))
    out_pos, out_dim, d = None, 0, 0
    for i in index:
        if i is None:
            out_dim += 1
            continue
        if not isinstance(i, (int, slice)):
            raise _refuse(mode, func, "it indexes with tensors")
        if d == pos:
            if i != slice(None):
                raise _refuse(mode, func, "it indexes the positions themselves")
            out_pos = out_dim
        out_dim += not isinstance(i, int)
        d += 1
    out = func(*args, **kwargs)
    return mark_positions(out, shape, out_pos - out.dim())


def _unbind(mode: RuleContext, func, args, kwargs):
    """``qkv.unbind(0)``, ``chunk``/``split`` of dims other than the positions."""
    names = {"unbind": ("input", "dim"), "chunk": ("input", "chunks", "dim"),
             "split": ("input", "split_size_or_sections", "dim")}[func.__name__]
    b = bind(names, args, kwargs)
    x = b["input"]
    shape, pos = _pos(x)
    dim = b.get("dim", 0) % x.dim()
    if dim == pos:
        raise _refuse(mode, func, "it cuts the positions themselves")
    gone = func.__name__ == "unbind" and dim < pos
    outs = func(*args, **kwargs)
    for t in outs:
        mark_positions(t, shape, pos - gone - t.dim())
    return outs


def _per_item(mode: RuleContext, func, args, kwargs):
    """A convolution or pooling of windows held as its batch (HIPT's regions, ``(B * nW, C, r, r)``, through
    ViT-256's patch embedding): each item of the batch on its own, so per position; weights and bias whole."""
    b = bind(("input", "weight", "bias", "stride", "padding", "dilation"), args, kwargs)
    x = b["input"]
    shape, pos = _pos(x)
    if pos != 0 and _pointwise_conv1d(func, b, x, pos):  # a 1x1 Conv1d along the positions: per position too
        return _mark_all(func(*args, **kwargs), shape, pos)
    if pos != 0:
        raise _refuse(mode, func, "the positions are not its batch dim (it would act along them)")
    if any(positions(t) is not None for t in tree_flatten((args[1:], kwargs))[0] if t is not x):
        raise _refuse(mode, func, "its weight or bias varies with the positions")
    out = func(*args, **kwargs)
    return _mark_all(out, shape, 0)


def _cat(mode: RuleContext, func, args, kwargs):
    """``torch.cat`` along a dim other than the positions (HIPT's class token beside each region's patch tokens,
    ``cat((cls_token.expand(B * nW, -1, -1), x), dim=1)``, the regions in dim 0): per position. An operand
    without positions holds every window of the image along that dim (the expand's size comes from a size
    query, which answers for the whole image, as one process's): this shard's windows of it are joined."""
    b = bind(("tensors", "dim"), args, kwargs)
    tensors = list(b["tensors"])
    flats = [t for t in tensors if positions(t) is not None]
    marks = {(positions(t)[0], positions(t)[1] % t.dim(), t.dim()) for t in flats}
    if len(marks) != 1:
        raise _refuse(mode, func, "its operands hold the positions of different images or in different dims")
    shape, pos, n = marks.pop()
    dim = b.get("dim", 0)
    if not isinstance(dim, int):
        raise _refuse(mode, func, f"it joins along a named dim {dim!r}")
    if dim % n == pos:
        raise _refuse(mode, func, "it joins along the positions themselves")
    count = items_before(shape) * math.prod(shape) * items_behind(shape)
    parts = []
    for t in tensors:
        if positions(t) is None:
            if not isinstance(t, torch.Tensor) or t.dim() != n or t.shape[pos] != count:
                size = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise _refuse(mode, func, f"an operand of shape {size} is not as long as the positions ({count})")
            t = local_windows(mode, t, shape, pos)
        parts.append(t)
    return mark_positions(func(parts, dim), shape, pos - n)


def _pointwise_conv1d(func, b: dict, x: torch.Tensor, pos: int) -> bool:
    """A ``Conv1d`` of kernel 1, stride 1, no padding over ``(N, C, positions)``: a matrix at each position."""
    import torch.nn.functional as F

    weight = b.get("weight")
    return (func is F.conv1d and x.dim() == 3 and pos == 2 and isinstance(weight, torch.Tensor)
            and positions(weight) is None and weight.shape[-1] == 1 and b.get("stride", 1) in (1, (1,))
            and b.get("padding", 0) in (0, (0,), "valid", "same"))


def _mark_all(out, shape, pos: int):
    """Every tensor output marked as flattened positions in dim ``pos`` (>= 0) (a pooling's indices too)."""
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor) and t.dim() > pos:
            mark_positions(t, shape, pos - t.dim())
    return out


def _sdpa(mode: RuleContext, func, args, kwargs):
    """``F.scaled_dot_product_attention`` with the windows in a batch dim of q, k and v: per window;
    a mask with a row per window of the image is cut to this shard's windows."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
    b = bind(names, args, kwargs)
    q, k, v = b["query"], b["key"], b["value"]
    marks = [positions(t) for t in (q, k, v)]
    if any(m is None for m in marks) or len({(m[0], m[1] - t.dim()) for m, t in zip(marks, (q, k, v))}) != 1:
        raise _refuse(mode, func, "its query, key and value do not all hold the positions in one batch dim")
    shape, pos = marks[0][0], marks[0][1] % q.dim()
    if pos >= q.dim() - 2:
        raise _refuse(mode, func, "the positions are its sequence dim (attention between positions)")
    if b.get("dropout_p", 0.0):
        raise _refuse(mode, func, "its attention dropout would be drawn per shard")
    mask = b.get("attn_mask")
    dim = pos - q.dim()
    if isinstance(mask, torch.Tensor) and positions(mask) is None and mask.dim() >= -dim and mask.shape[dim] != 1:
        b["attn_mask"] = local_windows(mode, mask, shape, dim)
    out = func(**{("query" if n == "query" else n): b[n] for n in names if n in b})
    mode.note_attention(AttentionNote("windows"))
    return mark_positions(out, shape, dim)


def _register() -> None:
    import torch.nn.functional as F

    table = {
        _linear: (F.linear,),
        _normalize: (F.normalize,),
        _layer_norm: (F.layer_norm,),
        _dropout: (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout),
        _factory: tuple(getattr(torch.Tensor, n) for n in ("new_zeros", "new_ones", "new_empty", "new_full",
                                                           "new_tensor")),
        _getitem: (torch.Tensor.__getitem__,),
        _unbind: tuple(getattr(o, n) for o in (torch, torch.Tensor) for n in ("unbind", "chunk", "split")),
        _sdpa: (F.scaled_dot_product_attention,),
        _cat: tuple(getattr(torch, n) for n in ("cat", "concat", "concatenate") if hasattr(torch, n)),
        _per_item: tuple(getattr(F, f"{kind}{d}d{tail}") for d in (1, 2, 3) for kind, tail in (
            ("conv", ""), ("conv_transpose", ""), ("avg_pool", ""), ("max_pool", ""), ("max_pool", "_with_indices"),
            ("adaptive_avg_pool", ""), ("adaptive_max_pool", ""))),
    }
    for rule, funcs in table.items():
        for f in funcs:
            POSITION_RULES[f] = rule


_register()
