"""Which tensors are sharded: the marks a shard's tensors carry, and the helpers every op rule uses.

A sharded tensor is an ordinary local tensor carrying its *global* spatial shape as an attribute,
and, when a layout op moved them (``permute`` to channels-last), the positions of its spatial dims
counted from the end. Its extent is the balanced share of that shape at this worker's grid
coordinate. ``bigconv.ops.mode`` (the ``ShardMode``) dispatches calls on such tensors to the rules.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import torch

GLOBAL_SHAPE_ATTR = "_bigconv_global_shape"
SPATIAL_DIMS_ATTR = "_bigconv_spatial_dims"
"""Negative positions of the spatial dims, in grid-axis order, when they are not the trailing ones."""
REPLICATED_ATTR = "_bigconv_replicated"
WHOLE_WINDOWS_ATTR = "_bigconv_whole_windows"
"""Marks windows of a map with fewer windows than shards, gathered whole on every shard
(``bigconv.ops.windows``): ``(the map's global spatial shape, its layout, its rank)``."""
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


ATTENTION_ATTR = "_bigconv_attention"
"""Set on a module (``bigconv.ops.global_attention.use``): how the global attention inside it runs, a pair
``(strategy, memory)``; the innermost module that has it decides."""


class AttentionNote(NamedTuple):
    """What an attention rule did for one call (``ModulePath.note``)."""

    kind: str
    """``ring`` or ``gathered`` (keys and values of every position), ``local`` (each worker's queries over whole
    keys and values), ``windows`` (each worker its own windows)."""
    positions: int = 0
    """How many keys' positions the image has (whole items beside them counted)."""
    whole: int = 0
    """Whole tokens in front (class and register tokens)."""
    whole_queries: bool = False
    """Every query whole on every worker (a latent array, a pooling head's)."""


class ModulePath:
    """Tracks which module is running, so errors can name it, and the attention setting around it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.stack: list[str] = []
        self.settings: list = []
        self.flat: list[bool] = []
        """Per running module: whether it was given an image's flattened positions (``hold_whole`` refuses
        to hold such a module: the module that flattened them is the one to hold)."""
        self.notes: list[tuple[tuple[str, ...], AttentionNote]] = []
        """What the attention rules did in this forward, with the modules running then (``bigconv.check``
        names each attention module's strategy from them); cleared when the outermost module returns."""
        for name, module in model.named_modules():
            label = f"'{name or '<root>'}' ({type(module).__name__})"
            module.register_forward_pre_hook(lambda m, args, label=label: self._enter(label, m, args))
            module.register_forward_hook(lambda *_: self._leave())
        model.register_forward_hook(self._check_output)

    @staticmethod
    @torch.compiler.disable  # reads tensors' __dict__, which dynamo cannot trace (as ShardMode's handler)
    def _check_output(module, inputs, out) -> None:
        found = [where for where, t in _leaves(out, "out") if positions(t) is not None]
        if found:
            raise UnsupportedOperation(
                f"bigconv cannot return, from the model's forward, positions flattened from a sharded image "
                f"({', '.join(found[:4])}{', ...' if len(found) > 4 else ''}: each shard holds its own, in its own "
                "order). Reduce over them (softmax, sum, mean, amax, matmul/einsum contracting them) inside forward, "
                "or return the unflattened map (tokens.transpose(1, 2).reshape(N, C, *grid)); to drop outputs "
                "you do not train on (MONAI ViTAutoEnc's hidden states), wrap the model in a module whose forward "
                "returns the others (model(x)[0])")

    # Hooks must return None: a forward hook's return value replaces the module's output.
    @torch.compiler.disable  # reads tensors' __dict__
    def _enter(self, label: str, module: torch.nn.Module, args=()) -> None:
        self.stack.append(label)
        self.settings.append(getattr(module, ATTENTION_ATTR, None))
        self.flat.append(any(positions(t) is not None for t in tree_flatten(args)[0]))

    def _leave(self) -> None:
        if self.stack:
            self.stack.pop()
            self.settings.pop()
            self.flat.pop()
        if not self.stack:
            self.notes.clear()

    def note(self, item: "AttentionNote") -> None:
        """Record what an attention rule did, under the modules running now."""
        self.notes.append((tuple(self.stack), item))

    def clear(self) -> None:
        """Forget a forward that raised (its modules never left)."""
        self.stack.clear()
        self.settings.clear()
        self.flat.clear()
        self.notes.clear()

    @property
    def attention(self):
        """The innermost running module's attention setting ``(strategy, memory)``, or None."""
        return next((s for s in reversed(self.settings) if s is not None), None)

    @property
    def current(self) -> str:
        return f"module {self.stack[-1]}" if self.stack else "the model's forward"


def _leaves(tree: Any, path: str) -> list[tuple[str, Any]]:
    """The leaves of a model's output with their places in it (``out[1][0]``, ``out['aux']``)."""
    if isinstance(tree, (list, tuple)):
        return [leaf for i, v in enumerate(tree) for leaf in _leaves(v, f"{path}[{i}]")]
    if isinstance(tree, dict):
        return [leaf for k, v in tree.items() for leaf in _leaves(v, f"{path}[{k!r}]")]
    return [(path, tree)]


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


POSITIONS_ATTR = "_bigconv_positions"
"""Marks a tensor whose one dim holds this shard's positions of an image, flattened (``x.flatten(2)``,
``x.reshape(N, C, -1)``): ``(global spatial shape, negative position of that dim)``. Its order is
this shard's own, so only reductions over it (and per-position math) are exact: ``bigconv.ops.positions``."""


def positions(t: object) -> tuple[tuple[int, ...], int] | None:
    """``(global spatial shape, negative dim)`` of a tensor of flattened positions, else None."""
    return t.__dict__.get(POSITIONS_ATTR) if isinstance(t, torch.Tensor) else None


GATHER_ATTR = "_bigconv_positions_gather"
"""Marks flattened positions made by ``flatten`` (and what follows from them): an op other than a
reduction over them gathers them whole, as ``flatten`` into a dense head always did; positions
made by ``reshape``/``view`` are refused instead."""


def mark_positions(t: torch.Tensor, shape: Sequence[int], dim: int, gather: bool = False) -> torch.Tensor:
    setattr(t, POSITIONS_ATTR, (shape if isinstance(shape, (WindowGrid, Prefixed)) else tuple(shape), dim))
    if gather:
        setattr(t, GATHER_ATTR, True)
    return t


class WindowGrid(tuple):
    """The global shape of a window grid whose positions are flattened into one dim together with ``lead``
    whole items in front (Swin's ``reshape(B * nW, w * w, C)``: the batch before the windows) and ``trail``
    whole items behind (timm ``HaloAttn``'s relative logits, ``reshape(B * nW * w, w, ...)``: a block's rows
    after the windows); as the shape of flattened positions (``positions(t)[0]``), it makes that dim
    ``lead * prod(grid) * trail`` long, in that order (row-major)."""

    lead: int
    trail: int

    def __new__(cls, shape, lead: int = 1, trail: int = 1):
        grid = super().__new__(cls, tuple(shape))
        grid.lead = int(lead)
        grid.trail = int(trail)
        return grid

    def __eq__(self, other):
        return (tuple.__eq__(self, other) and getattr(other, "lead", 1) == self.lead
                and getattr(other, "trail", 1) == self.trail)

    def __ne__(self, other):
        return not self == other

    def __hash__(self):  # equal to its plain shape's without whole items (an image's positions), as == says
        return tuple.__hash__(self) if self.lead == self.trail == 1 else hash((tuple(self), self.lead, self.trail))

    def __repr__(self):
        return f"{tuple(self)} windows x {self.lead}" + (f", x {self.trail} after" if self.trail != 1 else "")

    def __reduce__(self):
        return (WindowGrid, (tuple(self), self.lead, self.trail))


class Prefixed(tuple):
    """The global shape of an image's flattened positions behind ``prefix`` tokens that every shard holds
    whole, in the same dim (a ViT's class and register tokens joined by ``torch.cat`` before its patch
    tokens: ``bigconv.ops.prefix``): that dim holds the ``prefix`` tokens, then this shard's positions;
    its global length is ``prefix + prod(shape)``."""

    prefix: int

    def __new__(cls, shape, prefix: int):
        grid = super().__new__(cls, tuple(shape))
        grid.prefix = int(prefix)
        return grid

    def __eq__(self, other):
        return tuple.__eq__(self, other) and getattr(other, "prefix", 0) == self.prefix

    def __ne__(self, other):
        return not self == other

    def __hash__(self):
        return hash((tuple(self), "prefix", self.prefix))

    def __repr__(self):
        return f"{tuple(self)} behind {self.prefix} whole token(s)"

    def __reduce__(self):
        return (Prefixed, (tuple(self), self.prefix))


def prefix(shape) -> int:
    """How many whole tokens lead flattened positions' dim (0 but for a ``Prefixed`` shape)."""
    return getattr(shape, "prefix", 0)


def lead(shape) -> int:
    """The whole leading count of flattened positions' shape (1 for an image's positions)."""
    return getattr(shape, "lead", 1)


def trail(shape) -> int:
    """The whole trailing count of flattened positions' shape (1 for an image's positions)."""
    return getattr(shape, "trail", 1)
