"""The native loop: an SPMD model in the user's own ``loss.backward()``, as DDP's module is.

``SpmdModel.forward`` returns this rank's share of the output with autograd; this module makes the
backward of that share leave every parameter's ``.grad`` equal to one process's gradient:

- ``GradSync`` arms the engine's gradient buckets (``bigconv.engine.buckets``) at a forward, so each
  bucket's allreduce starts while backward still runs, and waits for the sums at the end of that
  backward (an autograd engine callback, queued by the first gradient to reach the outputs). Inside
  ``no_sync`` a forward arms nothing: the gradients accumulate locally in ``.grad``, and the first
  synced backward sums the accumulation (the buckets read ``.grad`` after accumulation), as DDP does.
- ``Sink`` is the identity on the outputs that queues that callback, and passes a zero gradient from a
  replicated output (a head, equal on every shard of a replica) on every shard but the replica's first:
  each shard holds a copy of the same value and only one copy may count, so that every rank can
  compute the same loss from it and the sum over ranks is one process's gradient.

Gradients are summed over every rank (spatial shards and replicas): the loss of a batch is the sum of
the ranks' contributions. ``shard_loss`` and ``whole_loss`` (in ``SpmdModel``) build such losses.
"""

from __future__ import annotations

import torch
from torch.autograd import Variable

from ..engine.shard import ShardEngine


class GradSync:
    """When the gradient sum of a native backward starts and ends (see the module doc)."""

    def __init__(self, engine: ShardEngine) -> None:
        self.engine = engine
        self.enabled = True
        """False inside ``no_sync``: forwards arm nothing and gradients accumulate locally."""
        self.pending = False
        """A forward armed the buckets; the backward that sums them has not ended."""
        self.queued = False

    def arm(self) -> None:
        self.engine.buckets.arm()
        self.pending, self.queued = True, False

    def queue_finish(self) -> None:
        """From inside a backward: wait for the sums when the whole backward has run (once)."""
        if self.pending and not self.queued:
            self.queued = True
            Variable._execution_engine.queue_callback(self.finish)

    def finish(self) -> None:
        self.queued = False
        if self.pending:
            self.pending = False
            self.engine.buckets.finish()


class Sink(torch.autograd.Function):
    """The identity on the outputs; in backward, queues the end of the gradient sum and zeroes the
    gradients of the outputs marked ``False`` in ``count`` (copies of a replicated output that do not
    count)."""

    @staticmethod
    def forward(ctx, sync: GradSync | None, count: tuple[bool, ...], *outs):
        ctx.sync, ctx.count = sync, count
        return tuple(o.view_as(o) for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.sync is not None:
            ctx.sync.queue_finish()
        return (None, None, *[g if keep or g is None else torch.zeros_like(g) for g, keep in zip(grads, ctx.count)])
