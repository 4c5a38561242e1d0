"""Launching RPC calls on any subset of a World's workers; waiting is ``World.wait_named``.

A DSN step talks to a few workers at a time (and to some twice), so its futures are named pairs
rather than one per worker in worker order.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch.distributed.rpc as rpc

from bigconv import World
from bigconv.transport import worker_name


def launch(world: World, worker: int, fn: Callable, *args) -> tuple[str, Any]:
    world.check_usable()
    name = worker_name(worker)
    return name, rpc.rpc_async(name, fn, args=args, timeout=world.rpc_timeout)


def wait_named(world: World, futures: Sequence[tuple[str, Any]], what: str) -> list[Any]:
    return world.wait_named(futures, what)
