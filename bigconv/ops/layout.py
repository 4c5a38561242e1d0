"""Rules for ops that move no data between positions: pointwise math, layout, joins and splits, sizes.

Each runs on the shard as it is and tracks where the spatial dims went (``permute`` to a
channels-last view and back, ``stack`` and ``unsqueeze`` adding dims, ``squeeze`` and ``unbind``
removing them). What would move data across positions (slicing, padding or joining along a spatial
dim, reshaping spatial dims together) is refused here with the fix, or handled by the windowed rules.
Size queries answer with the global shape, and factories given a global size build this shard's part.
"""

from __future__ import annotations

import torch

from . import slicing, subpixel, windows
from .context import RuleContext
from .dims import int_dims, neg_dims, nonneg_dims, size_args
from .shards import FLATTEN_FIX, global_shape, global_size, mark, mark_positions, trailing, tree_flatten


RULES: dict = {}
"""This module's rules for calls with a sharded argument (merged by ``bigconv.ops.table``)."""
WHOLE_RULES: dict = {}
"""Its rules for calls without one that may build a sharded result."""
LAYOUT_AWARE: set = set()
"""The functions among them whose rules handle spatial dims wherever they are."""
PROPERTY_RULES: dict = {}
"""Its rules for tensor attributes, by name."""


# -- pointwise ----------------------------------------------------------------------------------------
def pointwise(mode: RuleContext, func, args, kwargs):
    """Elementwise math: operands broadcast from the right, so spatial positions counted from the end stay put.

    An unsharded operand must be constant along the spatial dims (size 1) or span the whole image
    (then this shard uses its own part of it, as a single process uses all of it).
    """
    leaves = tree_flatten((args, kwargs))[0]
    shape = mode.one_shape(func, leaves)
    dims = mode.one_layout(func, leaves)
    full = []
    for t in leaves:
        if not isinstance(t, torch.Tensor) or global_shape(t) is not None or t.dim() == 0:
            continue
        sizes = tuple(t.shape[d] if t.dim() >= -d else 1 for d in dims)
        if all(s in (1, g) for s, g in zip(sizes, shape)) and any(s != 1 for s in sizes):
            full.append(t)  # the image's size along some spatial dims, broadcast along the others
        elif any(s != 1 for s in sizes):
            raise mode.unsupported(
                func, f"an unsharded operand of shape {tuple(t.shape)} varies along the spatial dims of an image "
                f"of spatial shape {shape}", "Give per-position operands a size of 1 in the spatial dims "
                "(broadcast), the image's whole size, or compute them from the input")
    if full:
        ids = {id(t) for t in full}
        local = {id(t): mode.executor.local_part(_broadcast_spatial(t, shape, dims), shape, dims) for t in full}
        args, kwargs = _replace(args, local, ids), _replace(kwargs, local, ids)
    return mode.tag_outputs(func(*args, **kwargs), shape, dims)


def _broadcast_spatial(t: torch.Tensor, shape, dims) -> torch.Tensor:
    """``t`` expanded (a view) to the image's size along spatial dims where it has size 1 (EdgeNeXt divides
    its row counts by their last row, ``(N, 1, W)``), so that this shard's part can be cut from it."""
    if t.dim() >= -min(dims) and all(t.shape[d] == g for d, g in zip(dims, shape)):
        return t
    t = t.reshape((1,) * (-min(dims) - t.dim()) + tuple(t.shape)) if t.dim() < -min(dims) else t
    sizes = [-1] * t.dim()
    for d, g in zip(dims, shape):
        sizes[d] = g
    return t.expand(*sizes)


def _replace(tree, local: dict, ids: set):
    if isinstance(tree, torch.Tensor):
        return local[id(tree)] if id(tree) in ids else tree
    if isinstance(tree, (list, tuple)):
        return type(tree)(_replace(v, local, ids) for v in tree) if not hasattr(tree, "_fields") else tree
    if isinstance(tree, dict):
        return {k: _replace(v, local, ids) for k, v in tree.items()}
    return tree


