"""Rules for an image's positions flattened into one dim, and reductions over them.

``x.flatten(2)``, ``x.reshape(N, C, -1)`` or ``x.view(N, C, H * W)`` of a sharded map gives, on each
shard, that shard's positions in one dim (in its own order; ``shards.mark_positions``). What is
exact on such a tensor is what does not care where a position sits in that dim:

- per-position math: pointwise ops (other operands constant along the positions), ``unsqueeze``,
  ``squeeze``, ``transpose``/``permute``, reshapes that keep the positions' dim whole, ``softmax``
  or sums over other dims, ``matmul`` of one side's positions with an ordinary matrix;
- reductions over the positions, which become global: ``sum``/``mean`` and ``matmul``/``bmm``/
  ``einsum`` contracting them (a partial sum per shard, summed over every shard by the executor,
  as ``bigconv.ops.reduce`` does for sums over spatial dims), ``amax``/``amin`` (its
  ``global_extreme``), and ``softmax``/``log_softmax``/``logsumexp`` (a global maximum, then a
  global sum of exponentials: log-sum-exp, whose gradient flows through the global sum).

Anything else given such a tensor (attention between positions, unflattening back to a map,
indexing a position) is refused, in the dry run, before any remote work. Global attention
pooling (timm's ``GlobalContext``, attention-pooling heads) is exact this way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .context import RuleContext
from .dims import int_dims, size_args
from .layout import POINTWISE_F, POINTWISE_TENSOR, POINTWISE_TORCH
from .reduce import global_extreme
from .shards import WindowGrid, bind, lead, mark, mark_positions, positions, prefix, trail, tree_flatten
from .windows import local_windows, positions_to_map


RULES: dict = {}
"""Rules for calls with a sharded argument (none here: see ``POSITION_RULES``)."""
WHOLE_RULES: dict = {}
LAYOUT_AWARE: set = set()
PROPERTY_RULES: dict = {}
POSITION_RULES: dict = {}
"""Rules for calls with an argument of flattened positions: ``rule(mode, func, args, kwargs)``."""

FIX = ("After flattening an image's positions (flatten(2), reshape(N, C, -1)), use only per-position math and "
       "reductions over them: softmax/log_softmax/logsumexp, sum, mean, amax/amin over that dim, or matmul/bmm/einsum "
       "contracting it. To feed a dense head, pool globally first (AdaptiveAvgPool2d(1))")


def refuse(mode: RuleContext, func, reason: str = "it is not a reduction over them or per-position math"):
    return mode.unsupported(func, f"it acts on an image's positions flattened into one dim, which each shard holds "
                            f"its own part of, and {reason}", FIX)


def _count(shape) -> int:
    n = lead(shape) * trail(shape)  # windows flattened with whole items in front and behind (bigconv.ops.windows)
    for s in shape:
        n *= s
    return n + prefix(shape)  # whole tokens in front (a ViT's class token: bigconv.ops.prefix)


def split_prefix(t: torch.Tensor):
    """``(the whole leading tokens, the rest)`` of flattened positions behind whole tokens (``shards.Prefixed``),
    the rest marked with the image's plain shape; ``(None, t)`` without them."""
    shape, dim = positions(t)
    p = prefix(shape)
    if not p:
        return None, t
    k = dim % t.dim()
    rest = mark_positions(t.narrow(k, p, t.shape[k] - p), tuple(shape), dim)
    return t.narrow(k, 0, p), rest


def no_prefix(mode: RuleContext, func, t: torch.Tensor) -> None:
    """Refuse ``func`` on positions behind whole tokens where its rule would count those tokens once per shard."""
    if prefix(positions(t)[0]):
        raise refuse(mode, func, "they follow whole tokens every shard holds (a class token), which this reduction "
                     "over the positions does not handle; slice them off first (x[:, 1:])")


def _flat(mode: RuleContext, func, leaves) -> tuple[tuple[int, ...], list]:
    """The one image the flattened operands come from, and those operands."""
    flats = [t for t in leaves if positions(t) is not None]
    shapes = {positions(t)[0] for t in flats}
    if len(shapes) != 1:
        raise refuse(mode, func, f"they come from images of different shapes {sorted(shapes)}")
    return shapes.pop(), flats


