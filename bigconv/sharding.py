"""Which tensors are sharded, and what each torch operation means on them.

A sharded tensor is an ordinary local tensor carrying its *global* spatial shape as an attribute,
and, when a layout op moved them (``permute`` to channels-last), the positions of its spatial dims
counted from the end. Its extent is the balanced share of that shape at this worker's grid
coordinate. ``ShardMode`` is a ``TorchFunctionMode`` that sees every torch call the user's
unchanged ``forward`` makes:

- size queries (``x.shape``, ``x.size()``, ``x.numel()``) answer with the global shape, so code
  that computes sizes from its input (``F.interpolate(y, size=x.shape[-2:])``, TF "same" padding)
  computes what a single process computes; factories given such a size build this shard's part;
- calls with no sharded argument run as they are (weights, the replicated head), except those that
  turn a whole map into one of an image's size (``interpolate``, ``expand``), which build this
  shard's part of the result;
- every other call on a sharded tensor goes to its rule (``rules_layout``, ``rules_reduce``,
  ``rules_window``, ``rules_norm``), which runs it on the shard and exchanges what it needs through
  an *executor*;
- anything else raises ``UnsupportedOperation`` naming the module, so nothing is silently wrong.

Why the mode answers size queries rather than a tensor subclass carrying the global shape (as
DTensor and ShardTensor do): the mode already sees every call of the forward, so one object holds
the whole contract, every intermediate tensor stays a plain tensor that PyTorch's kernels and
autograd handle at full speed, and the driver's dry run executes the very same rules on meta
tensors (``bigconv.dry_run``).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Protocol, Sequence

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

GLOBAL_SHAPE_ATTR = "_bigconv_global_shape"
SPATIAL_DIMS_ATTR = "_bigconv_spatial_dims"
"""Negative positions of the spatial dims, in grid-axis order, when they are not the trailing ones."""
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


def trailing(n: int) -> tuple[int, ...]:
    return tuple(range(-n, 0))


def spatial_dims(t: torch.Tensor, n: int) -> tuple[int, ...]:
    """Negative positions of a sharded tensor's spatial dims (the last ``n`` unless a layout op moved them)."""
    return getattr(t, SPATIAL_DIMS_ATTR, None) or trailing(n)


def mark(t: torch.Tensor, shape: Sequence[int], dims: Sequence[int] | None = None) -> torch.Tensor:
    setattr(t, GLOBAL_SHAPE_ATTR, tuple(shape))
    if dims is not None and tuple(dims) != trailing(len(shape)):
        setattr(t, SPATIAL_DIMS_ATTR, tuple(dims))
    elif SPATIAL_DIMS_ATTR in t.__dict__:
        delattr(t, SPATIAL_DIMS_ATTR)
    return t


def global_size(t: torch.Tensor, n: int) -> torch.Size:
    """The size a single process sees for sharded ``t``."""
    size = list(t.shape)
    for d, g in zip(spatial_dims(t, n), global_shape(t)):
        size[d] = g
    return torch.Size(size)


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
    """Where this shard lives and how it talks to the others (``executors.ShardExecutor``)."""

    grid: tuple[int, ...]

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]: ...

    def local_part(self, t: torch.Tensor, shape: Sequence[int], dims: Sequence[int] | None = None
                   ) -> torch.Tensor: ...

    def fits(self, shape: Sequence[int]) -> bool: ...

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


def op_name(func: Callable) -> str:
    qual = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    if "<locals>" in qual:  # F.max_pool2d and friends are boolean_dispatch wrappers
        qual = getattr(func, "__name__", qual)
    if qual.startswith("_TensorBase.") or qual.startswith("TensorBase."):
        qual = "Tensor." + qual.split(".", 1)[1]
    if qual == "__get__" and hasattr(func, "__self__"):
        qual = f"Tensor.{func.__self__.__name__}"
    module = getattr(func, "__module__", None) or ""
    return f"{module}.{qual}" if module and not qual.startswith("Tensor.") else qual


RULES: dict[Callable, Callable] = {}
"""Rules for calls with a sharded argument: ``rule(mode, func, args, kwargs)``."""
WHOLE_RULES: dict[Callable, Callable] = {}
"""Rules for calls without one that may build a sharded result (factories, upsampling a whole map)."""
LAYOUT_AWARE: set[Callable] = set()
"""Rules that handle spatial dims wherever they are; the others need them trailing (channels-first)."""
PROPERTY_RULES: dict[str, Callable] = {}
"""Rules for tensor attributes (``x.shape``), by name."""


_ACTIVE = threading.local()


def active_mode() -> "ShardMode | None":
    """The ShardMode this thread runs under, if any (``bigconv.checkpointing`` asks)."""
    stack = getattr(_ACTIVE, "stack", None)
    return stack[-1] if stack else None