POINTWISE_TORCH = """add sub subtract mul multiply div divide true_divide neg negative abs exp expm1 log log1p sqrt
rsqrt pow square reciprocal sigmoid tanh relu relu_ clamp clamp_ clip maximum minimum where sin cos erf floor ceil
round sign lerp addcmul addcdiv hardtanh selu celu threshold logit nan_to_num eq ne lt le gt ge
logical_and logical_or logical_not isnan isfinite sigmoid_ tanh_ exp_ fmod remainder zeros_like ones_like empty_like
full_like as_tensor clamp_min clamp_max""".split()
POINTWISE_TENSOR = POINTWISE_TORCH + """__add__ __radd__ __iadd__ __sub__ __rsub__ __isub__ __mul__ __rmul__
__imul__ __truediv__ __rtruediv__ __itruediv__ __neg__ __pos__ __abs__ __pow__ __rpow__ __ipow__ __eq__ __ne__
__lt__ __le__ __gt__ __ge__ __and__ __or__ __invert__ add_ sub_ mul_ div_ clamp_ pow_ relu_ abs_ neg_ contiguous
clone to float double half bfloat16 type type_as detach detach_ requires_grad_ cpu cuda masked_fill
masked_fill_ fill_ zero_ copy_ sigmoid_ clamp_min_ clamp_max_ clamp_min clamp_max exp_ mul add div sub""".split()
POINTWISE_F = """relu relu_ relu6 leaky_relu leaky_relu_ elu elu_ selu selu_ celu celu_ gelu silu mish hardtanh
hardtanh_ hardswish hardsigmoid sigmoid tanh softplus softsign tanhshrink threshold threshold_ logsigmoid prelu
glu""".split()  # rrelu: bigconv.ops.random (it draws in training mode)


# -- joins and splits ---------------------------------------------------------------------------------
def _localize_full(mode: RuleContext, func, tensors, shape, dims) -> list:
    """Unsharded operands of a join: whole-image ones contribute this shard's part; others cannot join."""
    out = []
    for t in tensors:
        if global_shape(t) is None:
            if tuple(t.shape[d] for d in dims) != tuple(shape):
                raise mode.unsupported(func, f"it joins a sharded tensor with an unsharded one of shape "
                                       f"{tuple(t.shape)}", "Join tensors of the image's spatial size.")
            t = mode.executor.local_part(t, shape, dims)
        out.append(t)
    return out


def _cat(mode: RuleContext, func, args, kwargs):
    tensors = list(args[0] if args else kwargs["tensors"])
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    shape = mode.one_shape(func, tensors)
    dims = mode.one_layout(func, tensors)
    ndim = max(t.dim() for t in tensors)
    if dim % ndim - ndim in dims:
        raise mode.unsupported(func, f"it joins along spatial dim {dim}", "Concatenate along channels (dim=1).")
    tensors = _localize_full(mode, func, tensors, shape, dims)
    return mode.tag_outputs(func(tensors, dim), shape, dims)


def _stack(mode: RuleContext, func, args, kwargs):
    tensors = list(args[0] if args else kwargs["tensors"])
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    shape = mode.one_shape(func, tensors)
    dims = mode.one_layout(func, tensors)
    tensors = _localize_full(mode, func, tensors, shape, dims)
    ndim = tensors[0].dim()
    new = dim % (ndim + 1)
    out_dims = [p + (p >= new) for p in nonneg_dims(dims, ndim)]
    return mode.tag_outputs(func(tensors, dim), shape, neg_dims(out_dims, ndim + 1))


