"""Bounded waits on RPC futures sent to any subset of a World's workers.

``bigconv.World.wait`` expects one future per worker in worker order; a DSN step talks to a few
workers at a time (and to some twice), so this is the same policy for named futures: a dead worker
or a remote error is reported at once by name, and nothing waits longer than the World's timeout.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch.distributed.rpc as rpc

from bigconv import WorkerFailure, World
from bigconv.transport import worker_name
from bigconv.world import remote_summary


def launch(world: World, worker: int, fn: Callable, *args) -> tuple[str, Any]:
    world.check_usable()
    name = worker_name(worker)
    return name, rpc.rpc_async(name, fn, args=args, timeout=world.rpc_timeout)


def wait_named(world: World, futures: Sequence[tuple[str, Any]], what: str) -> list[Any]:
    """The results of ``(worker name, future)`` pairs, in order; a WorkerFailure naming the culprit otherwise."""
    deadline = time.monotonic() + 1.1 * world.timeout + 1.0
    pause = 0.0005
    while True:
        dead = world.dead_workers()
        if dead:
            world.broken = f"{dead[0]} died during {what}"
            raise WorkerFailure(world.broken)
        for name, fut in futures:
            if fut.done():
                try:
                    fut.wait()
                except Exception as exc:
                    _raise_failure(world, futures, name, exc, what)
        if all(f.done() for _, f in futures):
            return [f.wait() for _, f in futures]
        if time.monotonic() > deadline:
            late = sorted({n for n, f in futures if not f.done()})
            world.broken = f"{', '.join(late)} did not finish {what} within {world.timeout:g}s"
            raise WorkerFailure(world.broken)
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


def _raise_failure(world: World, futures, name: str, exc: Exception, what: str) -> None:
    dead = world._dead_soon()
    if dead:  # a broken pipe is usually a dead process; say which
        world.broken = f"{dead[0]} died during {what}"
        raise WorkerFailure(world.broken) from exc
    message = f"{name} failed during {what}: {remote_summary(exc)}"
    if isinstance(exc, WorkerFailure) or "timed out" in str(exc) or "timeout" in str(exc):
        world.broken = message
    raise WorkerFailure(message) from exc
