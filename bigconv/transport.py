"""Point-to-point tensor transport between workers: push over RPC into a mailbox.

The owner of a region pushes it as soon as it is computed (one message, no round trip); the receiver
takes it from its mailbox. Tensors that require grad carry a distributed-autograd send/recv pair, so
the backward pass flows back to the owner inside the driver's context. Every wait has a timeout
that names the sender, so a dead worker turns into an error, never a hang.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable

import torch
import torch.distributed.rpc as rpc


class WorkerFailure(RuntimeError):
    """A worker died, timed out or raised; the message names it."""


def worker_name(index: int) -> str:
    return f"worker{index}"


class Mailbox:
    """Tensors delivered to this worker, keyed by (call, exchange, sender)."""

    def __init__(self) -> None:
        self._items: dict[Hashable, torch.Tensor] = {}
        self._cond = threading.Condition()
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


@dataclass
class WorkerRuntime:
    """This process's identity and transport; one per worker process."""

    index: int
    workers: int
    device: torch.device
    timeout: float
    mailbox: Mailbox = field(default_factory=Mailbox)
    pending: list = field(default_factory=list)
    models: dict = field(default_factory=dict)
    stats: dict = field(default_factory=lambda: {"messages": 0, "bytes": 0, "recv_bytes": 0, "wait_s": 0.0,
                                                 "read_s": 0.0, "read_bytes": 0, "prefetch_read_s": 0.0})
    send: Callable[[int, Hashable, torch.Tensor], None] | None = None
    """Delivers to another worker's mailbox; None: over RPC. The dry run delivers in process."""


_RUNTIME: WorkerRuntime | None = None
_THREAD = threading.local()


def runtime() -> WorkerRuntime:
    """This thread's runtime (a shard of the driver's dry run), else this worker process's."""
    rt = getattr(_THREAD, "runtime", None) or _RUNTIME
    if rt is None:
        raise RuntimeError("this process is not a bigconv worker")
    return rt


def set_thread_runtime(rt: WorkerRuntime | None) -> None:
    _THREAD.runtime = rt


def set_runtime(rt: WorkerRuntime | None) -> None:
    global _RUNTIME
    _RUNTIME = rt


def _deliver(key: Hashable, tensor: torch.Tensor) -> None:
    runtime().mailbox.put(key, tensor)


def push(dst: int, key: Hashable, tensor: torch.Tensor) -> None:
    """Send ``tensor`` to worker ``dst`` without waiting; errors surface in ``flush``."""
    rt = runtime()
    if rt.send is not None:
        rt.send(dst, key, tensor)
        return
    # RPC pickles a view's whole storage, and halo transport stays on the host (CUDA tensors over
    # RPC with distributed autograd are beta upstream), so send a compact CPU copy.
    payload = tensor.to("cpu")
    if payload._base is not None or not payload.is_contiguous():
        payload = payload.clone(memory_format=torch.contiguous_format)
    rt.stats["messages"] += 1
    rt.stats["bytes"] += payload.numel() * payload.element_size()
    rt.pending.append((dst, rpc.rpc_async(worker_name(dst), _deliver, args=(key, payload), timeout=rt.timeout)))


def take(src: int, key: Hashable, describe: str) -> torch.Tensor:
    rt = runtime()
    start = time.perf_counter()
    tensor = rt.mailbox.take(key, rt.timeout, f"{describe} from {worker_name(src)} (on {worker_name(rt.index)})")
    rt.stats["wait_s"] += time.perf_counter() - start
    rt.stats["recv_bytes"] += tensor.numel() * tensor.element_size()
    return tensor.to(rt.device)


def flush() -> None:
    """Wait for this worker's pushes to be acknowledged; name the receiver of any that failed."""
    rt = runtime()
    pending, rt.pending = rt.pending, []
    for dst, fut in pending:
        try:
            fut.wait()
        except Exception as exc:
            raise WorkerFailure(f"{worker_name(rt.index)} could not deliver to {worker_name(dst)}: {exc}") from exc