def _split_like(mode: RuleContext, func, args, kwargs):
    """chunk, split, tensor_split, narrow, unbind, select: along a non-spatial dim only."""
    names = {"chunk": ("input", "chunks", "dim"), "split": ("input", "split_size_or_sections", "dim"),
             "tensor_split": ("input", "indices_or_sections", "dim"), "narrow": ("input", "dim", "start", "length"),
             "unbind": ("input", "dim"), "select": ("input", "dim", "index")}[func.__name__]
    b = dict(zip(names, args), **kwargs)
    x = b["input"]
    shape, dims = global_shape(x), mode.layout(x)
    dim = b.get("dim", 0)
    if func.__name__ == "narrow" and dim % x.dim() - x.dim() in dims:  # a crop of one spatial dim
        start = b["start"] % global_size(x, mode.dims)[dim] if b["start"] < 0 else b["start"]
        cut = [slice(start, start + b["length"]) if d == dim % x.dim() - x.dim() else slice(None) for d in dims]
        return slicing.crop(mode, func, x, cut)
    if dim % x.dim() - x.dim() in dims:
        raise mode.unsupported(func, f"it cuts spatial dim {dim}, which is split over the grid",
                               "Cut only batch or channel dims (e.g. dim=1)")
    out = func(*args, **kwargs)
    if func.__name__ in ("unbind", "select"):  # the dim goes away
        gone = dim % x.dim()
        dims = neg_dims([p - (p > gone) for p in nonneg_dims(dims, x.dim())], x.dim() - 1)
    return mode.tag_outputs(out, shape, dims)


# -- layout -------------------------------------------------------------------------------------------
def _permutation(func, x: torch.Tensor, args, kwargs) -> list[int]:
    """out dim i is input dim perm[i]."""
    n, name = x.dim(), func.__name__
    rest = list(args[1:])
    if name == "permute":
        return nonneg_dims(size_args(rest) if rest else kwargs["dims"], n)
    if name in ("transpose", "swapaxes", "swapdims"):
        a, b = (rest + [kwargs.get(k) for k in ("dim0", "dim1", "axis0", "axis1") if k in kwargs])[:2]
        perm = list(range(n))
        perm[a % n], perm[b % n] = perm[b % n], perm[a % n]
        return perm
    src = rest[0] if rest else kwargs["source"]
    dst = rest[1] if len(rest) > 1 else kwargs["destination"]
    src, dst = int_dims(src, n), int_dims(dst, n)
    perm: list[int | None] = [None] * n
    for s, d in zip(src, dst):
        perm[d] = s
    others = iter(i for i in range(n) if i not in src)
    return [p if p is not None else next(others) for p in perm]


def _permute(mode: RuleContext, func, args, kwargs):
    x = args[0]
    perm = _permutation(func, x, args, kwargs)
    out_dims = neg_dims([perm.index(p) for p in nonneg_dims(mode.layout(x), x.dim())], x.dim())
    return mode.tag_outputs(func(*args, **kwargs), global_shape(x), out_dims)


def _unsqueeze(mode: RuleContext, func, args, kwargs):
    x, dim = args[0], (args[1] if len(args) > 1 else kwargs["dim"])
    new = dim % (x.dim() + 1)
    out_dims = neg_dims([p + (p >= new) for p in nonneg_dims(mode.layout(x), x.dim())], x.dim() + 1)
    return mode.tag_outputs(func(*args, **kwargs), global_shape(x), out_dims)


def _squeeze(mode: RuleContext, func, args, kwargs):
    """Squeeze dims whose *global* size is 1 (a one-row shard must not lose its spatial dim)."""
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    size, spatial = global_size(x, mode.dims), nonneg_dims(mode.layout(x), x.dim())
    gone = [d for d in int_dims(dim, x.dim()) if size[d] == 1]
    if set(gone) & set(spatial):
        raise mode.unsupported(func, "it removes a spatial dim of size 1", "Squeeze batch or channel dims only")
    out = torch.squeeze(x, tuple(gone)) if gone else x.view_as(x)
    out_dims = neg_dims([p - sum(g < p for g in gone) for p in spatial], x.dim() - len(gone))
    return mode.tag_outputs(out, global_shape(x), out_dims)


