"""Reads started before they are needed: a worker reads the next step's boxes while this step computes.

The driver asks (``ParallelModel.prefetch``) with the exact ``ShardRead`` the next call will carry;
a ``Prefetcher`` (one per worker process or SPMD rank, held by its host) reads them in order on one
background thread. The forward then takes its tensor here (waiting for a read still under way) instead
of reading. A read that failed raises in that forward, with its own error. At most ``LIMIT`` reads are
held: a prefetch nobody takes is dropped, oldest first.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .sources import ShardRead

LIMIT = 4


def _timed_read(read: ShardRead) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    return read.read(), time.perf_counter() - start


class Prefetcher:
    """The reads one process started ahead, by ``ShardRead``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: "OrderedDict[ShardRead, Future]" = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None

    def start(self, reads: list[ShardRead]) -> None:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bigconv-prefetch")
            for read in reads:
                if read not in self._pending:
                    self._pending[read] = self._pool.submit(_timed_read, read)
            while len(self._pending) > LIMIT:
                self._pending.popitem(last=False)

    def take(self, read: ShardRead, timeout: float) -> tuple[torch.Tensor, float] | None:
        """The prefetched tensor of ``read`` and the seconds its read took, or None if none was started."""
        with self._lock:
            future = self._pending.pop(read, None)
        if future is None:
            return None
        return future.result(timeout=timeout)

    def take_or_read(self, read: ShardRead, timeout: float, stats: dict) -> torch.Tensor:
        """``read``'s tensor: prefetched, or read now. In ``stats``: ``read_s``, the time the caller
        waited; ``prefetch_read_s``, a prefetched read's own duration; ``read_bytes``, what came from
        the files."""
        start = time.perf_counter()
        ahead = self.take(read, timeout)
        if ahead is None:
            tensor = read.read()
        else:
            tensor, took = ahead
            stats["prefetch_read_s"] += took
        stats["read_s"] += time.perf_counter() - start
        stats["read_bytes"] += read.stored_bytes
        return tensor
