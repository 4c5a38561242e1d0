"""Dense outputs written where they are computed: one zarr array, each worker writing its own region.

Chunks are chosen so that no chunk crosses a shard boundary: two workers never write one chunk (zarr
writes whole chunks, so a shared chunk would lose one worker's part). Along each spatial axis the
chunk edge divides every boundary between shards; balanced shards of an edge that the grid divides
give chunks of up to ``max_chunk``.

Nothing the user had is ever lost (issue 34). Every array written here carries ``MARK`` in its zarr
attributes; ``overwrite=True`` replaces only such an array, never a user's folder or array, and an
``out=`` that is, holds or lies inside an input is refused; an ``out=`` that is a symbolic link is written at
its target (the link stays). The workers write into a temporary
sibling (``.NAME.bigconv-partial-TOKEN``) that ``finish`` moves into place once every worker is done,
so a failed run leaves the old output (or nothing) under the final name, never a half-written array.
"""

from __future__ import annotations

import glob
import math
import os
import shutil
import uuid
import warnings
from typing import Sequence

from ..geometry.boxes import all_coords, shard_box

MIN_CHUNK = 16
MARK_KEY = "bigconv"
MARK = {"kind": "prediction", "format": 1}
PARTIAL = ".bigconv-partial-"


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


def is_ours(path: str) -> bool:
    """Whether ``path`` is a zarr array or group (an OME-Zarr) that bigconv wrote (its attributes carry
    ``MARK``), or an OME-TIFF that bigconv wrote (its Software tag is ``TIFF_SOFTWARE``)."""
    if os.path.isfile(path) and path.lower().endswith((".tif", ".tiff")):
        return _tiff_is_ours(path)
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "zarr.json")):
        return False
    import zarr

    try:
        attrs = dict(zarr.open(path, mode="r").attrs)
    except Exception:  # not zarr, or not readable: not ours either way
        return False
    return isinstance(attrs.get(MARK_KEY), dict) and attrs[MARK_KEY].get("kind") == MARK["kind"]


TIFF_SOFTWARE = "bigconv prediction"


def _tiff_is_ours(path: str) -> bool:
    try:
        import tifffile

        with tifffile.TiffFile(path) as tif:
            tag = tif.pages[0].tags.get("Software")
            return tag is not None and tag.value == TIFF_SOFTWARE
    except Exception:
        return False


def check_out(out, inputs: Sequence[str], overwrite: bool) -> str:
    """The absolute ``out`` after refusing what would lose data: an ``out`` that is, holds or lies inside
    one of ``inputs`` (paths of the sources read), and an existing ``out`` unless ``overwrite`` and bigconv
    wrote it. Reads no pixels and sends nothing: every check runs before remote work.

    An ``out`` that is a symbolic link stands for its target: the answer is the target's path, so the
    prediction replaces the target (``overwrite=True``) and the link stays as it was, pointing at it."""
    out = os.path.abspath(os.fspath(out))
    if os.path.islink(out):  # rename() would replace the link itself by a folder
        out = os.path.realpath(out)
    real = os.path.realpath(out)
    for src in dict.fromkeys(os.path.realpath(p) for p in inputs):
        if real == src:
            raise ValueError(f"out={out!r} is one of the inputs of this prediction; predict would replace the image "
                             "it reads. Choose another out=")
        if os.path.commonpath([real, src]) == src:
            raise ValueError(f"out={out!r} lies inside the input {src!r}; write the prediction outside it")
        if os.path.commonpath([real, src]) == real:
            raise ValueError(f"out={out!r} holds the input {src!r}; write the prediction to a path of its own")
    if os.path.lexists(out):
        if not overwrite:
            raise ValueError(f"{out!r} exists; choose another out= or pass overwrite=True")
        if not is_ours(out):
            raise ValueError(f"{out!r} exists and was not written by bigconv (no {MARK_KEY!r} mark in zarr "
                             "attributes); overwrite=True replaces only bigconv's own outputs. Choose another out= "
                             "or move it away yourself")
    return out


def stale_partials(out: str) -> list[str]:
    """Temporary siblings of ``out`` that an interrupted prediction left: its own, and for an OME-TIFF the
    staging OME-Zarr its levels are written to first (a temporary sibling of ``out + ".zarr"``)."""
    folder, name = os.path.split(out)
    found = []
    for staged in (name, name + ".zarr") if name.lower().endswith((".tif", ".tiff")) else (name,):
        found += glob.glob(os.path.join(glob.escape(folder), f".{glob.escape(staged)}{PARTIAL}*"))
    return sorted(found)


def begin(out: str, shape: Sequence[int], spatial_chunks: Sequence[int], dtype: str) -> str:
    """An empty marked zarr array (batch and channel chunks of 1 and all) under a fresh temporary
    sibling of ``out`` (checked by ``check_out``); the workers write into it."""
    import zarr

    tmp = temporary(out)
    array = zarr.create_array(tmp, shape=tuple(shape), chunks=(1, shape[1], *spatial_chunks), dtype=dtype)
    array.attrs[MARK_KEY] = MARK
    return tmp


def begin_group(out: str) -> str:
    """An empty marked zarr group under a fresh temporary sibling of ``out`` (an OME-Zarr is filled in by
    ``bigconv.data.pyramid.create``)."""
    import zarr

    tmp = temporary(out)
    zarr.open_group(tmp, mode="w-").attrs[MARK_KEY] = MARK
    return tmp


def temporary(out: str, staging: str | None = None) -> str:
    """A fresh temporary sibling of ``out``; ``staging``: this prediction's own OME-Zarr staging an OME-TIFF,
    not named as an interrupted run's."""
    stale = [p for p in stale_partials(out) if staging is None or os.path.abspath(p) != os.path.abspath(staging)]
    if stale:  # another run may still be writing one: name them, never delete what may be in use
        warnings.warn(f"temporary outputs of earlier, interrupted predictions lie beside {out!r}: "
                      f"{', '.join(stale)}; delete them once no prediction runs", stacklevel=4)
    folder, name = os.path.split(out)
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, f".{name}{PARTIAL}{uuid.uuid4().hex[:12]}")


def finish(tmp: str, out: str) -> str:
    """Move the complete array ``tmp`` to ``out``, replacing an older output of ours there."""
    if os.path.lexists(out):
        if not is_ours(out):  # it appeared while the workers ran
            raise ValueError(f"{out!r} appeared during the prediction and was not written by bigconv; the prediction "
                             f"is kept at {tmp!r}")
        old = tmp + "-old"
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old) if os.path.isdir(old) else os.unlink(old)
    else:
        os.rename(tmp, out)
    return out


def abandon(tmp: str) -> None:
    """Remove the partial array of a failed prediction (bigconv wrote it, under a name of its own)."""
    if PARTIAL in os.path.basename(tmp) and os.path.isdir(tmp):
        shutil.rmtree(tmp, ignore_errors=True)
    elif PARTIAL in os.path.basename(tmp) and os.path.isfile(tmp):
        os.unlink(tmp)


def write(path: str, index: tuple, values) -> None:
    """Write one worker's region (its chunks are its own)."""
    import zarr

    zarr.open_array(path, mode="r+")[index] = values
