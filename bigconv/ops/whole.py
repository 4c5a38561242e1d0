"""Modules held whole: computed on the whole map on every shard, exactly, where no rule splits them yet.

Window attention (torchvision's ``ShiftedWindowAttention``, MONAI's ``WindowAttention``), halo
attention (timm's ``HaloAttn``) and global attention over positions (timm's bottleneck ``SelfAttn``)
reshape a map's positions into windows or tokens merged with the batch, which the op rules do not
split over shards (a refusal in the dry run names the module and this fix). ``hold_whole(model,
SomeAttention)`` marks such modules; then, inside a sharded forward, each call of one:

- gathers its sharded inputs whole on every shard (``executor.gather_all``, differentiable: in
  backward each shard's gradient of the whole copy returns to the owners and is summed there);
- runs the module's unchanged ``forward`` on them with the op rules switched off (every tensor in
  it is an ordinary whole tensor; ``ShardMode.held``);
- keeps, of each output of the input's rank, this shard's part (its spatial dims where the input's
  were, of the output's own sizes), so what follows is sharded again.

Exact: every output position is computed from the whole input by the single process's code, and
each shard backpropagates only its own part, so summed parameter gradients are the single
process's. The cost is the whole map's memory and compute on every shard at that module: fine for
the small deep maps where attention usually sits, a limit for large ones (a rule that splits the
module is the way out there). Random draws inside a held module (attention dropout, drop path) come
from each worker's own generator, not bigconv's position-keyed draws: set them to 0 in held
modules, or they differ from one process.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from .mode import ShardMode, active_mode
from .shards import REPLICATED_ATTR, UnsupportedOperation, global_shape, mark, positions, trailing, tree_flatten

HOLD_ATTR = "_bigconv_hold_whole"
"""Set on a module ``hold_whole`` marked (travels with the model to the workers)."""


def hold_whole(model: nn.Module, *types: type) -> nn.Module:
    """Mark ``model`` itself, or with ``types`` every submodule of those types, to be computed whole on
    every shard (see the module doc); returns ``model``. Example: ``hold_whole(swin, ShiftedWindowAttention)``."""
    marked = [m for m in model.modules() if isinstance(m, types)] if types else [model]
    if types and not marked:
        raise ValueError(f"the model holds no module of type {', '.join(t.__name__ for t in types)}")
    for module in marked:
        setattr(module, HOLD_ATTR, True)
    return model


def install(model: nn.Module) -> None:
    """Hooks on every marked module of ``model`` (after ``ModulePath``'s, so errors name the module)."""
    for module in model.modules():
        if getattr(module, HOLD_ATTR, False):
            module.register_forward_pre_hook(_enter, with_kwargs=True)
            module.register_forward_hook(_leave)


def _whole(mode: ShardMode, t: torch.Tensor, layout: tuple) -> torch.Tensor:
    """The whole of sharded ``t`` on every shard, its spatial dims where they were."""
    spatial = [d % t.dim() for d in layout]
    order = [d for d in range(t.dim()) if d not in spatial] + spatial
    whole = mode.executor.gather_all(t.permute(order), global_shape(t))
    return whole.permute([order.index(d) for d in range(t.dim())])


def _enter(module: nn.Module, args, kwargs):
    mode = active_mode()
    if mode is None:
        return None
    if mode.held:  # inside a held module already: its inputs are whole
        mode.held.append(None)
        return None
    leaves = tree_flatten((args, kwargs))[0]
    if any(positions(t) is not None for t in leaves):
        raise UnsupportedOperation(
            f"bigconv cannot hold {mode.where()} whole: it is given an image's positions flattened into one dim, "
            "which each shard holds in its own order. Hold the module that flattens them instead (one level up)")
    sharded = [t for t in leaves if global_shape(t) is not None]
    if not sharded:
        mode.held.append(None)
        return None
    first = sharded[0]
    layouts = {t: tuple(mode.layout(t)) for t in sharded}
    # Pushed first: from here on the mode runs every call as it is, the gathers' own included.
    mode.held.append((first.dim(), layouts[first]))
    return tree_map(lambda t: _whole(mode, t, layouts[t]) if global_shape(t) is not None else t, (args, kwargs))


def _leave(module: nn.Module, args, out):
    mode = active_mode()
    if mode is None or not mode.held:
        return None
    held = mode.held[-1]
    if held is None or len(mode.held) > 1:
        mode.held.pop()
        return None
    rank, layout = held

    def local(t):
        # Anything else (a pooled vector) stays the same whole copy on every shard, each copy reaching
        # the loss only through this shard's use of it, as a replicated head's does.
        if not isinstance(t, torch.Tensor) or t.dim() != rank:
            return t
        shape = tuple(t.shape[d] for d in layout)
        if not mode.executor.fits(shape):  # fewer positions than shards: held whole, as small maps are
            if layout == trailing(len(layout)):
                setattr(t, REPLICATED_ATTR, True)
            return t
        return mark(mode.executor.local_part(t, shape, layout), shape, layout)

    try:  # still held: the mode runs these calls as they are
        return tree_map(local, out)
    finally:
        mode.held.pop()
