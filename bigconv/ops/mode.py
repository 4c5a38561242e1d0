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
- every other call on a sharded tensor goes to its rule (``layout``, ``reduce``, ``window``,
  ``norm``, merged into one frozen table by ``bigconv.ops.table``), which runs it on the shard and
  exchanges what it needs through an *executor*;
- anything else raises ``UnsupportedOperation`` naming the module, so nothing is silently wrong.

Why the mode answers size queries rather than a tensor subclass carrying the global shape (as
DTensor and ShardTensor do): the mode already sees every call of the forward, so one object holds
the whole contract, every intermediate tensor stays a plain tensor that PyTorch's kernels and
autograd handle at full speed, and the driver's dry run executes the very same rules on meta
tensors (``bigconv.engine.dry_run``).
"""

from __future__ import annotations

import re
import threading
from typing import Any, Callable, Sequence

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from .context import Executor
from .positions import gather_positions
from .positions import refuse as refuse_positions
from .random import DRAWING, ForwardDraws, RandomDraws
from .shards import (
    FIX_GENERIC, GATHER_ATTR, REPLICATED_ATTR, WHOLE_WINDOWS_ATTR, SPATIAL_DIMS_ATTR, SPECIFIC_FIXES, ModulePath, UnsupportedOperation,
    global_shape, is_replicated, mark, op_name, positions, spatial_dims, trailing, tree_flatten,
)
from .table import LAYOUT_AWARE, POSITION_PROPERTY_RULES, POSITION_RULES, PROPERTY_RULES, RULES, WHOLE_RULES
from .windows import on_whole as on_whole_windows

ATTENTION_NAME = re.compile(r"attn|attention|lambda", re.IGNORECASE)
"""Module class names taken as attention modules by ``hold_fix`` (timm's ``Attention``, ``HaloAttn``,
``BottleneckAttn``, ``LambdaLayer``; torchvision's ``ShiftedWindowAttention``; MONAI's ``WindowAttention``)."""


_ACTIVE = threading.local()


def active_mode() -> "ShardMode | None":
    """The ShardMode this thread runs under, if any (``bigconv.engine.checkpointing`` asks)."""
    stack = getattr(_ACTIVE, "stack", None)
    return stack[-1] if stack else None


class ShardMode(TorchFunctionMode):
    def __init__(self, executor: Executor, path: ModulePath | None = None,
                 known: set[tuple[int, ...]] | None = None, random: ForwardDraws | None = None) -> None:
        super().__init__()
        self.executor = executor
        self.path = path
        self.random = random or RandomDraws(0).next_forward()
        """This forward's random draws, the same on every shard (``bigconv.ops.random``)."""
        self.held: list = []
        """Calls of modules held whole (``bigconv.ops.whole``) under way: while one is, every torch call
        runs as it is, on whole tensors."""
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

    def note_attention(self, note) -> None:
        """Record what an attention rule did, under the running modules (``ModulePath.note``)."""
        if self.path is not None:
            self.path.note(note)

    def attention_setting(self):
        """How global attention runs here: the innermost running module's ``(strategy, memory)``
        (``bigconv.ops.global_attention.use``), or None (ring passes)."""
        return self.path.attention if self.path else None

    def unsupported(self, func: Callable, reason: str, fix: str) -> UnsupportedOperation:
        return UnsupportedOperation(
            f"bigconv cannot decompose {op_name(func)} in {self.where()}: {reason}. {fix.rstrip('.')}{self.hold_fix()}"
        )

    def hold_fix(self) -> str:
        """The way out that needs no change to the model: hold the refusing module whole (``ops.whole``)."""
        stack = self.path.stack if self.path else []
        if len(stack) < 2:  # the root module: holding it whole would be one process's run on every worker
            return ""
        kinds = [entry.rsplit("(", 1)[-1].rstrip(")") for entry in stack[1:]]
        flat = list(getattr(self.path, "flat", [False] * len(stack)))[1:]
        # Inside an attention module, the leaf that refuses (a Conv3d over a reshaped map in timm's lambda
        # layer) is not the module to hold: holding it alone gathers its input and the next op of the
        # attention refuses again. The innermost attention module around it is.
        attention = [i for i, k in enumerate(kinds[:-1]) if ATTENTION_NAME.search(k)]
        at = attention[-1] if attention else len(kinds) - 1
        # A module given flattened positions cannot be held (bigconv.ops.whole refuses it, "one level up"): the
        # innermost module around it that is given maps can (SAM's Block around its Attention).
        while at >= 0 and flat[at]:
            at -= 1
        if at < 0:
            return ""
        kind = kinds[at]
        return (f". Or compute this module whole on every worker (exact; the whole map's memory and compute there, "
                f"fine for small deep maps): bigconv.hold_whole(model, {kind}) before parallelize")

    # Under torch.compile the rules run eagerly: they exchange halos and tag tensors with Python
    # attributes, which dynamo cannot trace (it fails inside them rather than breaking the graph).
    @torch.compiler.disable
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.held:  # inside a module held whole: its tensors are whole, not shards
            return func(*args, **kwargs)
        leaves = tree_flatten((args, kwargs))[0]
        shapes, replicated, flat, windows = set(), False, False, None
        for t in leaves:
            shape = global_shape(t)
            if shape is not None:
                shapes.add(shape)
            elif not replicated and is_replicated(t):
                replicated = True
            elif not flat and positions(t) is not None:
                flat = True
            elif windows is None and isinstance(t, torch.Tensor) and WHOLE_WINDOWS_ATTR in t.__dict__:
                windows = t.__dict__[WHOLE_WINDOWS_ATTR]
        if flat:
            return self.on_positions(func, args, kwargs, bool(shapes))
        if windows is not None and not shapes:  # window attention on a map held whole (bigconv.ops.windows)
            draws = WHOLE_RULES[func] if func in DRAWING else None  # drop path: bigconv's draws, as elsewhere
            return on_whole_windows(self, func, args, kwargs, windows, draws)
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

    def on_positions(self, func, args, kwargs, with_map: bool):
        """A call given an image's positions flattened into one dim: only their rules apply."""
        rule = POSITION_RULES.get(func)
        if rule is None and getattr(func, "__name__", "") == "__get__" and not with_map:
            prop = POSITION_PROPERTY_RULES.get(getattr(func.__self__, "__name__", ""))
            return prop(self, func, args, kwargs) if prop else func(*args, **kwargs)
        gather = any(GATHER_ATTR in t.__dict__ for t in tree_flatten((args, kwargs))[0] if positions(t) is not None)
        try:
            if with_map:
                raise refuse_positions(self, func, "it mixes them with a sharded map")
            if rule is None:
                raise refuse_positions(self, func)
            out = rule(self, func, args, kwargs)
        except UnsupportedOperation:
            if not gather:
                raise
            # Made by flatten: gathered whole, as flatten into a dense head always was (smp's MAnet
            # attention between positions, Segformer's MLP over them); the call then goes through
            # the mode again, for its other arguments
            args, kwargs = tree_map(lambda t: gather_positions(self, t), (args, kwargs))
            return self.__torch_function__(func, (), args, kwargs)
        if gather:
            for t in tree_flatten(out)[0]:
                if positions(t) is not None:
                    setattr(t, GATHER_ATTR, True)
        return out

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
        if shape not in shapes and any(all(s in (1, g) for s, g in zip(shape, full)) for full in shapes):
            return t.view_as(t)  # size 1 along some spatial dims (a map's last row): the pointwise rule cuts it
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
