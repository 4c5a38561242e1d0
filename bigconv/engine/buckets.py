"""Parameter gradients summed over every rank while backward is still running.

Every rank's gradient is a partial sum: its shard's share of its replica's batch slice. The
single-process gradient on the full batch is the plain **sum** over all ranks, spatial shards and
replicas alike (no DDP averaging). Parameters are cut into buckets in reverse registration order
(roughly the order backward produces them); as soon as every parameter of the next bucket has its
gradient, the bucket's flat allreduce starts asynchronously, as DDP does. Buckets always start in
index order, so every rank issues the same collectives in the same order even where hooks fire in
another. What backward never reached (an unused parameter) is settled at ``finish``.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from ..transport import WorkerFailure, check_wire, wait_work

BUCKET_BYTES = 25 * 2**20
"""The default bucket size (read when buckets are made: a test sets 1 for one bucket per parameter)."""


def lost_rank_wait(timeout: float) -> float:
    """How long survivors of a failed collective wait for each other's answer to a roll call: long
    enough for the slowest survivor to fail too, bounded so the error comes soon after the timeout."""
    return min(10.0, timeout / 2)


class GradBuckets:
    def __init__(self, params: list[torch.nn.Parameter], group, timeout: float,
                 bucket_bytes: int | None = None, roll_call=None) -> None:
        """``roll_call``: a ``transport.roll_call.RollCall`` to name the rank a failed sum lost."""
        self.group, self.timeout, self.roll_call = group, timeout, roll_call
        self.device = params[0].device if params else torch.device("cpu")
        bucket_bytes = BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        self.buckets: list[list[torch.nn.Parameter]] = []
        size = 0
        for p in reversed(params):
            last = self.buckets[-1] if self.buckets else None
            if last is None or size + p.numel() * p.element_size() > bucket_bytes or \
                    (last[0].dtype, last[0].device) != (p.dtype, p.device):
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self.bucket_of = {p: i for i, b in enumerate(self.buckets) for p in b}
        # The hooks reach these buckets through a weak reference: a parameter holding a hook that holds
        # the buckets that hold the parameter is a cycle the garbage collector does not see through a
        # tensor, and it kept every dropped model's weights alive on a long-lived worker.
        me = weakref.ref(self)
        self.handles = [p.register_post_accumulate_grad_hook(lambda p, me=me: me() and me()._ready(p))
                        for p in params]
        self.reset()

    def reset(self) -> None:
        self.waiting = [len(b) for b in self.buckets]
        self.next = 0
        self.flights: list[tuple[int, torch.Tensor, object]] = []
        self.armed = False

    def arm(self) -> None:
        """Reduce during the next backward (other backward passes, e.g. ``gradients``, are left alone)."""
        self.reset()
        self.armed = True

    def _ready(self, p: torch.nn.Parameter) -> None:
        if not self.armed:
            return
        self.waiting[self.bucket_of[p]] -= 1
        while self.next < len(self.buckets) and self.waiting[self.next] == 0:
            self._launch(self.next)
            self.next += 1

    def _launch(self, i: int) -> None:
        group = self.buckets[i]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in group])
        check_wire([flat], self.device, "a gradient bucket")
        self.flights.append((i, flat, dist.all_reduce(flat, group=self.group, async_op=True)))

    def reduce(self, grads: dict) -> None:
        """Sum ``grads`` (parameter to gradient, e.g. a distributed-autograd context's) now rather than
        during backward, into ``p.grad``; what ``grads`` lacks counts as zeros, as in ``finish``."""
        for b in self.buckets:
            for p in b:
                p.grad = grads.get(p)
        self.arm()
        self.finish()

    def finish(self) -> None:
        """Start what backward left, wait for every bucket and write the sums into ``p.grad``; a parameter
        no rank gave a gradient keeps ``grad=None``, as in one process."""
        params = [p for b in self.buckets for p in b]
        present = torch.tensor([p.grad is not None for p in params], dtype=torch.float32,
                               device=params[0].device if params else "cpu")
        while self.next < len(self.buckets):
            self._launch(self.next)
            self.next += 1
        seen = dist.all_reduce(present, group=self.group, async_op=True)
        try:
            for i, flat, work in self.flights:
                wait_work(work, self.device, self.timeout)
                offset = 0
                for p in self.buckets[i]:
                    p.grad = flat[offset: offset + p.numel()].view_as(p)
                    offset += p.numel()
            wait_work(seen, self.device, self.timeout)
        except Exception as exc:
            who = "another rank died or stalled" if self.roll_call is None else \
                self.roll_call.describe(lost_rank_wait(self.timeout))
            raise WorkerFailure(f"rank {dist.get_rank()}: the gradient allreduce did not complete within "
                                f"{self.timeout:g}s ({who}): {exc}") from exc
        for p, n in zip(params, present.tolist()):
            if n == 0:
                p.grad = None
        self.armed = False

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
