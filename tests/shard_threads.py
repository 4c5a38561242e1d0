"""A sharded forward in this process: each shard a thread running the workers' own code on real tensors.

The shards exchange through the dry run's in-process link (``LocalLink``), as ``bigconv.engine.dry_run``
does on meta tensors; here the tensors hold data, so the stitched output can be compared with one
process. It runs forward only (the driver and SPMD modes judge training through the verdict); its use is
the planted-error tests: a rule's helper patched in this process (``monkeypatch``) is what every shard
runs, so a test can show that a wrong rule makes the output wrong, which a worker process would not see.
"""

from __future__ import annotations

import copy
import threading

import torch
import torch.nn as nn

from bigconv.engine.executor import ShardExecutor, join_shards
from bigconv.geometry.boxes import all_coords, shard_box
from bigconv.ops import global_attention, whole
from bigconv.ops.mode import ShardMode
from bigconv.ops.shards import ModulePath, global_shape, mark, spatial_dims
from bigconv.transport import Mailbox, WorkerRuntime
from bigconv.transport.rpc import LocalLink


def on_threads(grid: tuple[int, ...], fn):
    """``fn(executor, index)`` on every shard of ``grid``, each a thread with the in-process link; the results
    in worker order."""
    coords = list(all_coords(grid))
    boxes = [Mailbox() for _ in coords]
    out, errors = [None] * len(coords), []

    def shard(i: int) -> None:
        rt = WorkerRuntime(index=i, workers=len(coords), device=torch.device("cpu"), timeout=60.0, mailbox=boxes[i])
        rt.link = LocalLink(rt, boxes)
        try:
            out[i] = fn(ShardExecutor(tuple(grid), 1, rt), i)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            for b in boxes:
                b.abort(f"shard {i} failed")

    threads = [threading.Thread(target=shard, args=(i,)) for i in range(len(coords))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def forward_on_threads(model: nn.Module, x: torch.Tensor, grid: tuple[int, ...]) -> torch.Tensor:
    """``model(x)`` with ``x``'s spatial dims split over ``grid``, every shard a thread; a sharded output
    stitched whole (its spatial dims moved last), a whole one as shard 0 has it."""
    coords = list(all_coords(grid))
    boxes = [Mailbox() for _ in coords]
    spatial = tuple(x.shape[2:])
    outs, errors = [None] * len(coords), []

    def shard(i: int) -> None:
        rt = WorkerRuntime(index=i, workers=len(coords), device=torch.device("cpu"), timeout=60.0, mailbox=boxes[i])
        rt.link = LocalLink(rt, boxes)
        net = copy.deepcopy(model)
        path = ModulePath(net)
        whole.install(net)
        global_attention.install(net)
        box = shard_box(spatial, grid, coords[i])
        part = mark(x[(slice(None), slice(None), *(slice(a, b) for a, b in box))].clone(), spatial)
        try:
            with torch.no_grad(), ShardMode(ShardExecutor(tuple(grid), 0, rt), path):
                out = net(part)
            shape = global_shape(out)
            if shape is not None:  # the spatial dims last, plain tensors for the join
                dims = [d % out.dim() for d in spatial_dims(out, len(grid))]
                out = out.permute([d for d in range(out.dim()) if d not in dims] + dims)
            outs[i] = (shape, torch.Tensor(out))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            for b in boxes:
                b.abort(f"shard {i} failed")

    threads = [threading.Thread(target=shard, args=(i,)) for i in range(len(coords))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    if outs[0][0] is None:
        return outs[0][1]
    return join_shards([o for _, o in outs], grid)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max-norm error over the max-norm size (the verdict's measure for one tensor)."""
    got, want = got.detach(), want.detach()
    return float((got - want).abs().max() / want.abs().max())
