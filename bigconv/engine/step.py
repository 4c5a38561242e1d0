"""The shard-step: one typed command in, forward, loss part, backward, gradient sum and optimizer step out.

Both front ends feed it. A driver's worker gets its command in one message from the driver (the
driver mode's ``p2p`` transport is SPMD ranks fed by commands); an SPMD rank builds its own. What
differs between them is only where the loss is taken, and that is part of the command:

- ``PerShardLoss``: a loss computed shard by shard (``bigconv.losses``), ``sum(num) / sum(den)`` over
  every rank;
- ``WholeOutputLoss``: any other loss, on the whole batch's output gathered on every rank with only
  this rank's part carrying gradient (SPMD); every rank backpropagates the same loss, so the sum over
  ranks is the one-process gradient;
- ``OutputGradients``: the driver took the loss on the whole output and sends this shard the gradient
  of its part (the output kept from the command's forward).

``run`` is the one failure bracket: gradients cleared and buckets armed before, the buckets reset if
anything raises, the sums waited for and the optimizer stepped after.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree

from ..data.sources import ShardRead, SourceBatch, class_index_targets, is_source_batch
from ..geometry.boxes import Interval, all_coords, box_index, shard_box
from .executor import join_shards
from .plan import Plan, output_leaves
from .shard import ShardEngine


@dataclass(frozen=True)
class ShardCall:
    """What one shard runs on in one call: its part of the batch (a compact tensor, or the read of its
    box of image sources) and of the targets, with the call's number and the global layout."""

    call: int
    grid: tuple[int, ...]
    in_shape: tuple[int, ...]
    x: Any
    target: Any = None
    check_finite: bool = False
    """``parallelize(check_finite=True)``: a step refuses a NaN or infinite summed gradient before the
    optimizer steps (``ShardEngine.end``)."""


def shard_calls(call: int, plan: Plan, x, y=None, loss_fn=None, *, coords: Sequence[tuple[int, ...]] | None = None,
                items: Interval | None = None, check_finite: bool = False) -> list[ShardCall]:
    """The ``ShardCall`` of each shard at ``coords`` (default: every shard, in worker order) for the images
    ``items`` of the batch (default: all). Tensors are cut into compact copies (a view would carry, and
    pickle, its whole storage); sources become ``ShardRead``s of the shard's box, read where it runs.
    ``y`` is cut along the output's grid (a dense target), or left out when None."""
    coords = list(all_coords(plan.grid)) if coords is None else list(coords)
    calls = []
    for coord in coords:
        box = shard_box(plan.in_shape, plan.grid, coord)
        if is_source_batch(x):
            sources = tuple(x)[slice(*items) if items else slice(None)]
            xi: Any = ShardRead(sources, box, check_finite=check_finite)
        else:
            xi = x.detach()[box_index(box, x.dim(), items)].clone(memory_format=torch.contiguous_format)
        yi = None
        if y is not None:
            out_box = shard_box(plan.out_shape, plan.grid, coord)
            if is_source_batch(y):
                squeeze = class_index_targets(SourceBatch(y), loss_fn)
                yi = ShardRead(tuple(y)[slice(*items) if items else slice(None)], out_box, squeeze, check_finite)
            else:
                yi = y[box_index(out_box, y.dim(), items)].clone()
        calls.append(ShardCall(call, plan.grid, plan.in_shape, xi, yi, check_finite))
    return calls


# -- where the loss is taken ----------------------------------------------------------------------
@dataclass(frozen=True)
class PerShardLoss:
    """A loss computed per shard (``bigconv.losses``): this shard's part, summed over every rank."""

    loss_fn: nn.Module


@dataclass(frozen=True)
class OutputGradients:
    """The gradient of the loss with respect to this shard's output (one per output tensor; None: zeros,
    for a copy of a replicated head that does not count)."""

    grads: Any


@dataclass(frozen=True)
class WholeOutputLoss:
    """Any loss, on the whole batch's output, gathered on every rank of an SPMD mesh."""

    loss_fn: Any
    target: Any
    plan: Plan


@dataclass(frozen=True)
class StepCommand:
    """One step of one shard: its ``ShardCall``, where the loss is taken, and what to do after backward."""

    shard: ShardCall
    loss: PerShardLoss | OutputGradients | WholeOutputLoss
    grad: bool | str = True
    """``"input"``: keep the input shard as a leaf, to return its gradient."""
    optimizer_step: bool = True
    gradients: bool = False
    """Return this shard's input gradient and the summed parameter gradients (no step)."""
    group: Any = field(default=None, compare=False)
    """The ranks a per-shard loss is summed over (None: every rank of the default group)."""
    accumulate: bool = False
    """Keep this call's gradients, unsummed, for a later summing call (``train_step(..., step=False)``)."""


