"""How shards exchange tensors: one interface, two transports.

The executor (``bigconv.engine.executor``) describes every exchange the same way: which parts of a local
tensor go to which shard, and which shapes arrive from which shard. A *link* carries it out:

- ``rpc.RpcLink`` (the driver mode): each part is pushed over RPC into the receiver's mailbox at
  once, and taken out when needed; distributed autograd carries gradients back.
- ``p2p.P2PLink`` (the SPMD mode): each exchange is one ``batch_isend_irecv`` over a process group,
  inside an autograd Function whose backward runs the adjoint exchange; local autograd only.

Both start an exchange, let the executor compute what needs no halo, then finish it. The op rules
never see which link runs them.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Hashable, Iterable, Protocol, Sequence

import torch

from .comm_checks import CommChecks


class WorkerFailure(RuntimeError):
    """A worker died, timed out or raised; the message names it."""


def worker_name(index: int) -> str:
    return f"worker{index}"


class Mailbox:
    """Tensors delivered to this worker, keyed by (call, exchange, sender)."""

    def __init__(self, lock: threading.RLock | None = None) -> None:
        """``lock``: one shared by several mailboxes whose threads take turns (``bigconv.engine.dry_run``)."""
        self._items: dict[Hashable, torch.Tensor] = {}
        self._cond = threading.Condition(lock)
        self._aborted: str | None = None

    def put(self, key: Hashable, tensor: torch.Tensor) -> None:
        with self._cond:
            self._items[key] = tensor
            self._cond.notify_all()

    def abort(self, reason: str) -> None:
        """Make every wait, now and later, raise ``reason`` (another simulated shard failed)."""
        with self._cond:
            self._aborted = reason
            self._cond.notify_all()

    def take(self, key: Hashable, timeout: float, describe: str) -> torch.Tensor:
        deadline = time.monotonic() + timeout
        with self._cond:
            while key not in self._items:
                if self._aborted:
                    raise WorkerFailure(self._aborted)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WorkerFailure(f"timed out after {timeout:g}s waiting for {describe}")
                self._cond.wait(left)
            return self._items.pop(key)

    def drop_calls_before(self, call: int) -> None:
        """Forget leftovers of failed earlier calls."""
        with self._cond:
            for key in [k for k in self._items if k[0] < call]:
                del self._items[key]


def new_stats() -> dict:
    """A shard's traffic and read counters, from zero."""
    return {"messages": 0, "bytes": 0, "recv_bytes": 0, "wait_s": 0.0, "read_s": 0.0, "read_bytes": 0,
            "prefetch_read_s": 0.0}


@dataclass
class WorkerRuntime:
    """A shard's identity and transport: a worker process's own, or one of its models' (p2p)."""

    index: int
    workers: int
    device: torch.device
    timeout: float
    mailbox: Mailbox = field(default_factory=Mailbox)
    pending: list = field(default_factory=list)
    stats: dict = field(default_factory=lambda: new_stats())
    link: Any = None
    """The link executors use: a ``p2p.P2PLink`` (SPMD ranks, driver workers on the p2p transport), an
    ``rpc.RpcLink`` (mailboxes: the rpc transport) or an ``rpc.LocalLink`` (the dry run's threads);
    whoever makes the runtime sets it."""
    reads: Any = None
    """This process's reads started ahead (``data.prefetch.Prefetcher``), shared by its shards."""
    replica: int = 0
    replicas: int = 1
    mesh: Any = None
    """This process's place among the shards and replicas (``transport.mesh.Mesh``), for whole-output
    losses."""
    replica_link: Any = None
    """Between the replicas of one shard position (SPMD with ``replicas > 1``): for batch statistics."""
    grad_group: Any = None
    """The process group (communicator) of the gradient sums: never the halos' own, so that NCCL never
    sees a rank-dependent order of halo batches and gradient allreduces on one stream (None: the default
    group, for worlds that exchange no halos over it)."""
    checks: CommChecks = field(default_factory=CommChecks)
    """The test modes of ``comm_checks`` this world runs under."""


Send = tuple[int, Any]
"""(destination shard, index into the local tensor; None for the whole tensor)."""
Recv = tuple[int, Sequence[int]]
"""(source shard, full shape of the tensor that arrives)."""


class Link(Protocol):
    """Carries out exchanges for one shard. Messages between one pair in one exchange are matched
    in the order they are listed, on both sides."""

    def start(self, x: torch.Tensor, key: tuple, sends: Sequence[Send], recvs: Sequence[Recv]) -> tuple:
        """Begin exchange ``key``; return ``x`` to use from here on (it carries the backward of the
        sends) and a pending handle."""

    def finish(self, pending, describe: str) -> list[torch.Tensor]:
        """The received tensors, in ``recvs`` order."""


def numbered(peers: Sequence[int]) -> list[tuple[int, int]]:
    """(peer, n): the n-th message with that peer in this exchange, to key or tag it."""
    seen: dict[int, int] = {}
    out = []
    for peer in peers:
        out.append((peer, seen.get(peer, 0)))
        seen[peer] = seen.get(peer, 0) + 1
    return out


# -- what NCCL requires of every tensor and wait, checked on every device ------------------------------
def check_wire(tensors: Iterable[torch.Tensor], device: torch.device, what: str) -> None:
    """Every tensor handed to a collective or a ``P2POp`` lies on the world's device and is contiguous
    (gloo copies what NCCL refuses or reads wrongly)."""
    for t in tensors:
        if t.device != device or not t.is_contiguous():
            raise RuntimeError(f"{what}: a tensor of shape {tuple(t.shape)} on {t.device} "
                               f"({'contiguous' if t.is_contiguous() else 'not contiguous'}) was handed to the "
                               f"wire of a world on {device}; it must be contiguous and on {device}")


def wait_timeout(device: torch.device, timeout: float) -> timedelta | None:
    """How long a ``Work.wait`` may block: bounded on the CPU (gloo's wait blocks the thread, and a bound
    turns a dead peer into an error naming it); unbounded on CUDA, where a wait with a timeout spins the
    CPU until the kernel ends and aborts the communicator on expiry, while one without only makes the
    current stream wait (the NCCL watchdog, set above the link timeout by ``process_group_timeout``, then
    bounds a stalled peer)."""
    return None if torch.device(device).type == "cuda" else timedelta(seconds=timeout)


def process_group_timeout(device: torch.device, timeout: float) -> timedelta:
    """The process group's own timeout: the link's on the CPU; on CUDA above it (twice, plus slack), so
    that the driver's wait (1.1 times the link timeout) names a stalled worker before NCCL's watchdog
    kills the processes."""
    return timedelta(seconds=timeout if torch.device(device).type != "cuda" else 2 * timeout + 30)


def wait_work(work, device: torch.device, timeout: float) -> None:
    limit = wait_timeout(device, timeout)
    done = work.wait() if limit is None else work.wait(limit)
    if done is False:
        raise RuntimeError("wait returned False")