def _reshape(mode: RuleContext, func, args, kwargs):
    """Reshape the batch and channel dims, keeping the spatial ones last (ShuffleNet's channel shuffle)."""
    x = args[0]
    target = size_args(args[1:]) if len(args) > 1 else list(kwargs.get("shape", kwargs.get("size")))
    if len(target) == 1 and isinstance(target[0], torch.dtype):  # x.view(dtype): a reinterpretation
        return mode.tag_outputs(func(*args, **kwargs), global_shape(x), mode.layout(x))
    shape, d = global_shape(x), mode.dims
    factors = subpixel.block_factors(mode, x, target)
    if factors is not None:  # depth to space or space to depth, written as reshapes (bigconv.ops.subpixel)
        merge, rs = factors
        return (subpixel.merge_spatial if merge else subpixel.split_spatial)(mode, func, x, rs)
    if _flattens_all_but_batch(mode, x, target):  # x.view(N, -1): flatten(1) by another name, as flatten(1) is
        return _flatten_whole(mode, func, x, target)
    lead = tuple(x.shape[: x.dim() - d])
    if (d > 1 and mode.layout(x) == trailing(d) and tuple(target[:-1]) == lead
            and target[-1] in (-1, global_size(x, d)[-d:].numel())):
        return mark_positions(x.reshape(*lead, -1), shape, -1)  # x.reshape(N, C, -1): see bigconv.ops.positions
    if mode.layout(x) != trailing(d) or len(target) < d or tuple(target[-d:]) != tuple(shape):
        out = windows.reshape_map(mode, func, x, target)  # window partitions and merges (bigconv.ops.windows)
        if out is not None:
            return out
        raise mode.unsupported(func, f"it reshapes an image of spatial shape {shape} into {tuple(target)}, "
                               "moving values across its spatial dims", FLATTEN_FIX)
    out = func(x, (*target[:-d], *mode.executor.local_shape(shape)))
    return mark(out, shape)


def _flattens_all_but_batch(mode: RuleContext, x: torch.Tensor, target: list) -> bool:
    """The reshape is ``x.flatten(1)``: ``(N, everything else)`` (MONAI SegResNetVAE's ``view(-1, 256)`` of a
    4x4 map, ``x.view(x.size(0), -1)`` before a classifier), channels and spatial dims merged."""
    size = global_size(x, mode.dims)
    if x.dim() < 3 or len(target) != 2 or any(not isinstance(t, int) for t in target):
        return False
    resolved = windows.resolve(list(target), size.numel())
    return resolved[0] == size[0] and resolved[1] == size[1:].numel() and 0 not in nonneg_dims(mode.layout(x), x.dim())


def _flatten_whole(mode: RuleContext, func, x: torch.Tensor, target: list) -> torch.Tensor:
    """A flatten into a dense head (``bigconv.ops.reduce``'s flatten): the map gathered whole on every worker,
    exactly as a single process sees it, in its layout; only worker 0's copy reaches the loss."""
    spatial = nonneg_dims(mode.layout(x), x.dim())
    order = [p for p in range(x.dim()) if p not in spatial] + spatial
    whole = mode.executor.gather_all(x.permute(order), global_shape(x)).permute([order.index(p) for p in range(x.dim())])
    return torch.reshape(whole, target) if func is torch.reshape else func(whole, target)


def _repeat(mode: RuleContext, func, args, kwargs):
    """repeat / tile: copies along batch or channels only."""
    x = args[0]
    reps = size_args(args[1:]) if len(args) > 1 else list(kwargs.get("repeats", kwargs.get("dims")))
    reps = [1] * (x.dim() - len(reps)) + reps  # tile pads short repeats on the left
    if any(reps[d] != 1 for d in mode.layout(x)):
        raise mode.unsupported(func, "it repeats along a spatial dim", "Repeat along batch or channels only")
    return mode.tag_outputs(func(*args, **kwargs), global_shape(x), mode.layout(x))


