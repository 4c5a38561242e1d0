"""The driver mode's link: push over RPC into the receiver's mailbox.

The owner of a region pushes it as soon as it is computed (one message, no round trip); the receiver
takes it from its mailbox. A link knows the other shards' mailboxes as RRefs (``torch.distributed.rpc``),
handed to it when the World starts, so the receiving process finds its mailbox in the message itself. Tensors that require grad carry a distributed-autograd send/recv pair, so
the backward pass flows back to the owner inside the driver's context. Every wait has a timeout
that names the sender, so a dead worker turns into an error, never a hang.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Hashable, Sequence

import torch
import torch.distributed.rpc as rpc

from . import Mailbox, Recv, Send, WorkerFailure, WorkerRuntime, numbered, worker_name


def _deliver(mailbox: rpc.RRef, key: Hashable, tensor: torch.Tensor) -> None:
    """Runs on the receiver, which owns ``mailbox``."""
    mailbox.local_value().put(key, tensor)


def push(rt: WorkerRuntime, mailboxes: Sequence[rpc.RRef], dst: int, key: Hashable, tensor: torch.Tensor) -> None:
    """Send ``tensor`` to worker ``dst``'s mailbox without waiting; errors surface in ``flush``."""
    # RPC pickles a view's whole storage, and halo transport stays on the host (CUDA tensors over
    # RPC with distributed autograd are beta upstream), so send a compact CPU copy.
    payload = tensor.to("cpu")
    if payload._base is not None or not payload.is_contiguous():
        payload = payload.clone(memory_format=torch.contiguous_format)
    rt.stats["messages"] += 1
    rt.stats["bytes"] += payload.numel() * payload.element_size()
    rt.pending.append((dst, rpc.rpc_async(worker_name(dst), _deliver, args=(mailboxes[dst], key, payload),
                                          timeout=rt.timeout)))


def take(rt: WorkerRuntime, src: int, key: Hashable, describe: str) -> torch.Tensor:
    start = time.perf_counter()
    tensor = rt.mailbox.take(key, rt.timeout, f"{describe} from {worker_name(src)} (on {worker_name(rt.index)})")
    rt.stats["wait_s"] += time.perf_counter() - start
    rt.stats["recv_bytes"] += tensor.numel() * tensor.element_size()
    return tensor.to(rt.device)


def flush(rt: WorkerRuntime) -> None:
    """Wait for ``rt``'s pushes to be acknowledged; name the receiver of any that failed."""
    pending, rt.pending = rt.pending, []
    for dst, fut in pending:
        try:
            fut.wait()
        except Exception as exc:
            raise WorkerFailure(f"{worker_name(rt.index)} could not deliver to {worker_name(dst)}: {exc}") from exc


class SendPieces(torch.autograd.Function):
    """``x`` itself, plus compact copies of the regions other shards need from it.

    In backward the pieces' gradients are added in place into the gradient of ``x`` that the
    convolution produced, so halos cost no second full-size gradient buffer (slicing would give
    each piece its own full-size zero gradient).
    """

    @staticmethod
    def forward(ctx, x, *indices):
        ctx.indices, ctx.shape = indices, x.shape
        pieces = tuple(x[index].clone(memory_format=torch.contiguous_format) for index in indices)
        return (x.view_as(x),) + pieces

    @staticmethod
    def backward(ctx, grad_x, *grads):
        # grad_x is the fresh buffer autograd accumulated for x's own use, except when x is sent whole
        # (a gather), whose consumer (a sum) hands the same gradient to every term.
        if grad_x is None:
            grad_x = grads[0].new_zeros(ctx.shape)
        elif FULL in ctx.indices:
            grad_x = grad_x.clone()
        for index, grad in zip(ctx.indices, grads):
            if grad is not None:
                grad_x[index] += grad
        return (grad_x,) + (None,) * len(ctx.indices)


FULL = (Ellipsis,)


@dataclass
class _Pending:
    keys: list[tuple]
    sources: list[int]


class RpcLink:
    """Pushes every part at ``start`` into the receivers' mailboxes (``mailboxes``: every shard's, as
    RRefs, in shard order); ``finish`` takes the arrivals from this shard's own."""

    ring_in_backward = False
    """Exchanges inside an autograd Function's backward (ring attention's passes) stall under distributed
    autograd (seen as a 60 s RPC timeout in backward); ring attention gathers instead on this link."""

    def __init__(self, rt: WorkerRuntime, mailboxes: Sequence[rpc.RRef]) -> None:
        self.rt = rt
        self.mailboxes = list(mailboxes)

    def _push(self, dst: int, key: tuple, piece: torch.Tensor) -> None:
        push(self.rt, self.mailboxes, dst, key, piece)

    def start(self, x: torch.Tensor, key: tuple, sends: Sequence[Send], recvs: Sequence[Recv]):
        if sends:
            x, *pieces = SendPieces.apply(x, *(FULL if index is None else index for _, index in sends))
            for (dst, number), piece in zip(numbered([d for d, _ in sends]), pieces):
                self._push(dst, key + (self.rt.index, number), piece)
        peers = numbered([s for s, _ in recvs])
        return x, _Pending([key + (src, number) for src, number in peers], [src for src, _ in peers])

    def finish(self, pending: _Pending, describe: str) -> list[torch.Tensor]:
        return [take(self.rt, src, k, describe) for src, k in zip(pending.sources, pending.keys)]


class LocalLink(RpcLink):
    """The dry run's link: shards are threads of one process, so a push puts the piece straight into
    the receiver's ``Mailbox``."""

    ring_in_backward = True  # threads of one process, local autograd

    def __init__(self, rt: WorkerRuntime, mailboxes: Sequence[Mailbox]) -> None:
        super().__init__(rt, [])
        self.local = list(mailboxes)

    def _push(self, dst: int, key: tuple, piece: torch.Tensor) -> None:
        self.local[dst].put(key, piece)