def global_size(t: torch.Tensor) -> torch.Size:
    shape, dim = positions(t)
    size = list(t.shape)
    size[dim] = _count(shape)
    return torch.Size(size)


def gather_positions(mode: RuleContext, t):
    """The whole image's positions, in a single process's order, on every worker (differentiably);
    anything else as it is."""
    if positions(t) is None:
        return t
    head, t = split_prefix(t)
    if head is not None:  # whole tokens in front: every shard holds them already
        return torch.cat([head, gather_positions(mode, t)], positions(t)[1] % t.dim())
    shape, dim = positions(t)
    k = dim % t.dim()
    moved = t.movedim(k, -1)
    # windows merged with whole items (bigconv.ops.windows): the batch in front, a block's rows behind
    local = moved.reshape(*moved.shape[:-1], lead(shape), *mode.executor.local_shape(shape), trail(shape))
    local = local.movedim(-1, -len(shape) - 1)  # (..., lead, trail, *windows): the spatial dims last
    whole = mode.executor.gather_all(local, tuple(shape)).movedim(-len(shape) - 1, -1)
    return whole.reshape(*whole.shape[: whole.dim() - len(shape) - 2], -1).movedim(-1, k)


# -- per-position ops -----------------------------------------------------------------------------
def _pointwise(mode: RuleContext, func, args, kwargs):
    leaves = tree_flatten((args, kwargs))[0]
    shape, flats = _flat(mode, func, leaves)
    out_dim = {positions(t)[1] for t in flats}
    if len(out_dim) != 1:
        raise refuse(mode, func, "its operands hold the positions in different dims")
    dim = out_dim.pop()
    full = {}
    for t in leaves:
        if isinstance(t, torch.Tensor) and positions(t) is None and t.dim() >= -dim and t.shape[dim] != 1:
            if t.shape[dim] != _count(shape):
                raise refuse(mode, func, f"an operand of shape {tuple(t.shape)} varies along the positions")
            # As long as every position, in one process's order (Swin's shifted-window mask, a row per window;
            # a ViT's position embedding over its patch tokens): this shard's part
            full[id(t)] = localize(mode, t, shape, dim)
    if full:
        args, kwargs = _swap((args, kwargs), full)
    return _mark(func(*args, **kwargs), shape, dim)


def localize(mode: RuleContext, t: torch.Tensor, shape, dim: int) -> torch.Tensor:
    """This shard's part of ``t`` whose ``dim`` holds every position (and the whole tokens in front, a ViT's
    position embedding of its class token)."""
    p = prefix(shape)
    if not p:
        return local_windows(mode, t, shape, dim)
    k = dim % t.dim()
    rest = local_windows(mode, t.narrow(k, p, t.shape[k] - p), tuple(shape), dim)
    return torch.cat([t.narrow(k, 0, p), rest], k)


def _swap(tree, new: dict):
    if isinstance(tree, torch.Tensor):
        return new.get(id(tree), tree)
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return type(tree)(_swap(v, new) for v in tree)
    if isinstance(tree, dict):
        return {k: _swap(v, new) for k, v in tree.items()}
    return tree


def _mark(out, shape, dim: int):
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor) and t.dim() >= -dim:
            mark_positions(t, shape, dim)
    return out


def _moved(func, x: torch.Tensor, args, kwargs) -> int:
    """Where ``x``'s positions dim is after a permute, transpose, unsqueeze or squeeze."""
    shape, dim = positions(x)
    n, name, pos = x.dim(), func.__name__, positions(x)[1] % x.dim()
    rest = list(args[1:])
    if name == "unsqueeze":
        new = (rest[0] if rest else kwargs["dim"]) % (n + 1)
        return pos + (new <= pos) - (n + 1)
    if name in ("transpose", "swapaxes", "swapdims"):
        a, b = [d % n for d in rest[:2]]
        pos = b if pos == a else a if pos == b else pos
        return pos - n
    perm = [d % n for d in (size_args(rest) if rest else kwargs["dims"])]
    return perm.index(pos) - n


def _layout(mode: RuleContext, func, args, kwargs):
    x = args[0]
    shape, _ = positions(x)
    return mark_positions(func(*args, **kwargs), shape, _moved(func, x, args, kwargs))