def _expand(mode: RuleContext, func, args, kwargs):
    x = args[0]
    sizes = size_args(args[1:]) if len(args) > 1 else list(kwargs["size"])
    shape, dims = global_shape(x), mode.layout(x)
    local = mode.executor.local_shape(shape)
    for d, g, n in zip(dims, shape, local):
        if sizes[d] not in (-1, g):
            raise mode.unsupported(func, f"it expands spatial dim {d} to {sizes[d]}", "Expand batch or channels only")
        sizes[d] = n
    return mode.tag_outputs(x.expand(*sizes), shape, dims)


def _expand_as(mode: RuleContext, func, args, kwargs):
    x, other = args[0], args[1]
    if global_shape(other) is None:
        raise mode.unsupported(func, "it expands a sharded tensor to an unsharded one", "Expand to a sharded tensor")
    out = x.expand(other.shape)
    return mode.tag_outputs(out, global_shape(other), mode.layout(other))


def _expand_whole(mode: RuleContext, func, args, kwargs, replicated: bool):
    """A map constant along its spatial dims (a pooled context vector) expanded to an image's size."""
    x = args[0]
    sizes = size_args(args[1:]) if len(args) > 1 else list(kwargs["size"])
    d = mode.dims
    if len(sizes) > d and tuple(sizes[-d:]) in mode.known and not replicated:
        shape = tuple(sizes[-d:])
        return mark(x.expand(*sizes[:-d], *mode.executor.local_shape(shape)), shape)
    out = func(*args, **kwargs)
    return mode.after_replicated(out) if replicated else out


# -- sizes and factories ------------------------------------------------------------------------------
def _size(mode: RuleContext, func, args, kwargs):
    x = args[0]
    size = global_size(x, mode.dims)
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    return size if dim is None else size[dim]


def _query(mode: RuleContext, func, args, kwargs):
    """Questions about the local tensor whose answer is the same for the whole image (dim, dtype, ...)."""
    out = func(*args, **kwargs)
    if isinstance(out, torch.Tensor):
        raise mode.unsupported(func, "it returns a tensor that mixes spatial positions", "File an issue naming it")
    return out


QUERIES = """dim ndimension element_size is_contiguous is_floating_point is_complex stride storage_offset data_ptr
__len__ __format__ __repr__ __hash__ register_hook retain_grad get_device untyped_storage is_pinned
is_shared is_set_to __reduce_ex__ __deepcopy__ __setstate__""".split()


def _numel(mode: RuleContext, func, args, kwargs):
    return global_size(args[0], mode.dims).numel()


def _shape_property(mode: RuleContext, func, args, kwargs):
    return global_size(args[0], mode.dims)


def _data_property(mode: RuleContext, func, args, kwargs):
    x = args[0]
    return mark(func(*args, **kwargs), global_shape(x), mode.layout(x))


def _image_size(mode: RuleContext, size: list) -> tuple[int, ...] | None:
    d = mode.dims
    if len(size) > d and all(isinstance(s, int) for s in size) and tuple(size[-d:]) in mode.known:
        return tuple(size[-d:])
    return None


_FACTORY_SIZE_ARG = {"zeros": 0, "ones": 0, "empty": 0, "full": 0,
                     "new_zeros": 1, "new_ones": 1, "new_empty": 1, "new_full": 1}