@dataclass
class StepResult:
    loss: torch.Tensor | None
    input_grad: torch.Tensor | None = None
    param_grads: dict | None = None


def forward(engine: ShardEngine, shard: ShardCall, grad) -> Any:
    """The model on this shard's input (read here from its sources when it is a ``ShardRead``)."""
    return engine.forward(shard.grid, shard.in_shape, engine.read_agreed(shard.x), grad, shard.call)


def run(engine: ShardEngine, cmd: StepCommand, kept: Any = None) -> StepResult:
    """Forward (or ``kept``: the output of this command's forward, run earlier), the loss part, backward
    with the gradient sum in buckets, and the optimizer step; on any error the buckets are reset."""
    accumulate = cmd.accumulate and not cmd.gradients
    if cmd.gradients:
        engine.accumulating = False  # the gradients of this call alone
    engine.begin(accumulate)
    try:
        out = kept if kept is not None else forward(engine, cmd.shard, cmd.grad)
        loss = _backward(engine, cmd, out)
    except BaseException:
        engine.abort()
        raise
    engine.end(cmd.optimizer_step and not cmd.gradients, accumulate, check_finite=cmd.shard.check_finite,
               call=cmd.shard.call)
    if cmd.gradients:
        return StepResult(loss, engine.input_grad(), engine.param_grads())
    return StepResult(loss)


def _backward(engine: ShardEngine, cmd: StepCommand, out) -> torch.Tensor | None:
    part = cmd.loss
    if isinstance(part, PerShardLoss):
        target = engine.read_agreed(cmd.shard.target)
        if isinstance(cmd.shard.target, ShardRead):  # labels read here: checked with every rank
            engine.check_labels(part.loss_fn, out, target, cmd.group)
        local, loss = engine.dense_loss(part.loss_fn, out, target, cmd.group)
        local.backward()
        return loss
    if isinstance(part, OutputGradients):
        outs = output_leaves(out)
        grads = part.grads if isinstance(part.grads, list) else [part.grads]
        pairs = [(o, g.to(o.device) if g is not None else torch.zeros_like(o))
                 for o, g in zip(outs, grads) if o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return None
    return _whole_output_backward(engine, part, out)


# -- a loss on the whole output, SPMD: every rank holds the whole batch's output ---------------------------
def _whole_output_backward(engine: ShardEngine, part: WholeOutputLoss, out) -> torch.Tensor:
    """Each output joined as one process would hold it (a dense map gathered with this rank's part live;
    a replicated one live on its replica's shard 0 only: the other shards' copies pass a zero gradient,
    so their halo exchanges still run), the loss over the structure, one backward."""
    mesh, plan = engine.rt.mesh, part.plan
    outs = output_leaves(out)
    joined, idle = [], []
    for t, (shape, _) in zip(outs, plan.leaf_shapes()):
        if shape is not None:
            joined.append(gather_dense(engine, plan.grid, t, live=True))
        elif mesh.shard == 0 or not t.requires_grad:
            joined.append(gather_heads(engine, t))
        else:
            joined.append(gather_heads(engine, t.detach()))
            idle.append(t)
    loss = part.loss_fn(plan.rebuild(joined), pytree.tree_map(lambda t: t.to(outs[0].device), part.target))
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
        raise ValueError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
    roots = ([loss] if loss.requires_grad else []) + idle
    if roots:
        torch.autograd.backward(roots, [None] * (len(roots) - len(idle)) + [torch.zeros_like(t) for t in idle])
    return loss.detach()


def gather_dense(engine: ShardEngine, grid: tuple[int, ...], local: torch.Tensor, live: bool = False) -> torch.Tensor:
    """Every rank's shard joined into the whole batch, on every rank (on the CPU); with ``live``, on
    ``local``'s device with this rank's own part ``local`` itself, so it carries gradient."""
    mesh = engine.rt.mesh
    size = mesh.replicas * mesh.spatial
    parts: list = [None] * size
    dist.all_gather_object(parts, local.detach().cpu())
    if live:
        parts = [p.to(local.device) for p in parts]
        parts[mesh.replica * mesh.spatial + mesh.shard] = local
    s = mesh.spatial
    return torch.cat([join_shards(parts[r * s:(r + 1) * s], grid) for r in range(mesh.replicas)])


def gather_heads(engine: ShardEngine, out: torch.Tensor) -> torch.Tensor:
    """The replicated outputs of every replica, joined in batch order; only this replica's part keeps
    its gradient."""
    mesh = engine.rt.mesh
    if mesh.replicas == 1:
        return out
    parts: list = [None] * mesh.replicas
    dist.all_gather_object(parts, out.detach().cpu(), group=mesh.replica_group)
    return torch.cat([out if i == mesh.replica else p.to(out.device) for i, p in enumerate(parts)])
