"""A worker process's one host: its identity, links, statistics and the parts installed on it.

The driver creates each worker's ``WorkerHost`` when the World starts (``rpc.remote``) and keeps an
RRef to it; every later call names the host in its arguments (``on_host``), so the worker finds its
state in the message, never in a module global. What runs on a worker is a *part*: bigconv's model
replicas, multidsn's encoder parts, the harness's recorder, the halo probe. Parts share one id space
(the World numbers them) and one lifecycle (``install``, calls, ``uninstall``); a part class takes the
host first and may define ``close()``.
"""

from __future__ import annotations

import gc
import hashlib
import hmac
import os
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from ..data.prefetch import Prefetcher
from ..memory import PeakMeter
from ..transport import WorkerRuntime, worker_name
from ..transport.comm_checks import CommChecks, OrderRecorder
from ..transport.rpc import RpcLink


DEVICE_ENV = "BIGCONV_WORKER_DEVICE"
"""Where ``serve`` writes the device it picked for this process (RPC threads start on CUDA device 0,
so the current device cannot tell)."""


def this_device() -> torch.device:
    return torch.device(os.environ.get(DEVICE_ENV, "cpu"))


def goodbye_keys(secret: str) -> tuple[str, str]:
    """The store keys of a World's goodbye (set by the driver; each worker adds one to the second as it
    leaves), named by the World's secret: a process without it cannot set them, and one that lists the
    store's keys sees them only once the driver has set them."""
    tag = hmac.new(secret.encode(), b"bigconv-goodbye", hashlib.sha256).hexdigest()[:32]
    return f"bigconv-release/{tag}", f"bigconv-released/{tag}"


_GOODBYE: list[tuple[str, str] | None] = [None]


def expected_goodbye() -> tuple[str, str] | None:
    """This worker's goodbye keys, once the driver has created its host (``worker.serve`` waits on them)."""
    return _GOODBYE[0]


class WorkerHost:
    """One worker process (see the module doc)."""

    def __init__(self, index: int, workers: int, timeout: float, checks: str, secret: str) -> None:
        """``secret``: the World's (``goodbye_keys``), from the driver over RPC, never through the store."""
        _GOODBYE[0] = goodbye_keys(secret)
        comm_checks = CommChecks.parse(checks)
        device = this_device()
        # The order check records from before the gradient group exists, as every collective counts.
        self.order = OrderRecorder().install() if comm_checks.order else None
        # The gradient sums' own communicator: never the halos' one (see ``runtime.spmd_world``).
        # Collective over every worker: the driver creates every host at once.
        grad_group = dist.new_group(list(range(workers)))
        self.rt = WorkerRuntime(index=index, workers=workers, device=device, timeout=timeout, checks=comm_checks,
                                grad_group=grad_group, reads=Prefetcher())
        self.meter = PeakMeter(device)  # the idle baseline: imports, RPC and the process group, no part yet
        self.parts: dict[int, Any] = {}

    @property
    def name(self) -> str:
        return worker_name(self.rt.index)

    def mailbox(self) -> rpc.RRef:
        """This worker's mailbox, for the other workers' ``RpcLink`` pushes."""
        return rpc.RRef(self.rt.mailbox)

    def connect(self, mailboxes: list) -> None:
        """Every worker's mailbox (RRefs, in worker order): the link of the rpc transport and the probes."""
        self.rt.link = RpcLink(self.rt, mailboxes)

    # -- parts ------------------------------------------------------------------------------------------
    def install(self, part_id: int, factory: Callable, *args) -> None:
        """``factory(host, *args)`` becomes part ``part_id``; a factory may return None (nothing to hold
        here, e.g. a worker a model leaves idle)."""
        if part_id in self.parts:
            raise RuntimeError(f"{self.name} already holds part {part_id}")
        part = factory(self, *args)
        if part is not None:
            self.parts[part_id] = part

    def part(self, part_id: int) -> Any:
        if part_id not in self.parts:
            raise RuntimeError(f"{self.name} holds no part {part_id} (it holds {sorted(self.parts)})")
        return self.parts[part_id]

    def uninstall(self, part_ids: list[int]) -> None:
        for part_id in part_ids:
            part = self.parts.pop(part_id, None)
            close = getattr(part, "close", None)
            if close is not None:
                close()
        gc.collect()  # a replica's module tree holds reference cycles (hooks, the module path)

    def installed(self) -> list[int]:
        return sorted(self.parts)

    # -- statistics -------------------------------------------------------------------------------------
    def reset_peaks(self) -> None:
        """A new peak, and new traffic counts, from what this worker holds now (e.g. after a warm-up)."""
        self.meter.reset()
        for key in self.rt.stats:
            self.rt.stats[key] = type(self.rt.stats[key])()

    def memory(self) -> dict:
        """This worker's peak memory above its idle baseline, with the device and sources used."""
        record = self.meter.read()
        record["device"] = str(self.rt.device)
        return record

    def traffic(self) -> dict:
        return dict(self.rt.stats)

    def comm_order_log(self) -> list | None:
        """What this worker issued since the last call, under the ``order`` check (None without it)."""
        return self.order.take() if self.order is not None else None


# -- the RPC entry points: the host travels in the message ------------------------------------------------
def on_host(host: rpc.RRef, fn: Callable, args: tuple) -> Any:
    """``fn(host, *args)`` on the worker owning ``host``: ``fn`` a ``WorkerHost`` method or any module
    function taking the host first."""
    return fn(host.local_value(), *args)


def on_part(host: rpc.RRef, part_id: int, method: str, args: tuple) -> Any:
    """``part.method(*args)`` of part ``part_id`` on the worker owning ``host``."""
    return getattr(host.local_value().part(part_id), method)(*args)
