"""``nn.SyncBatchNorm`` on shards: the whole batch's and the whole image's statistics, on any device.

A DDP user's habit, ``nn.SyncBatchNorm.convert_sync_batchnorm(model)``, asks for BatchNorm
statistics over every process's images. On a shard that is what bigconv's BatchNorm rule already
computes (``bigconv.ops.norm``: over the grid's shards, then over the data-parallel replicas, in
one order on every rank). But ``SyncBatchNorm.forward`` never reaches that rule where it matters:
once a process group exists (every worker and SPMD rank has one) it refuses CPU tensors ("expected
input tensor to be on GPU"), and on a GPU it all-gathers the shards' statistics itself, over the
whole world, bypassing the rule and the replica layout. The driver's dry run has no process group,
so it used to pass and the workers then failed.

``adopt`` gives each ``SyncBatchNorm`` of a model bigconv runs the class below: a subclass (so
``isinstance`` checks, ``state_dict`` keys and the ``process_group`` attribute are unchanged) whose
forward, inside a sharded forward, is ``BatchNorm``'s, i.e. ``F.batch_norm``, which the mode sends
to the whole-image rule. Outside one (the user's own model in the SPMD mode, used later under DDP)
it is ``SyncBatchNorm``'s own forward again.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

from .mode import active_mode


class ShardedSyncBatchNorm(nn.SyncBatchNorm):
    """``SyncBatchNorm`` whose statistics, inside a sharded forward, are bigconv's whole-batch ones."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # The dry run's single-process shape check runs on meta tensors without a mode: plain
        # BatchNorm there too (SyncBatchNorm's own would refuse a meta tensor under a process group).
        if active_mode() is not None or input.device.type == "meta":
            return _BatchNorm.forward(self, input)
        return super().forward(input)


def adopt(model: nn.Module) -> nn.Module:
    """Give every ``SyncBatchNorm`` of ``model`` (in place) the class above; returns ``model``.

    A ``process_group`` other than the default one would mean statistics over some processes only,
    which bigconv's layout does not know: refused, with the fix.
    """
    for name, module in model.named_modules():
        if type(module) is nn.SyncBatchNorm:
            if module.process_group is not None:
                raise ValueError(
                    f"module '{name}' (SyncBatchNorm) has its own process_group: bigconv computes BatchNorm "
                    "statistics over the whole batch of the spatial grid and its replicas, and cannot restrict "
                    "them to a group; convert with convert_sync_batchnorm(model) and no process_group")
            module.__class__ = ShardedSyncBatchNorm
    return model
