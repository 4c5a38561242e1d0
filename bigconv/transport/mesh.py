"""Where one process sits among the shards: its replica and shard position and the groups it talks over.

Ranks are laid out replica-major: rank ``r * S + s`` holds shard ``s`` of replica ``r``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Mesh:
    """This rank's place in a (replicas × spatial) mesh, with the groups it talks over."""

    replicas: int
    spatial: int
    replica: int
    """Which replica (batch slice) this rank works on."""
    shard: int
    """Which spatial shard of that replica's images this rank holds."""
    spatial_ranks: tuple[int, ...]
    spatial_group: object
    replica_group: object
    """The data-parallel group: this shard position in every replica."""
    replica_ranks: tuple[int, ...]
    roll_call: Any = field(default=None, compare=False)
    """A ``transport.roll_call.RollCall`` over the job's store (SPMD), to name the rank a failed
    collective lost; None where the driver names it."""