class ShardMode(TorchFunctionMode):
    def __init__(self, executor: Executor, path: ModulePath | None = None,
                 known: set[tuple[int, ...]] | None = None) -> None:
        super().__init__()
        self.executor = executor
        self.path = path
        self.known: set[tuple[int, ...]] = set(known or ())
        """Global spatial shapes of the sharded tensors this forward has seen: a factory or an
        upsampling asked for one of them builds a sharded tensor."""

    def __enter__(self):
        if not hasattr(_ACTIVE, "stack"):
            _ACTIVE.stack = []
        _ACTIVE.stack.append(self)
        return super().__enter__()

    def __exit__(self, *exc_info):
        _ACTIVE.stack.pop()
        return super().__exit__(*exc_info)

    @property
    def dims(self) -> int:
        return len(self.executor.grid)

    def where(self) -> str:
        return self.path.current if self.path else "the model's forward"

    def unsupported(self, func: Callable, reason: str, fix: str) -> UnsupportedOperation:
        return UnsupportedOperation(
            f"bigconv cannot decompose {op_name(func)} in {self.where()}: {reason}. {fix}"
        )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = tree_flatten((args, kwargs))[0]
        shapes, replicated = set(), False
        for t in leaves:
            shape = global_shape(t)
            if shape is not None:
                shapes.add(shape)
            elif not replicated and is_replicated(t):
                replicated = True
        if not shapes:
            whole = WHOLE_RULES.get(func)
            if whole is not None:
                return whole(self, func, args, kwargs, replicated)
            out = func(*args, **kwargs)
            return self.after_replicated(out) if replicated else out
        self.known |= shapes
        if replicated:  # a small whole map joins a sharded one of its size: use this shard's part
            args, kwargs = tree_map(lambda t: self.localize(t, shapes), (args, kwargs))
        rule = RULES.get(func)
        if rule is None and getattr(func, "__name__", "") == "__get__":
            prop = PROPERTY_RULES.get(getattr(func.__self__, "__name__", ""))
            return prop(self, func, args, kwargs) if prop else func(*args, **kwargs)
        if rule is None:
            raise self.unsupported(func, "it is not a pointwise, layout, convolution or global-pooling operation on a "
                                   "spatially sharded tensor", SPECIFIC_FIXES.get(getattr(func, "__name__", ""),
                                                                                  FIX_GENERIC))
        if func not in LAYOUT_AWARE:
            self.require_channels_first(func, leaves)
        return rule(self, func, args, kwargs)

    # -- layouts ------------------------------------------------------------------------------------
    def layout(self, t: torch.Tensor) -> tuple[int, ...]:
        return spatial_dims(t, self.dims)

    def one_layout(self, func: Callable, leaves: list) -> tuple[int, ...]:
        layouts = {self.layout(t) for t in leaves if global_shape(t) is not None}
        if len(layouts) != 1:
            raise self.unsupported(func, "its sharded inputs have their spatial dims in different places",
                                   "Permute them to one layout first")
        return layouts.pop()

    def require_channels_first(self, func: Callable, leaves: list) -> None:
        for t in leaves:
            if global_shape(t) is not None and SPATIAL_DIMS_ATTR in t.__dict__:
                raise self.unsupported(
                    func, f"it needs the spatial dims last, but they are at {self.layout(t)} (a permuted, "
                    "channels-last view)", "Permute back to (N, C, *spatial) before this operation, e.g. "
                    "x.permute(0, 3, 1, 2) in 2D")

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
        summed gradient is the single process's.
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

    def tag_outputs(self, out: Any, shape: tuple[int, ...], dims: Sequence[int] | None = None) -> Any:
        """Mark every output tensor whose dims at ``dims`` (default: the trailing ones) are this shard's."""
        dims = tuple(dims) if dims is not None else trailing(self.dims)
        local = self.executor.local_shape(shape)
        reach = -min(dims)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dim() >= reach and all(t.shape[d] == n for d, n in zip(dims, local)):
                mark(t, shape, dims)
        return out


FIX_GENERIC = (
    "Express the model with convolutions, pointwise layers and a global pooling head, or file an issue "
    "naming this operation"
)
FLATTEN_FIX = "Flatten or reshape only after global pooling (e.g. AdaptiveAvgPool2d(1))"
SPECIFIC_FIXES = {
    "linear": "Apply Linear after global pooling (AdaptiveAvgPoolNd(1) + Flatten), or use a 1x1 convolution to mix "
              "channels per position",
    "reshape": FLATTEN_FIX, "view": FLATTEN_FIX, "view_as": FLATTEN_FIX, "reshape_as": FLATTEN_FIX,
}


from . import rules_layout, rules_norm, rules_reduce, rules_window  # noqa: E402,F401  (they fill the tables)
