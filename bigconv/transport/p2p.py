"""The SPMD mode's link: every exchange is one ``batch_isend_irecv`` inside an autograd Function.

Forward: ``start`` posts, in one batch, the sends of this shard's parts and the receives of what
other shards send it; the executor then computes what needs no halo; ``finish`` waits for the batch.
Backward is the adjoint exchange, again one batch: the gradients of what was received go back to its
owners, which add them into the gradient of what they sent. Local autograd only: no RPC, no
distributed autograd.

Two Functions carry one exchange: ``_Start`` (``x`` in, ``x`` out: its backward adds the returning
gradients into ``x``'s) and ``_Finish`` (``x`` in, the received tensors out: its backward posts the
gradient batch). Autograd runs a rank's nodes in reverse creation order, and every rank creates its
exchanges in the same program order, so every rank posts its gradient batches in the same order:
no pair can wait on each other. A shard that receives nothing in an exchange has no ``_Finish``;
its ``_Start`` posts the gradient batch instead.

Waits carry a timeout that names the peers, so a dead or stalled rank is an error, never a hang (on
the CPU; on CUDA a wait only orders the stream, see ``transport.wait_timeout``). With ``tag_free`` every
message carries tag 0 and pairs match in posting order, as on NCCL (``transport.comm_checks``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from . import Recv, Send, WorkerFailure, WorkerRuntime, check_wire, numbered, wait_work
from .mesh import Mesh

TAG_SPAN = 64
"""Messages per pair and exchange that get their own gloo tag (NCCL ignores tags)."""
EXCHANGE_SPAN, CALL_SPAN = 2**14, 2**10
"""Exchanges per call, and calls, before tags repeat."""


def _full(index):
    return (Ellipsis,) if index is None else index


@dataclass
class _Exchange:
    """One exchange on one rank, forward and backward."""

    link: "P2PLink"
    key: tuple
    sends: list[tuple[int, object, int]]
    """(peer shard, index into x, tag)"""
    recvs: list[tuple[int, tuple[int, ...], int]]
    """(peer shard, shape, tag)"""
    pieces: list = field(default_factory=list)
    bufs: list = field(default_factory=list)
    works: list = field(default_factory=list)
    grad_out: list = field(default_factory=list)
    grad_in: list = field(default_factory=list)
    grad_works: list | None = None

    def post(self, x: torch.Tensor) -> None:
        self.pieces = [x[_full(i)].contiguous() for _, i, _ in self.sends]
        self.bufs = [x.new_empty(shape) for _, shape, _ in self.recvs]
        self.works = self.link.batch([(p, t, piece) for (p, _, t), piece in zip(self.sends, self.pieces)],
                                     [(p, t, buf) for (p, _, t), buf in zip(self.recvs, self.bufs)])

    def post_grads(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Send back the gradients of what arrived (zeros where none flowed); receive those of what left."""
        self.grad_out = [g.contiguous() if g is not None else buf.new_zeros(buf.shape)
                         for g, buf in zip(grads, self.bufs)]
        self.grad_in = [piece.new_empty(piece.shape) for piece in self.pieces]
        self.grad_works = self.link.batch(
            [(p, t + TAG_SPAN // 2, g) for (p, _, t), g in zip(self.recvs, self.grad_out)],
            [(p, t + TAG_SPAN // 2, g) for (p, _, t), g in zip(self.sends, self.grad_in)])
        self.bufs = []  # the forward's arrivals are no longer needed here

    def peers(self) -> list[int]:
        return sorted({p for p, _, _ in self.sends} | {p for p, _, _ in self.recvs})


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ex: _Exchange):
        ex.post(x)
        ctx.ex, ctx.shape = ex, x.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_x):
        ex: _Exchange = ctx.ex
        if ex.grad_works is None:
            ex.post_grads([None] * len(ex.recvs))
        ex.link.wait(ex.grad_works, ex, "gradients of the halos it sent")
        if not ex.sends:
            return grad_x, None
        if grad_x is None:
            grad_x = ex.grad_in[0].new_zeros(ctx.shape)
        elif (any(index is None for _, index, _ in ex.sends) or grad_x._base is not None
              or not grad_x.is_contiguous()):  # a gather's sum hands one gradient to every term
            grad_x = grad_x.clone(memory_format=torch.contiguous_format)
        for (_, index, _), g in zip(ex.sends, ex.grad_in):
            grad_x[_full(index)] += g
        ex.pieces, ex.grad_in, ex.grad_out, ex.grad_works = [], [], [], []
        return grad_x, None


class _Finish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ex: _Exchange):
        ex.link.wait(ex.works, ex, "halos")
        ctx.ex = ex
        return tuple(ex.bufs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.ex.post_grads(grads)
        return None, None


class P2PLink:
    """Exchanges between the shards of one spatial group, by point-to-point over ``group``.

    ``ranks[i]`` is the global rank of shard ``i``; every tensor on the wire lies on ``device``.
    """

    ring_in_backward = True
    """Exchanges may run inside an autograd Function's backward (ring attention's passes)."""

    def __init__(self, group, ranks: Sequence[int], index: int, timeout: float, stats: dict, *,
                 device: torch.device | str = "cpu", tag_free: bool = False) -> None:
        self.group, self.ranks, self.index = group, list(ranks), index
        self.timeout, self.stats = float(timeout), stats
        self.device, self.tag_free = torch.device(device), tag_free
        self.blocking = os.environ.get("BIGCONV_P2P_BLOCKING") == "1"
        """Wait for each exchange as soon as it is posted: no overlap (the benchmarks' reference)."""

    def start(self, x: torch.Tensor, key: tuple, sends: Sequence[Send], recvs: Sequence[Recv]):
        if not sends and not recvs:
            return x, None
        # The call is in the tag too: a message a failed call left behind can never match a later call's.
        base = (((key[0] % CALL_SPAN) * EXCHANGE_SPAN + key[1] % EXCHANGE_SPAN) * TAG_SPAN) % (2**30)
        ex = _Exchange(self, key,
                       [(p, index, base + n % (TAG_SPAN // 2)) for (p, n), (_, index) in
                        zip(numbered([d for d, _ in sends]), sends)],
                       [(p, tuple(shape), base + n % (TAG_SPAN // 2))
                        for (p, n), (_, shape) in zip(numbered([s for s, _ in recvs]), recvs)])
        x = _Start.apply(x, ex)
        if self.blocking:
            self.wait(ex.works, ex, "halos (blocking)")
        return x, (x, ex)

    def finish(self, pending, describe: str) -> list[torch.Tensor]:
        if pending is None:
            return []
        x, ex = pending
        if not ex.recvs:
            ex.link.wait(ex.works, ex, describe)
            return []
        out = _Finish.apply(x, ex)
        return list(out) if isinstance(out, tuple) else [out]

    # -- the wire -------------------------------------------------------------------------------
    def batch(self, sends: list, recvs: list) -> list:
        check_wire([t for _, _, t in sends + recvs], self.device, "a halo exchange")
        if self.tag_free:
            sends, recvs = [(p, 0, t) for p, _, t in sends], [(p, 0, t) for p, _, t in recvs]
        ops = [dist.P2POp(dist.isend, t, self.ranks[p], self.group, tag) for p, tag, t in sends]
        ops += [dist.P2POp(dist.irecv, t, self.ranks[p], self.group, tag) for p, tag, t in recvs]
        self.stats["messages"] += len(sends)
        self.stats["bytes"] += sum(t.numel() * t.element_size() for _, _, t in sends)
        self.stats["recv_bytes"] += sum(t.numel() * t.element_size() for _, _, t in recvs)
        return dist.batch_isend_irecv(ops) if ops else []

    def wait(self, works: list, ex: _Exchange, what: str) -> None:
        start = time.perf_counter()
        try:
            for work in works:
                wait_work(work, self.device, self.timeout)
            # A finished work still holds its tensors, among them the received halos whose grad_fn holds
            # this exchange: a cycle through C++ that the garbage collector cannot see, which kept every
            # graph with a whole-tensor gather (and the weights it saved) alive after its backward.
            works.clear()
        except Exception as exc:
            peers = ", ".join(f"rank {self.ranks[p]}" for p in ex.peers())
            raise WorkerFailure(
                f"rank {self.ranks[self.index]} did not complete exchange {ex.key[1]} of call {ex.key[0]} ({what}) with "
                f"{peers} within {self.timeout:g}s: {exc}") from exc
        finally:
            self.stats["wait_s"] += time.perf_counter() - start


def shard_runtime(mesh: Mesh, device: torch.device, timeout: float, stats: dict, grad_group, checks,
                  reads) -> WorkerRuntime:
    """The runtime of one shard exchanging point-to-point (an SPMD rank, a driver's worker on ``p2p``):
    its halo link inside its replica's spatial group and, with replicas, its link to the same shard
    position of the other replicas (batch statistics). ``reads``: the process's ``Prefetcher``."""
    rt = WorkerRuntime(index=mesh.shard, workers=mesh.spatial, device=device, timeout=timeout, stats=stats,
                       grad_group=grad_group, checks=checks, replica=mesh.replica, replicas=mesh.replicas, mesh=mesh,
                       reads=reads)
    wire = dict(device=device, tag_free=checks.tag_free)
    rt.link = P2PLink(mesh.spatial_group, mesh.spatial_ranks, mesh.shard, timeout, stats, **wire)
    if mesh.replicas > 1:
        rt.replica_link = P2PLink(mesh.replica_group, mesh.replica_ranks, mesh.replica, timeout, stats, **wire)
    return rt