def _factory(mode: RuleContext, func, args, kwargs, replicated: bool = False):
    """``torch.zeros(x.shape)``, ``x.new_zeros(n, c, h, w)``: the size a single process asked for, this shard's part."""
    name = func.__name__
    first = _FACTORY_SIZE_ARG[name]
    rest = list(args[first:])
    value_args = []
    if name in ("full", "new_full"):  # (size, fill_value)
        value_args = rest[1:2] if len(rest) > 1 else []
        rest = rest[:1] if value_args else rest
    size = size_args(rest) if rest else list(kwargs.get("size", ()))
    shape = _image_size(mode, size)
    if shape is None:
        return func(*args, **kwargs)
    local = (*size[: len(size) - mode.dims], *mode.executor.local_shape(shape))
    kwargs = {k: v for k, v in kwargs.items() if k != "size"}
    return mark(func(*args[:first], local, *value_args, **kwargs), shape)


# -- indexing -----------------------------------------------------------------------------------------
def _getitem(mode: RuleContext, func, args, kwargs):
    x, index = args[0], args[1]
    shape = global_shape(x)
    if shape is None:
        raise mode.unsupported(func, "it indexes with a sharded tensor", "Index with unsharded tensors.")
    index = index if isinstance(index, tuple) else (index,)
    if sum(isinstance(i, torch.Tensor) or isinstance(i, list) for i in index) > 1:
        raise mode.unsupported(func, "it mixes several index tensors", "Index channels or batch with ints and slices.")
    if Ellipsis in index:
        pos = index.index(Ellipsis)
        fill = x.dim() - (len(index) - 1 - sum(i is None for i in index))
        index = index[:pos] + (slice(None),) * fill + index[pos + 1:]
    index = index + (slice(None),) * (x.dim() - sum(i is not None for i in index))  # x[:, :, 2:5] cuts H only
    spatial = nonneg_dims(mode.layout(x), x.dim())
    crops = slicing.spatial_slices(mode, func, index, spatial)
    if crops is not None:  # slice the other dims here, then crop the spatial ones (bigconv.ops.slicing)
        rest = tuple(slice(None) if pos in crops else i for pos, i in enumerate(index))
        return slicing.crop(mode, func, _getitem(mode, func, (x, rest), {}), [crops[p] for p in sorted(crops)])
    out_pos, in_dim, out_dims = 0, 0, {}
    for i in index:
        if i is None:
            out_pos += 1
            continue
        if in_dim in spatial:
            out_dims[in_dim] = out_pos
        if not isinstance(i, int):
            out_pos += 1
        in_dim += 1
    for d in range(in_dim, x.dim()):  # dims the index leaves untouched
        if d in spatial:
            out_dims[d] = out_pos
        out_pos += 1
    out = func(*args, **kwargs)
    return mode.tag_outputs(out, shape, neg_dims([out_dims[p] for p in spatial], out.dim()))


def _setitem(mode: RuleContext, func, args, kwargs):
    """``x[..., i] = v`` writing batch or channel entries at every position (MONAI's ``Warp`` scales each
    coordinate of its channels-last grid): this shard's positions, with ``v`` sharded alike or constant
    along the spatial dims."""
    x, index, value = args[0], args[1], args[2]
    index = index if isinstance(index, tuple) else (index,)
    if Ellipsis in index:
        pos = index.index(Ellipsis)
        fill = x.dim() - (len(index) - 1 - sum(i is None for i in index))
        index = index[:pos] + (slice(None),) * fill + index[pos + 1:]
    if any(i is None for i in index):
        raise mode.unsupported(func, "it assigns through new dims (None)", "Index without None")
    index = index + (slice(None),) * (x.dim() - len(index))
    spatial = nonneg_dims(mode.layout(x), x.dim())
    if any(index[p] != slice(None) for p in spatial):
        raise mode.unsupported(func, "it assigns to part of a spatial dim, which is split over the grid",
                               "Assign whole spatial dims (x[:, c] = ...), or build the tensor with torch.where")
    if isinstance(value, torch.Tensor) and global_shape(value) is None and value.dim() > 0:
        raise mode.unsupported(func, f"it assigns an unsharded tensor of shape {tuple(value.shape)} to a sharded one",
                               "Assign a tensor computed from the sharded map, or a number")
    return func(*args, **kwargs)


