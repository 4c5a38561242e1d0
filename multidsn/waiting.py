"""Launching RPC calls on any subset of a World's workers; waiting is ``World.wait_named``.

A DSN step talks to a few workers at a time (and to some twice), so its futures are named pairs
rather than one per worker in worker order.
"""

from __future__ import annotations

from typing import Any, Sequence


from bigconv import World


def launch(world: World, worker: int, part_id: int, method: str, *args) -> tuple[str, Any]:
    """Start ``method(*args)`` of DSN part ``part_id`` on ``worker``."""
    return world.launch_part(worker, part_id, method, *args)


def wait_named(world: World, futures: Sequence[tuple[str, Any]], what: str) -> list[Any]:
    return world.wait_named(futures, what)
