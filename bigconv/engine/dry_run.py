"""The driver's dry run: every shard's forward, on meta tensors, before any remote work.

Each shard runs in its own thread with the workers' own code (``ShardMode``, the rules, the
``ShardExecutor``) on a meta copy of the model; messages go from thread to thread instead of over
RPC. So the dry run is not a second set of checks that could drift from what workers do: an
operation that would fail on a worker fails here first, with the same message, and costs no
memory (meta tensors have shapes but no data).
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass

import torch
import torch.nn as nn

from .executor import ShardExecutor
from ..geometry.boxes import all_coords, shard_box
from ..ops.shards import ModulePath, global_shape, global_size, mark
from ..ops.mode import ShardMode
from ..transport import Mailbox, WorkerFailure, WorkerRuntime
from ..transport.rpc import RpcLink

DRY_RUN_TIMEOUT_S = 60.0
"""A shard of the dry run waiting this long on another is a bug in bigconv, not the user's model."""


@dataclass(frozen=True)
class DryRunResult:
    out_shape: tuple[int, ...] | None
    """Global spatial shape of a sharded output; None when the output is replicated (a head)."""
    out_full_shape: tuple[int, ...]


def copy_model(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model)``, also for a model holding computed tensors as attributes: the old
    ``torch.nn.utils.weight_norm`` keeps ``weight`` as a non-leaf (recomputed before every forward),
    which ``deepcopy`` refuses; the copy gets it detached."""
    memo: dict = {}
    for module in model.modules():
        for value in module.__dict__.values():
            if isinstance(value, torch.Tensor) and not value.is_leaf:
                memo[id(value)] = value.detach().clone()
    return copy.deepcopy(model, memo)


def meta_copy(model: nn.Module) -> nn.Module:
    """The model on meta tensors; scalar buffers stay real, because forward code may read them
    (BatchNorm with momentum=None divides by ``num_batches_tracked``)."""
    meta = copy_model(model)
    scalars = {name: buf for name, buf in meta.named_buffers() if buf.dim() == 0}
    meta.to("meta")
    for name, buf in scalars.items():
        owner, _, attr = name.rpartition(".")
        setattr(meta.get_submodule(owner) if owner else meta, attr, buf)
    return meta


def dry_run(meta: nn.Module, grid: tuple[int, ...], x_shape: tuple[int, ...], dtype: torch.dtype,
            training: bool) -> DryRunResult:
    """Run every shard of ``meta`` (a ``meta_copy``) on an input of ``x_shape``; raise what a worker would."""
    coords = list(all_coords(grid))
    mailboxes = [Mailbox() for _ in coords]
    spatial = tuple(x_shape[2:])
    outs: list = [None] * len(coords)
    errors: list = [None] * len(coords)

    def deliver(dst: int, key, tensor: torch.Tensor) -> None:
        mailboxes[dst].put(key, tensor)

    def shard(index: int) -> None:
        rt = WorkerRuntime(index=index, workers=len(coords), device=torch.device("meta"), timeout=DRY_RUN_TIMEOUT_S,
                           mailbox=mailboxes[index], send=deliver)
        rt.link = RpcLink(rt)  # delivers into the other shards' mailboxes, in this process
        model = copy.deepcopy(meta).train(training)
        path = ModulePath(model)
        box = shard_box(spatial, grid, coords[index])
        x = mark(torch.empty((*x_shape[:2], *(b - a for a, b in box)), dtype=dtype, device="meta"), spatial)
        try:
            # Tensors the forward builds without a device land on meta too, next to the model's.
            with torch.enable_grad(), torch.device("meta"), ShardMode(ShardExecutor(grid, 0, rt), path):
                out = model(x)
            outs[index] = out
        except BaseException as exc:  # reported by the driver's thread, naming the module
            exc.bigconv_where = path.current
            errors[index] = exc
            for box_ in mailboxes:
                box_.abort(f"shard {index} of the dry run failed")

    threads = [threading.Thread(target=shard, args=(i,), name=f"bigconv-dry-run-{i}", daemon=True)
               for i in range(len(coords))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors if e is not None and not isinstance(e, WorkerFailure)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    out = outs[0]
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"the model returns {type(out).__name__}; bigconv supports one output tensor "
                         "(wrap the model to return the tensor, e.g. model(x)['out'])")
    shape = global_shape(out)
    if shape is None:
        return DryRunResult(None, tuple(out.shape))
    return DryRunResult(shape, tuple(global_size(out, len(grid))))