def _value(mode: RuleContext, func, args, kwargs):
    raise mode.unsupported(func, "it reads a sharded tensor's values into Python, which would be this shard's "
                           "values, not the image's", "Reduce to a global value first (e.g. x.sum(), x.amax()), "
                           "or keep the computation in tensors")


def _value_whole(mode: RuleContext, func, args, kwargs, replicated: bool):
    if isinstance(args[0], torch.Tensor) and args[0].is_meta:
        raise mode.unsupported(func, "it reads a tensor's value into Python, which the dry run (on meta tensors, before "
                               "any remote work) cannot know", "Keep data-dependent choices out of forward, or compute "
                               "them in tensors (torch.where)")
    return func(*args, **kwargs)


def _set_flag(mode: RuleContext, func, args, kwargs):
    """``x.requires_grad = False`` on a sharded tensor (MONAI's ``Warp`` on its reference grid): this shard's
    tensor's own flag, as one process sets it on the whole."""
    return func(*args, **kwargs)


def _register() -> None:
    for owner, names in ((torch, POINTWISE_TORCH), (torch.Tensor, POINTWISE_TENSOR),
                         (torch.nn.functional, POINTWISE_F)):
        for n in names:
            if hasattr(owner, n):
                RULES[getattr(owner, n)] = pointwise
    table = {
        _cat: (torch.cat, torch.concat, torch.concatenate),
        _stack: (torch.stack,),
        _split_like: tuple(getattr(o, n) for o in (torch, torch.Tensor)
                           for n in ("chunk", "split", "tensor_split", "narrow", "unbind", "select")),
        _permute: tuple(getattr(o, n) for o in (torch, torch.Tensor)
                        for n in ("permute", "transpose", "swapaxes", "swapdims", "movedim", "moveaxis")),
        _unsqueeze: (torch.unsqueeze, torch.Tensor.unsqueeze),
        _squeeze: (torch.squeeze, torch.Tensor.squeeze),
        _reshape: (torch.reshape, torch.Tensor.reshape, torch.Tensor.view),
        _repeat: (torch.Tensor.repeat, torch.tile, torch.Tensor.tile),
        _expand: (torch.Tensor.expand, torch.broadcast_to),
        _expand_as: (torch.Tensor.expand_as,),
        _size: (torch.Tensor.size,),
        _numel: (torch.Tensor.numel, torch.numel),
        _query: tuple(getattr(torch.Tensor, n) for n in QUERIES if hasattr(torch.Tensor, n)),
        _factory: tuple(getattr(torch.Tensor, n) for n in ("new_zeros", "new_ones", "new_empty", "new_full")),
        _getitem: (torch.Tensor.__getitem__,),
        _setitem: (torch.Tensor.__setitem__,),
        _value: (torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__,
                 torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.numpy),
    }
    for rule, funcs in table.items():
        for f in funcs:
            RULES[f] = rule
    aware = [pointwise, _reshape, _cat, _stack, _split_like, _permute, _unsqueeze, _squeeze, _repeat, _expand,
             _expand_as, _size, _numel, _query, _factory, _getitem, _setitem, _value]
    LAYOUT_AWARE.update(f for f, rule in RULES.items() if rule in aware)
    RULES[torch.Tensor.requires_grad.__set__] = _set_flag
    LAYOUT_AWARE.add(torch.Tensor.requires_grad.__set__)
    for f in (torch.zeros, torch.ones, torch.empty, torch.full,  # rand/randn: bigconv.ops.random
              torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_empty, torch.Tensor.new_full):
        WHOLE_RULES[f] = _factory
    for f in table[_value]:
        WHOLE_RULES[f] = _value_whole
    WHOLE_RULES[torch.Tensor.expand] = _expand_whole
    WHOLE_RULES[torch.broadcast_to] = _expand_whole
    PROPERTY_RULES.update(shape=_shape_property, data=_data_property)


_register()
