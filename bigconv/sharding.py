"""Which tensors are sharded, and what each torch operation means on them.

A sharded tensor is an ordinary local tensor carrying its *global* spatial shape as an attribute;
its extent is the balanced share of that shape at this worker's grid coordinate. ``ShardMode`` is a
``TorchFunctionMode`` that sees every torch call the user's unchanged ``forward`` makes:

- calls with no sharded argument run as they are (weights, the replicated head);
- pointwise and channel-wise calls run on the shard and keep the spec;
- windowed calls (convolution) and global reductions go to an *executor*, which either exchanges
  halos with other workers or, in the driver's dry run, checks the geometry of every shard on meta
  tensors;
- anything else raises ``UnsupportedOperation`` naming the module, so nothing is silently wrong.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from .geometry import Window

GLOBAL_SHAPE_ATTR = "_bigconv_global_shape"
REPLICATED_ATTR = "_bigconv_replicated"
"""Marks a whole spatial map held by every worker: one too small to split over the grid."""


class UnsupportedOperation(ValueError):
    """An operation that cannot be decomposed exactly over spatial shards."""


def tree_flatten(tree: Any) -> tuple[list, None]:
    """The leaves of nested lists, tuples and dicts (torch's own version leaves a reference cycle
    behind on every call, which the mode makes thousands of times per step)."""
    leaves, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (list, tuple)):
            stack.extend(reversed(node))
        elif isinstance(node, dict):
            stack.extend(reversed(list(node.values())))
        else:
            leaves.append(node)
    return leaves, None


def global_shape(t: object) -> tuple[int, ...] | None:
    return getattr(t, GLOBAL_SHAPE_ATTR, None) if isinstance(t, torch.Tensor) else None


def mark(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    setattr(t, GLOBAL_SHAPE_ATTR, tuple(shape))
    return t


def is_replicated(t: object) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, REPLICATED_ATTR, False)


def bind(names: Sequence[str], args: Sequence, kwargs: dict) -> dict:
    """A call's arguments by name (positional first)."""
    return dict(zip(names, args), **kwargs)


def ntuple(value: Any, n: int) -> list:
    return [value] * n if isinstance(value, int) else list(value) * (n if len(value) == 1 else 1)


def with_input(func: Callable, args: Sequence, kwargs: dict) -> Callable:
    """``func`` as called, with its input tensor replaced."""

    def call(t: torch.Tensor):
        if args:
            return func(t, *args[1:], **kwargs)
        return func(**{**kwargs, "input": t})

    return call


class Executor(Protocol):
    """Where shards live: on real workers, or all at once in the driver's dry run."""

    grid: tuple[int, ...]

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]: ...

    def windowed(
        self, x: torch.Tensor, shape: tuple[int, ...], windows: Sequence[Window], op: Callable, where: str
    ) -> torch.Tensor: ...

    def allsum(self, partial: torch.Tensor) -> torch.Tensor: ...


