"""Dense outputs written where they are computed: one zarr array, each worker writing its own region.

Chunks are chosen so that no chunk crosses a shard boundary: two workers never write one chunk (zarr
writes whole chunks, so a shared chunk would lose one worker's part). Along each spatial axis the
chunk edge divides every boundary between shards; balanced shards of an edge that the grid divides
give chunks of up to ``max_chunk``.
"""

from __future__ import annotations

import math
import os
import shutil
from typing import Sequence

from ..geometry.boxes import all_coords, shard_box

MIN_CHUNK = 16


def aligned_chunks(spatial: Sequence[int], grid: Sequence[int], max_chunk: int = 1024) -> tuple[int, ...]:
    """Per spatial axis, the largest chunk edge <= ``max_chunk`` that divides every shard boundary."""
    out = []
    for axis, (n, g) in enumerate(zip(spatial, grid)):
        starts = {shard_box(tuple(spatial), tuple(grid), c)[axis][0] for c in all_coords(tuple(grid))} - {0}
        if not starts:  # one shard along this axis: any edge (the last chunk may be partial)
            out.append(min(n, max_chunk))
            continue
        common = math.gcd(*starts)
        edge = max(d for d in range(1, min(common, max_chunk) + 1) if common % d == 0)
        if edge < min(MIN_CHUNK, n):
            raise ValueError(
                f"the output's shards along spatial axis {axis} start at {sorted(starts)}, which share no chunk "
                f"edge of at least {MIN_CHUNK}: zarr chunks would straddle two workers. Use a grid that divides "
                f"the output's size {n} (or a size that {g} divides)"
            )
        out.append(edge)
    return tuple(out)


def create(path: str, shape: Sequence[int], spatial_chunks: Sequence[int], dtype: str, overwrite: bool) -> str:
    """An empty zarr array for the output (batch and channel chunks of 1 and all)."""
    import zarr

    path = os.fspath(path)
    if os.path.exists(path):
        if not overwrite:
            raise ValueError(f"{path!r} exists; choose another out= or pass overwrite=True")
        shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
    zarr.create_array(path, shape=tuple(shape), chunks=(1, shape[1], *spatial_chunks), dtype=dtype)
    return path


def write(path: str, index: tuple, values) -> None:
    """Write one worker's region (its chunks are its own)."""
    import zarr

    zarr.open_array(path, mode="r+")[index] = values