def _squeeze(mode: RuleContext, func, args, kwargs):
    x = args[0]
    shape, dim = positions(x)
    dim_arg = args[1] if len(args) > 1 else kwargs.get("dim")
    size = global_size(x)
    gone = [d for d in int_dims(dim_arg, x.dim()) if size[d] == 1]
    out = torch.squeeze(x, tuple(gone)) if gone else x.view_as(x)
    pos = dim % x.dim()
    return mark_positions(out, shape, pos - sum(g < pos for g in gone) - out.dim())


def _reshape(mode: RuleContext, func, args, kwargs):
    """A reshape that keeps the positions' dim whole and reshapes the dims before and after it apart."""
    x = args[0]
    shape, dim = positions(x)
    target = size_args(args[1:]) if len(args) > 1 else list(kwargs.get("shape", kwargs.get("size")))
    size, total = global_size(x), _count(shape)
    if -1 in target:
        known = _count(t for t in target if t != -1)
        target = [size.numel() // known if t == -1 else t for t in target]
    pos = dim % x.dim()
    before, after = _count(size[:pos]), _count(size[pos + 1:])
    out = _back_to_map(mode, func, x, shape, target, before, after)
    if out is not None:
        return out
    for k, t in enumerate(target):
        if t == total and _count(target[:k]) == before and _count(target[k + 1:]) == after:
            local = [*target[:k], x.shape[pos], *target[k + 1:]]
            return mark_positions(func(x, local), shape, k - len(target))
    if prefix(shape):
        raise refuse(mode, func, f"it reshapes them, behind whole tokens (a class token), into {tuple(target)}")
    grid = shape if isinstance(shape, WindowGrid) else WindowGrid(shape)  # an image's positions: no whole items
    out = positions_to_map(mode, func, x, grid, dim, target)
    if out is not None:  # back into a map (of windows), or merged with whole dims (bigconv.ops.windows)
        return out
    raise refuse(mode, func, f"it reshapes them into {tuple(target)}, mixing the positions with other dims")


def _back_to_map(mode: RuleContext, func, x: torch.Tensor, shape, target: list, before: int, after: int):
    """An image's plain positions reshaped into its map: the image's spatial sizes in a row of ``target``, the
    dims before and after them the positions' own (a size-1 spatial dim, ``(N, C, 32, 1)`` of ``(N, C, 32)``,
    which the positions' own reshape would read as a new dim behind them; a 1D map's ``(N, C, L)``, when
    its positions are last). None when the reshape is no such thing."""
    d = len(shape)
    if prefix(shape) or lead(shape) * trail(shape) != 1:
        return None
    for j in range(len(target) - d + 1):
        if tuple(target[j:j + d]) != tuple(shape) or _count(target[:j]) != before or _count(target[j + d:]) != after:
            continue
        if d == 1 and not (after == 1 and j + d == len(target)):  # a 1D map's positions stay positions elsewhere
            continue
        local = [*target[:j], *mode.executor.local_shape(tuple(shape)), *target[j + d:]]
        return mark(func(x, local) if func is not torch.reshape else torch.reshape(x, local), tuple(shape),
                    tuple(range(j - len(target), j + d - len(target))))
    return None


def _flatten(mode: RuleContext, func, args, kwargs):
    """``flatten(start, end)``: the reshape it is (``bigconv.ops.windows`` merges windows with whole dims)."""
    b = bind(("input", "start_dim", "end_dim"), args, kwargs)
    x = b["input"]
    size = global_size(x)
    if x.dim() == 0:
        return func(*args, **kwargs)
    start, end = b.get("start_dim", 0) % x.dim(), b.get("end_dim", -1) % x.dim()
    target = [*size[:start], _count(size[start:end + 1]), *size[end + 1:]]
    return _reshape(mode, torch.reshape, (x, target), {})


def _pad(mode: RuleContext, func, args, kwargs):
    """``F.pad`` of dims other than the positions (timm ``HaloAttn``'s relative logits): per position."""
    b = bind(("input", "pad"), args, kwargs)
    x, pad = b["input"], list(b["pad"])
    shape, dim = positions(x)
    padded = [x.dim() - 1 - i // 2 for i, p in enumerate(pad) if p]
    if dim % x.dim() in padded:
        raise refuse(mode, func, "it pads the positions themselves")
    return mark_positions(func(*args, **kwargs), shape, dim % x.dim() - x.dim())


def _expand(mode: RuleContext, func, args, kwargs):
    """``expand`` of dims other than the positions (their size given as -1 or the whole count)."""
    x = args[0]
    sizes = size_args(args[1:]) if len(args) > 1 else list(kwargs["size"])
    shape, dim = positions(x)
    k = dim % x.dim() + len(sizes) - x.dim()
    if sizes[k] not in (-1, global_size(x)[dim]):
        raise refuse(mode, func, f"it expands the positions to {sizes[k]}")
    sizes[k] = -1
    return mark_positions(x.expand(*sizes), shape, dim % x.dim() - x.dim())


def _expand_as(mode: RuleContext, func, args, kwargs):
    """``t.expand_as(x)`` to a tensor of flattened positions: a token (size 1 along them, smp DPT's readout of the
    class token beside every patch token) repeated at this shard's positions; or positions to their own shape."""
    t, other = args[0], args[1] if len(args) > 1 else kwargs["other"]
    mark = positions(other)
    if mark is None or (positions(t) is not None and positions(t) != mark):
        raise refuse(mode, func, "it expands to a tensor that does not hold the same positions")
    k = mark[1] % other.dim()
    if positions(t) is None and t.dim() >= other.dim() - k and t.shape[k - other.dim()] != 1:
        raise refuse(mode, func, f"an operand of shape {tuple(t.shape)} varies along the positions")
    return mark_positions(t.expand(other.shape), mark[0], mark[1] % other.dim() - other.dim())


def _shape_property(mode: RuleContext, func, args, kwargs):
    return global_size(args[0])


def _size(mode: RuleContext, func, args, kwargs):
    size = global_size(args[0])
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    return size if dim is None else size[dim]


def _query(mode: RuleContext, func, args, kwargs):
    return func(*args, **kwargs)


# -- reductions -----------------------------------------------------------------------------------
def _over(mode: RuleContext, x: torch.Tensor, dim) -> tuple[list[int], bool]:
    """The dims reduced, and whether the positions are among them."""
    dims = int_dims(dim, x.dim())
    return dims, positions(x)[1] % x.dim() in dims


def _after(x: torch.Tensor, dims: list[int], keepdim: bool) -> int:
    pos = positions(x)[1] % x.dim()
    n = x.dim() if keepdim else x.dim() - len(dims)
    return (pos if keepdim else pos - sum(d < pos for d in dims)) - n


def _sum_mean(mode: RuleContext, func, args, kwargs):
    b = bind(("input", "dim", "keepdim"), args, kwargs)
    x, keepdim = b["input"], bool(b.get("keepdim", False))
    dims, over = _over(mode, x, b.get("dim"))
    if not over:
        return mark_positions(func(*args, **kwargs), positions(x)[0], _after(x, dims, keepdim))
    extra = {"dtype": b["dtype"]} if "dtype" in b else {}
    size = global_size(x)
    head, rest = split_prefix(x)
    total = mode.executor.allsum(torch.sum(rest, dim=dims, keepdim=keepdim, **extra))
    if head is not None:  # whole tokens, on every shard: counted once, their cotangent each shard's own part
        total = total + torch.sum(head, dim=dims, keepdim=keepdim, **extra)
    if func.__name__ != "mean":
        return total
    return total / _count(size[d] for d in dims)


def _extreme(mode: RuleContext, func, args, kwargs):
    name = func.__name__
    b = bind(("input", "dim", "keepdim"), args, kwargs)
    x, keepdim = b["input"], bool(b.get("keepdim", False))
    largest = name in ("amax", "max")
    if isinstance(b.get("dim"), torch.Tensor):
        return _pointwise(mode, func, args, kwargs)  # torch.max(a, b): elementwise
    if name in ("max", "min") and b.get("dim") is None:
        return global_extreme(mode, x, list(range(x.dim())), False, largest)
    dims, over = _over(mode, x, b.get("dim", ()) or None)
    if not over:
        return _mark(func(*args, **kwargs), positions(x)[0], _after(x, dims, keepdim))
    if name in ("max", "min"):
        raise refuse(mode, func, "its indices would be positions in the whole image, which no shard holds")
    no_prefix(mode, func, x)
    return global_extreme(mode, x, dims, keepdim, largest)


def _log_sum_exp(mode: RuleContext, x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global maximum along the positions (a constant: every softmax is invariant to it) and the
    global sum of ``exp(x - max)``, both with ``keepdim``."""
    with torch.no_grad():
        parts = mode.executor.allgather(torch.amax(x, dim=dim, keepdim=True), "softmax maximum")
        top = torch.amax(torch.stack(parts), dim=0)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # all -inf: as torch, nan follows
    total = mode.executor.allsum(torch.exp(x - top).sum(dim=dim, keepdim=True))
    return top, total


def _softmax(mode: RuleContext, func, args, kwargs):
    b = bind(("input", "dim", "_stacklevel", "dtype"), args, kwargs)
    x, dtype = b["input"], b.get("dtype")
    if b.get("dim") is None:
        raise refuse(mode, func, "it runs over all dims")
    shape, pos = positions(x)
    dim = b["dim"] % x.dim()
    if dim != pos % x.dim():  # over channels: per position
        return mark_positions(func(*args, **kwargs), shape, pos)
    no_prefix(mode, func, x)
    if dtype is not None:
        x = mark_positions(x.to(dtype), shape, pos)
    top, total = _log_sum_exp(mode, x, dim)
    if func.__name__ == "log_softmax":
        out = x - top - torch.log(total)
    else:
        out = torch.exp(x - top) / total
    return mark_positions(out, shape, pos)


def _logsumexp(mode: RuleContext, func, args, kwargs):
    b = bind(("input", "dim", "keepdim"), args, kwargs)
    x, keepdim = b["input"], bool(b.get("keepdim", False))
    dims, over = _over(mode, x, b["dim"])
    if not over:
        return mark_positions(func(*args, **kwargs), positions(x)[0], _after(x, dims, keepdim))
    if len(dims) != 1:
        raise refuse(mode, func, "it reduces over the positions and other dims at once")
    no_prefix(mode, func, x)
    top, total = _log_sum_exp(mode, x, dims[0])
    out = top + torch.log(total)
    return out if keepdim else out.squeeze(dims[0])


# -- contractions ---------------------------------------------------------------------------------
def _matmul(mode: RuleContext, func, args, kwargs):
    """``a @ b``: contracting the positions (``a``'s last dim with ``b``'s rows) is a global sum;
    ``a``'s positions as rows, or ``b``'s as columns, times an ordinary matrix is per position."""
    a, b = (args[0], args[1]) if len(args) > 1 else (args[0], kwargs.get("other", kwargs.get("mat2")))
    pa, pb = positions(a), positions(b)
    a_dim = pa[1] % a.dim() if pa else None
    b_dim = pb[1] % b.dim() if pb else None
    contracts_a = pa is not None and a_dim == a.dim() - 1
    contracts_b = pb is not None and (b_dim == b.dim() - 2 if b.dim() >= 2 else True)
    if contracts_a and contracts_b:
        if pa[0] != pb[0]:
            raise refuse(mode, func, f"they come from images of different shapes {pa[0]} and {pb[0]}")
        no_prefix(mode, func, a)
        return mode.executor.allsum(func(*args, **kwargs))
    if pa is not None and pb is None and a.dim() >= 2 and b.dim() >= 2 and a_dim == a.dim() - 2:
        return mark_positions(func(*args, **kwargs), pa[0], -2)
    if pb is not None and pa is None and b.dim() >= 2 and b_dim == b.dim() - 1:
        return mark_positions(func(*args, **kwargs), pb[0], -1)
    batch_a = pa is not None and a.dim() > 2 and a_dim < a.dim() - 2
    batch_b = pb is not None and b.dim() > 2 and b_dim < b.dim() - 2
    if (batch_a or batch_b) and not (pa is not None and not batch_a) and not (pb is not None and not batch_b):
        # Positions in a batch dim of both (window attention: the windows are a batch): per position
        n = max(a.dim(), b.dim())
        dims = {(pa[1] % a.dim()) - a.dim() if batch_a else None, (pb[1] % b.dim()) - b.dim() if batch_b else None}
        dims.discard(None)
        shapes = {p[0] for p in (pa, pb) if p is not None}
        other = b if batch_a and not batch_b else a if batch_b and not batch_a else None
        if len(dims) == 1 and len(shapes) == 1 and n > 2:
            dim = dims.pop()
            if other is None or other.dim() < -dim or other.shape[dim] == 1:
                return mark_positions(func(*args, **kwargs), shapes.pop(), dim)
    raise refuse(mode, func, "it does not contract the positions of both operands (attention between positions, "
                 "or a matrix as long as the positions, is not decomposable)")


def _einsum(mode: RuleContext, func, args, kwargs):
    equation, operands = args[0], list(args[1:])
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    if not isinstance(equation, str) or "..." in equation or "->" not in equation:
        raise refuse(mode, func, "its equation is not explicit (write 'bcp,bp->bc' with '->' and no '...')")
    inputs, output = equation.replace(" ", "").split("->")
    terms = inputs.split(",")
    letters, shapes = set(), set()
    for term, t in zip(terms, operands):
        p = positions(t)
        if p is not None:
            letters.add(term[p[1] % t.dim()])
            shapes.add(p[0])
    if len(letters) != 1 or len(shapes) != 1:
        raise refuse(mode, func, "its operands hold the positions under different letters")
    letter, shape = letters.pop(), shapes.pop()
    if any(positions(t) is None and letter in term for term, t in zip(terms, operands)):
        raise refuse(mode, func, f"an unflattened operand also runs over the positions' letter {letter!r}")
    if letter not in output and prefix(shape):
        no_prefix(mode, func, next(t for t in operands if positions(t) is not None))
    out = func(*args, **kwargs)
    if letter not in output:
        return mode.executor.allsum(out)
    return mark_positions(out, shape, output.index(letter) - len(output))


def _register() -> None:
    for owner, names in ((torch, POINTWISE_TORCH), (torch.Tensor, POINTWISE_TENSOR), (F, POINTWISE_F)):
        for n in names:
            if hasattr(owner, n):
                POSITION_RULES[getattr(owner, n)] = _pointwise
    table = {
        _layout: tuple(getattr(o, n) for o in (torch, torch.Tensor)
                       for n in ("permute", "transpose", "swapaxes", "swapdims", "unsqueeze")),
        _squeeze: (torch.squeeze, torch.Tensor.squeeze),
        _reshape: (torch.reshape, torch.Tensor.reshape, torch.Tensor.view),
        _flatten: (torch.flatten, torch.Tensor.flatten),
        _pad: (F.pad,),
        _expand: (torch.Tensor.expand,),
        _expand_as: (torch.Tensor.expand_as,),
        _size: (torch.Tensor.size,),
        _query: tuple(getattr(torch.Tensor, n) for n in ("dim", "ndimension", "element_size", "is_floating_point",
                                                          "is_contiguous", "get_device", "__format__", "__repr__")),
        _sum_mean: (torch.sum, torch.Tensor.sum, torch.mean, torch.Tensor.mean),
        _extreme: tuple(getattr(o, n) for o in (torch, torch.Tensor) for n in ("amax", "amin", "max", "min")),
        _softmax: (torch.softmax, torch.Tensor.softmax, torch.log_softmax, torch.Tensor.log_softmax, F.softmax,
                   F.log_softmax),
        _logsumexp: (torch.logsumexp, torch.Tensor.logsumexp),
        _matmul: (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm),
        _einsum: (torch.einsum,),
    }
    for rule, funcs in table.items():
        for f in funcs:
            POSITION_RULES[f] = rule
    if hasattr(torch.Tensor, "__rmatmul__"):
        POSITION_RULES[torch.Tensor.__rmatmul__] = lambda mode, func, args, kwargs: _matmul(
            mode, torch.matmul, (args[1], args[0]), {})
    POSITION_PROPERTY_RULES.update(shape=_shape_property)


POSITION_PROPERTY_RULES: dict = {}
"""Tensor attributes of flattened positions, by name (``x.shape`` answers with the whole image's count)."""
_register()