class ModulePath:
    """Tracks which module is running, so errors can name it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.stack: list[str] = []
        for name, module in model.named_modules():
            label = f"'{name or '<root>'}' ({type(module).__name__})"
            module.register_forward_pre_hook(lambda *_, label=label: self._enter(label))
            module.register_forward_hook(lambda *_: self._leave())

    # Hooks must return None: a forward hook's return value replaces the module's output.
    def _enter(self, label: str) -> None:
        self.stack.append(label)

    def _leave(self) -> None:
        if self.stack:
            self.stack.pop()

    @property
    def current(self) -> str:
        return f"module {self.stack[-1]}" if self.stack else "the model's forward"


def _name(func: Callable) -> str:
    qual = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    if "<locals>" in qual:  # F.max_pool2d and friends are boolean_dispatch wrappers
        qual = getattr(func, "__name__", qual)
    if qual.startswith("_TensorBase.") or qual.startswith("TensorBase."):
        qual = "Tensor." + qual.split(".", 1)[1]
    module = getattr(func, "__module__", None) or ""
    return f"{module}.{qual}" if module and not qual.startswith("Tensor.") else qual


class ShardMode(TorchFunctionMode):
    def __init__(self, executor: Executor, path: ModulePath | None = None) -> None:
        super().__init__()
        self.executor = executor
        self.path = path

    @property
    def dims(self) -> int:
        return len(self.executor.grid)

    def where(self) -> str:
        return self.path.current if self.path else "the model's forward"

    def unsupported(self, func: Callable, reason: str, fix: str) -> UnsupportedOperation:
        return UnsupportedOperation(
            f"bigconv cannot decompose {_name(func)} in {self.where()}: {reason}. {fix}"
        )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = tree_flatten((args, kwargs))[0]
        shapes = {global_shape(t) for t in leaves} - {None}
        replicated = any(is_replicated(t) for t in leaves)
        if not shapes:
            out = func(*args, **kwargs)
            return self.after_replicated(out) if replicated else out
        if replicated:  # a small whole map joins a sharded one of its size: use this shard's part
            args, kwargs = tree_map(lambda t: self.localize(t, shapes), (args, kwargs))
        rule = RULES.get(func)
        if rule is not None:
            return rule(self, func, args, kwargs)
        if func in QUERIES or getattr(func, "__name__", "") == "__get__":
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor):
                raise self.unsupported(func, "it returns a tensor that mixes spatial positions", _FIX_GENERIC)
            return out
        name = getattr(func, "__name__", "")
        raise self.unsupported(func, "it is not a pointwise, convolution or global-pooling operation on a spatially "
                               "sharded tensor", _SPECIFIC_FIXES.get(name, _FIX_GENERIC))

    # -- maps too small for the grid ---------------------------------------------------------------
    def localize(self, t: Any, shapes: set) -> Any:
        if not is_replicated(t):
            return t
        shape = tuple(t.shape[t.dim() - self.dims:])
        if shape not in shapes:
            raise UnsupportedOperation(
                f"bigconv cannot join, in {self.where()}, a whole map of spatial shape {shape} with maps "
                f"sharded from {sorted(shapes)}. Join only tensors of the same spatial size")
        return mark(self.executor.local_part(t, shape), shape)

    def after_replicated(self, out: Any) -> Any:
        """Outputs of ops on whole maps: shard them again once they are large enough, else keep them whole."""
        def visit(t):
            if not isinstance(t, torch.Tensor) or t.dim() < self.dims + 2:
                return t
            shape = tuple(t.shape[t.dim() - self.dims:])
            if self.executor.fits(shape):
                return mark(self.executor.local_part(t, shape), shape)
            setattr(t, REPLICATED_ATTR, True)
            return t

        return tree_map(visit, out)

    def windowed_whole(self, x: torch.Tensor, shape, out_shape, whole: Callable) -> torch.Tensor:
        """Compute a windowed op on the whole input, on every worker.

        Used when the output is smaller than the grid (deep layers of a U-Net or ResNet): the few
        positions left are gathered to every worker rather than split into empty shards. Each
        worker's copy reaches the loss only through its own shard of whatever comes next, so the
        summed gradient is the single process's; the dry run takes this path for every op.
        """
        out = whole(self.executor.gather_all(x, shape))
        if self.executor.fits(out_shape):
            return mark(self.executor.local_part(out, out_shape), out_shape)
        setattr(out, REPLICATED_ATTR, True)
        return out

    # -- helpers used by the rules -------------------------------------------------------------
    def one_shape(self, func: Callable, leaves: list) -> tuple[int, ...]:
        shapes = {global_shape(t) for t in leaves} - {None}
        if len(shapes) != 1:
            raise self.unsupported(
                func, f"its inputs are sharded from different global shapes {sorted(shapes)}",
                "Join only tensors of the same spatial size.",
            )
        return shapes.pop()

    def tag_outputs(self, out: Any, shape: tuple[int, ...]) -> Any:
        local = self.executor.local_shape(shape)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dim() > self.dims and tuple(t.shape[-self.dims :]) == local:
                mark(t, shape)
        return out


_FIX_GENERIC = (
    "Express the model with convolutions, pointwise layers and a global pooling head, or file an issue "
    "naming this operation"
)


_FLATTEN_FIX = "Flatten or reshape only after global pooling (e.g. AdaptiveAvgPool2d(1))"
_SPECIFIC_FIXES = {
    "linear": "Apply Linear after global pooling (AdaptiveAvgPoolNd(1) + Flatten), or use a 1x1 convolution to mix "
              "channels per position",
    "reshape": _FLATTEN_FIX, "view": _FLATTEN_FIX,
}


def _pointwise(mode: ShardMode, func, args, kwargs):
    leaves = tree_flatten((args, kwargs))[0]
    shape = mode.one_shape(func, leaves)
    for t in leaves:
        if isinstance(t, torch.Tensor) and global_shape(t) is None and t.dim() > 0:
            trailing = t.shape[-mode.dims :]
            if any(s != 1 for s in trailing) and t.dim() >= 1:
                raise mode.unsupported(
                    func, f"an unsharded operand of shape {tuple(t.shape)} varies along spatial dims",
                    "Give per-position operands a size of 1 in the spatial dims (broadcast), "
                    "or compute them from the input",
                )
    return mode.tag_outputs(func(*args, **kwargs), shape)


def _spatial_dims(mode: ShardMode, ndim: int) -> set[int]:
    return set(range(ndim - mode.dims, ndim))


def _normalize_dims(dim: Any, ndim: int) -> set[int]:
    if dim is None:
        return set(range(ndim))
    dims = [dim] if isinstance(dim, int) else list(dim)
    return {d % ndim for d in dims}


def _cat(mode: ShardMode, func, args, kwargs):
    tensors = args[0] if args else kwargs["tensors"]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if any(global_shape(t) is None for t in tensors):
        raise mode.unsupported(func, "it joins a sharded tensor with an unsharded one", "Join sharded tensors only.")
    shape = mode.one_shape(func, list(tensors))
    ndim = tensors[0].dim()
    if dim % ndim in _spatial_dims(mode, ndim):
        raise mode.unsupported(func, f"it joins along spatial dim {dim}", "Concatenate along channels (dim=1).")
    return mode.tag_outputs(func(*args, **kwargs), shape)


def _getitem(mode: ShardMode, func, args, kwargs):
    x, index = args[0], args[1]
    shape = global_shape(x)
    if shape is None:
        raise mode.unsupported(func, "it indexes with a sharded tensor", "Index with unsharded tensors.")
    index = index if isinstance(index, tuple) else (index,)
    if any(i is None for i in index) or any(isinstance(i, torch.Tensor) and i.dim() > 1 for i in index):
        raise mode.unsupported(func, "it inserts or mixes dims", "Index channels or batch with ints and slices.")
    if Ellipsis in index:
        pos = index.index(Ellipsis)
        index = index[:pos] + (slice(None),) * (x.dim() - len(index) + 1) + index[pos + 1 :]
    spatial = index[x.dim() - mode.dims :] if len(index) > x.dim() - mode.dims else ()
    if any(not (isinstance(i, slice) and i == slice(None)) for i in spatial):
        raise mode.unsupported(func, "it slices a spatial dim", "Slice only batch and channel dims.")
    return mode.tag_outputs(func(*args, **kwargs), shape)


def _reduce(mode: ShardMode, func, args, kwargs, mean: bool):
    x = args[0]
    shape = global_shape(x)
    dim = args[1] if len(args) > 1 else kwargs.get("dim", None)
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    if len(args) > 3 or set(kwargs) - {"dim", "keepdim", "dtype"}:
        raise mode.unsupported(func, "of unexpected arguments", "Call sum/mean(dim, keepdim).")
    dims = _normalize_dims(dim, x.dim())
    spatial = _spatial_dims(mode, x.dim())
    if not dims & spatial:
        return mode.tag_outputs(func(*args, **kwargs), shape)
    if not spatial <= dims:
        raise mode.unsupported(func, "it reduces some spatial dims but not all",
                               "Reduce over all spatial dims at once.")
    sum_kwargs = {"dtype": kwargs["dtype"]} if "dtype" in kwargs else {}
    total = mode.executor.allsum(torch.sum(x, dim=sorted(dims), keepdim=bool(keepdim), **sum_kwargs))
    if not mean:
        return total
    count = 1
    for d in dims:
        count *= shape[d - (x.dim() - mode.dims)] if d in spatial else x.shape[d]
    return total / count


def _flatten(mode: ShardMode, func, args, kwargs):
    b = bind(("input", "start_dim", "end_dim"), args, kwargs)
    x, shape = b["input"], global_shape(b["input"])
    start, end = b.get("start_dim", 0) % x.dim(), b.get("end_dim", -1) % x.dim()
    spatial = _spatial_dims(mode, x.dim())
    if not spatial & set(range(start, end + 1)):
        return mode.tag_outputs(func(*args, **kwargs), shape)
    if end != x.dim() - 1:
        raise mode.unsupported(func, "it merges spatial dims into others but keeps some after them",
                               "Flatten through the last dim (end_dim=-1)")
    # A flatten into a dense head (VGG-style): the map is gathered whole on every worker, exactly
    # as a single process sees it; only worker 0's copy reaches the loss.
    return func(mode.executor.gather_all(x, shape), *args[1:], **kwargs)


def _dropout(mode: ShardMode, func, args, kwargs):
    names = ("input", "p", "training", "inplace")
    bound = dict(zip(names, args), **kwargs)
    if bound.get("training", True) and bound.get("p", 0.5) > 0:
        raise mode.unsupported(
            func, "random masks drawn per shard cannot match a single process",
            "Call net.eval() (or set p=0) to train exactly; dropout in training is not decomposable exactly",
        )
    return bound["input"]


def _conv_windows(kernel: Sequence[int], stride, padding, dilation) -> list[Window]:
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


def _conv(mode: ShardMode, func, args, kwargs):
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    b = dict(zip(names, args), **kwargs)
    x, weight = b["input"], b["weight"]
    shape = global_shape(x)
    if shape is None or global_shape(weight) is not None:
        raise mode.unsupported(func, "its weight is sharded", "Convolve a sharded input with an ordinary weight.")
    stride, dilation, groups = b.get("stride", 1), b.get("dilation", 1), b.get("groups", 1)
    windows = _conv_windows(weight.shape[2:], stride, b.get("padding", 0), dilation)
    if len(windows) != mode.dims:
        raise mode.unsupported(func, f"it is {len(windows)}D on a {mode.dims}D grid",
                               "Use a grid with one axis per spatial dim.")

    def op(region: torch.Tensor, padding=0, bias: bool = True) -> torch.Tensor:
        return func(region, weight, b.get("bias") if bias else None, stride, padding, dilation, groups)

    out_shape = tuple(w.out_size(n) for w, n in zip(windows, shape))
    if all(m > 0 for m in out_shape) and not mode.executor.fits(out_shape):
        return mode.windowed_whole(x, shape, out_shape, with_input(func, args, kwargs))
    return mode.executor.windowed(x, shape, windows, op, mode.where())


POINTWISE_TORCH = """add sub subtract mul multiply div divide true_divide neg negative abs exp expm1 log log1p sqrt
rsqrt pow square reciprocal sigmoid tanh relu relu_ clamp clamp_ clip maximum minimum where sin cos erf floor ceil
round sign lerp addcmul addcdiv hardtanh rrelu selu celu threshold logit nan_to_num eq ne lt le gt ge
logical_and logical_or logical_not isnan isfinite sigmoid_ tanh_ exp_ fmod remainder""".split()
POINTWISE_TENSOR = POINTWISE_TORCH + """__add__ __radd__ __iadd__ __sub__ __rsub__ __isub__ __mul__ __rmul__
__imul__ __truediv__ __rtruediv__ __itruediv__ __neg__ __pos__ __abs__ __pow__ __rpow__ __ipow__ __eq__ __ne__
__lt__ __le__ __gt__ __ge__ __and__ __or__ __invert__ add_ sub_ mul_ div_ clamp_ pow_ relu_ abs_ neg_ contiguous
clone to float double half bfloat16 type type_as detach detach_ requires_grad_ cpu cuda masked_fill
masked_fill_ fill_ zero_ copy_""".split()
POINTWISE_F = """relu relu_ relu6 leaky_relu leaky_relu_ elu elu_ selu selu_ celu celu_ gelu silu mish hardtanh
hardtanh_ hardswish hardsigmoid sigmoid tanh softplus softsign tanhshrink threshold threshold_ logsigmoid prelu
rrelu""".split()

QUERIES = {
    getattr(torch.Tensor, n)
    for n in """size dim ndimension numel element_size is_contiguous is_floating_point is_complex stride
    storage_offset data_ptr __len__ __format__ __repr__ __hash__ register_hook retain_grad get_device""".split()
    if hasattr(torch.Tensor, n)
}

RULES: dict[Callable, Callable] = {}
for _owner, _names in ((torch, POINTWISE_TORCH), (torch.Tensor, POINTWISE_TENSOR), (F, POINTWISE_F)):
    for _n in _names:
        if hasattr(_owner, _n):
            RULES[getattr(_owner, _n)] = _pointwise
RULES.update({torch.cat: _cat, torch.concat: _cat, torch.concatenate: _cat, torch.Tensor.__getitem__: _getitem})
for _f in (torch.sum, torch.Tensor.sum):
    RULES[_f] = lambda mode, func, args, kwargs: _reduce(mode, func, args, kwargs, mean=False)
for _f in (torch.mean, torch.Tensor.mean):
    RULES[_f] = lambda mode, func, args, kwargs: _reduce(mode, func, args, kwargs, mean=True)
for _f in (torch.flatten, torch.Tensor.flatten):
    RULES[_f] = _flatten
for _f in (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout):
    RULES[_f] = _dropout
for _f in (F.conv1d, F.conv2d, F.conv3d):
    RULES[_f] = _conv


from . import rules_norm, rules_window  # noqa: E402,F401  (they add their rules to RULES)
