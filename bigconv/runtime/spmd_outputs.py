"""A store every SPMD rank writes a part of (``predict``, ``gradcam`` and ``capture`` with ``out=``): rank 0
makes it, and every rank learns of every rank's failure before the next step.

``done_by_rank_zero`` is the same for work rank 0 alone does (``net.save``'s write): every rank learns its outcome.

Rank 0 alone checks ``out`` and makes the store (two ranks creating one zarr group would race), then
broadcasts what it made or why it refused, so that every rank returns or raises the same. After each
stage every rank writes (level 0, then each pyramid level from the one above), one ``all_gather`` of
each rank's failure (or None) tells every rank whether all succeeded: a level is complete before the
next reads it, no rank waits at a later collective for one that failed, every rank raises naming the
first rank that failed, and rank 0 removes the partial store. A rank gone during one of these collectives
is named by the engine's roll call (``ShardEngine.naming_lost_ranks``), as in the step's own collectives.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist

from ..data import outputs
from ..transport import WorkerFailure


def made_by_rank_zero(world, engine, make: Callable[[], Any], what: str) -> Any:
    """``make()`` on rank 0 (check ``out``, create the store), its result on every rank; a ValueError or
    OSError there is raised on every rank as ``ValueError("{what} refused on rank 0: ...")``. ``engine``: this
    rank's ``ShardEngine``, which names a rank lost in the broadcast."""
    made = refused = None
    if world.rank == 0:
        try:
            made = make()
        except (ValueError, OSError) as exc:
            refused = f"{type(exc).__name__}: {exc}"
    shared = [(made, refused)]
    with engine.naming_lost_ranks(f"{what}: rank 0's store"):
        dist.broadcast_object_list(shared, src=0)
    made, refused = shared[0]
    if refused:
        raise ValueError(f"{what} refused on rank 0: {refused}")
    return made


def done_by_rank_zero(world, engine, work: Callable[[], Any], what: str) -> Any:
    """``work()`` on rank 0 alone (``net.save``'s write), its result on every rank once it is done; if it
    raised there, every rank raises ``WorkerFailure("{what} failed on rank 0: ...")`` with rank 0's error,
    promptly (rank 0's own from it), instead of leaving the others at a later collective until its timeout."""
    result = failure = error = None
    if world.rank == 0:
        try:
            result = work()
        except Exception as exc:  # noqa: BLE001 - whatever it was, every rank must hear of it
            failure, error = f"{type(exc).__name__}: {exc}", exc
    shared = [(result, failure)]
    with engine.naming_lost_ranks(f"{what}: rank 0's outcome"):
        dist.broadcast_object_list(shared, src=0)
    result, failure = shared[0]
    if failure:
        raise WorkerFailure(f"{what} failed on rank 0: {failure}") from error
    return result


def agree(world, engine, failure: str | None, what: str, tmp: str | None, after: str = "") -> None:
    """Every rank learns whether any failed (one collective: ``failure`` is this rank's, or None), and raises
    ``WorkerFailure("{what} failed on rank R: ...{after}")`` naming the first that did; rank 0 removes the
    partial store ``tmp``."""
    failures = [None] * world.size
    with engine.naming_lost_ranks(f"{what}: agreeing on the ranks' writes"):
        dist.all_gather_object(failures, failure)
    bad = [(r, f) for r, f in enumerate(failures) if f]
    if bad:
        if world.rank == 0 and tmp is not None:
            outputs.abandon(tmp)
        raise WorkerFailure(f"{what} failed on rank {bad[0][0]}: {bad[0][1]}{after}")


def together(world, engine, work: Callable[[], None], what: str, tmp: str | None, after: str = "") -> None:
    """``work()`` on every rank, then ``agree`` on whether it failed anywhere."""
    failure = None
    try:
        work()
    except Exception as exc:
        failure = f"{type(exc).__name__}: {exc}"
    agree(world, engine, failure, what, tmp, after)
