"""What both front ends check before any remote work: the input, the grid, a dry run, the targets.

A ``Planner`` holds a meta copy of the model (no memory) and, per input shape, dtype and mode, the
``Plan`` its dry run found: the grid and the output's shape. The driver mode and the SPMD mode each
hold one, so bad input raises the same ``ValueError`` in both, before a message is sent.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from . import input_checks, losses, saving
from .data import outputs
from .data.sources import SourceBatch, is_source_batch, target_stand_in
from .engine.dry_run import dry_run, meta_copy
from .engine.plan import Plan
from .geometry.boxes import choose_grid
from .ops.shards import UnsupportedOperation
from .ops.support import conv_dims


class InputRejected(ValueError):
    """The model's own code rejected the input in the dry run (a shape or dtype it does not take), as opposed
    to bigconv refusing an op (``UnsupportedOperation``): the same model may take another size."""


class Planner:
    def __init__(self, model: nn.Module, grid: tuple[int, ...] | None, spatial_workers: int,
                 check_finite: bool) -> None:
        """``grid``: validated already, or None to balance ``spatial_workers`` shards per input shape."""
        input_checks.check_no_backward_hooks(model)
        self.grid = grid
        self.spatial_workers = spatial_workers
        self.spatial_dims = len(grid) if grid else conv_dims(model)
        self.check_finite = check_finite
        self.meta = meta_copy(model)
        self._plans: dict[tuple, Plan] = {}

    def plan(self, x, training: bool) -> Plan:
        """``x``: the batch as a tensor (N, C, *spatial), or as a list of image sources
        (``bigconv.data``), one per item, of which each worker reads only its own box."""
        if is_source_batch(x):
            x = SourceBatch(x)
        else:
            input_checks.check_input(x, self.check_finite)
        key = (tuple(x.shape), x.dtype, training)
        if key not in self._plans:
            self._plans[key] = self._make_plan(x, training)
        return self._plans[key]

    def _make_plan(self, x, training: bool) -> Plan:
        d = self.spatial_dims
        if d is None:
            d = x.dim() - 2
        if x.dim() != d + 2:
            raise ValueError(
                f"input has shape {tuple(x.shape)} but this model expects (N, C, *{d} spatial dims), "
                f"i.e. {d + 2} dims; add a batch dim with x.unsqueeze(0) or check the grid"
            )
        shape = tuple(x.shape[2:])
        grid = self.grid or choose_grid(shape, self.spatial_workers)
        for axis, (n, g) in enumerate(zip(shape, grid)):
            if n < g:
                raise ValueError(
                    f"the image has {n} positions along spatial dim {axis} but the grid {grid} cuts it into {g} "
                    f"shards; use at most {n} shards on that axis"
                )
        try:
            result = dry_run(self.meta, grid, tuple(x.shape), x.dtype, training)
        except UnsupportedOperation:
            raise
        except (RuntimeError, TypeError, IndexError, NotImplementedError) as exc:
            # A model may cast its input itself, so a dtype mismatch is named only once the dry run failed.
            input_checks.check_dtype(x.dtype, input_checks.model_dtype(self.meta), sources=isinstance(x, SourceBatch))
            raise InputRejected(
                f"the model cannot run on an input of shape {tuple(x.shape)} and dtype {x.dtype} "
                f"(found in a dry run, before any remote work) in {getattr(exc, 'bigconv_where', 'its forward')}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        return Plan(grid, shape, result.out_shape, result.out_full_shape, result.outputs, result.spec)

    def per_shard_loss(self, plan: Plan, x, y, loss_fn: Callable) -> bool:
        """Check the targets (before remote work); whether the loss is computed shard by shard."""
        y_sources = is_source_batch(y)
        if self.check_finite and not y_sources:  # target sources: each worker checks its box
            input_checks.check_finite_target(y)
        if plan.several:  # a loss over the structure, on the outputs joined whole (as a non-dense loss is)
            if y_sources:
                raise ValueError("targets given as sources are read shard by shard, which needs one dense output; "
                                 f"this model returns {len(plan.outputs)} outputs: pass y as tensors")
            Planner.check_loss(plan, x, y, loss_fn)
            return False
        y_seen = target_stand_in(y, loss_fn) if y_sources else y  # what the loss will receive
        input_checks.check_target(x, y_seen, loss_fn, plan.out_full_shape)
        dense = plan.out_shape is not None and losses.is_dense(loss_fn, len(plan.grid)) and isinstance(
            y_seen, torch.Tensor) and losses.target_shape_ok(loss_fn, plan.out_full_shape, y_seen)
        if y_sources and not dense:
            raise ValueError(
                "targets given as sources are read shard by shard, which needs a dense output and a loss computed "
                "per shard (MSELoss, L1Loss, BCEWithLogitsLoss, CrossEntropyLoss with mean or sum reduction) and "
                f"targets of the output's shape {plan.out_full_shape}; otherwise pass y as a tensor"
            )
        return dense

    @staticmethod
    def check_loss(plan: Plan, x, y, loss_fn: Callable) -> None:
        """Targets and loss for a loss computed on the whole output (``gradients``), before remote work."""
        if plan.several:
            dtype = x.dtype if isinstance(x, torch.Tensor) and x.dtype.is_floating_point else torch.float32
            outs = plan.rebuild([torch.empty(full, dtype=dtype, device="meta") for _, full in plan.outputs])
            input_checks.check_structured_target(x, y, loss_fn, outs)
        else:
            input_checks.check_target(x, y, loss_fn, plan.out_full_shape)

    @staticmethod
    def prediction(plan: Plan, x, max_chunk: int) -> tuple[tuple[int, ...], str]:
        """The chunks and dtype of ``predict``'s array for ``x`` (chunks never cross shards), or a
        ValueError when this model's output is not one dense map."""
        if plan.several:
            raise ValueError(f"predict writes one dense map, but this model returns {len(plan.outputs)} outputs; "
                             "use net.full(x) for them, or predict with a wrapper returning the one map to write")
        if plan.out_shape is None:
            raise ValueError("predict writes a dense map, but this model's output is one vector per image "
                             "(replicated after pooling); use net.full(x) for it")
        chunks = outputs.aligned_chunks(plan.out_shape, plan.grid, max_chunk)
        return chunks, str(x.dtype if isinstance(x, torch.Tensor) else SourceBatch(x).dtype).replace("torch.", "")

    def check_checkpoint(self, ck: dict, optimizer_class: str | None, path: str,
                         groups: list[int] | None = None) -> None:
        """A checkpoint fits this model and its optimizer (``groups``: its param groups' sizes; None: one group
        of every parameter), before anything changes."""
        saving.check_model_state(ck["model"], self.meta.state_dict(), path)
        saving.check_optimizer_state(ck.get("optimizer"), ck.get("optimizer_class"),
                                     groups or [len(list(self.meta.parameters()))], optimizer_class, path)
