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

One run at a time per destination (issue 52). ``check_out`` claims ``out`` before it looks at it: it creates
``.NAME.bigconv-claim`` beside it exclusively (``O_EXCL``: of two runs, one wins), holding this process's host,
pid and a token. A second run to the same ``out`` is refused while the claim stands, naming the holder and the
claim file; so a run with ``overwrite=False`` that found no ``out`` can never have it replaced by another run
(``finish`` refuses an ``out`` that appeared meanwhile unless the claim says ``overwrite``). The claim goes
when the run ends: ``finish`` removes it, and the front ends' ``releasing_claims`` removes it whatever the
run's outcome. A claim a killed run left is taken over when its process on this host is gone; one of another
host (or an unreadable one) is only named: delete it once that run is known to be gone.
"""

from __future__ import annotations

import functools
import glob
import json
import math
import os
import shutil
import socket
import threading
import time
import uuid
import warnings
from typing import Callable, Sequence

from ..geometry.boxes import all_coords, shard_box
from ..saving import process_alive

MIN_CHUNK = 16
MARK_KEY = "bigconv"
MARK = {"kind": "prediction", "format": 1}
PARTIAL = ".bigconv-partial-"
CLAIM = ".bigconv-claim"


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
    wrote it, and while another run holds ``out``'s claim. Claims ``out`` for this run (``claim``) before it
    looks whether ``out`` exists. Reads no pixels and sends nothing: every check runs before remote work.

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
    claim(out, overwrite)
    try:
        if os.path.lexists(out):
            if not overwrite:
                raise ValueError(f"{out!r} exists; choose another out= or pass overwrite=True")
            if not is_ours(out):
                raise ValueError(f"{out!r} exists and was not written by bigconv (no {MARK_KEY!r} mark in zarr "
                                 "attributes); overwrite=True replaces only bigconv's own outputs. Choose another "
                                 "out= or move it away yourself")
    except BaseException:
        release(out)
        raise
    return out


_claims: dict[str, tuple[str, bool, int]] = {}
"""This process's claims: ``out`` -> (token, overwrite, the thread that took it)."""


def claim_path(out: str) -> str:
    folder, name = os.path.split(out)
    return os.path.join(folder, f".{name}{CLAIM}")


def claim(out: str, overwrite: bool) -> None:
    """Claim ``out`` (absolute) for this run: create its claim file exclusively, or refuse naming the run that
    holds it. A claim of this host whose process is gone (or of this process but no run of it) is stale and
    taken over."""
    path = claim_path(out)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    token = uuid.uuid4().hex
    record = {"host": socket.gethostname(), "pid": os.getpid(), "token": token,
              "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    for _ in range(3):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            holder = _holder(path)
            if holder is None or not _stale(holder) or not _remove_stale(path, holder):
                raise ValueError(_claimed_message(out, path, holder)) from None
            continue
        with os.fdopen(fd, "w") as fh:
            json.dump(record, fh)
        _claims[out] = (token, overwrite, threading.get_ident())
        return
    raise ValueError(_claimed_message(out, path, _holder(path)))


def _holder(path: str) -> dict | None:
    """The claim file's record; None when it is unreadable (being written this instant, or not ours)."""
    try:
        with open(path) as fh:
            holder = json.load(fh)
        return holder if isinstance(holder, dict) and isinstance(holder.get("pid"), int) else None
    except (OSError, ValueError):
        return None


def _stale(holder: dict) -> bool:
    if holder.get("host") != socket.gethostname():
        return False  # another host's process: cannot tell from here
    if holder["pid"] == os.getpid():
        return all(token != holder.get("token") for token, _, _ in _claims.values())
    return not process_alive(holder["pid"])


def _remove_stale(path: str, holder: dict) -> bool:
    """Remove the stale claim ``holder`` at ``path``; False if another run replaced it meanwhile (put back)."""
    aside = f"{path}.stale-{uuid.uuid4().hex[:12]}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:  # another run removed it first
        return True
    if _holder(aside) == holder:
        os.unlink(aside)
        return True
    try:  # a fresh claim, taken since we read the stale one: give it back
        os.link(aside, path)
    except OSError:
        pass
    os.unlink(aside)
    return False


def _claimed_message(out: str, path: str, holder: dict | None) -> str:
    who = (f"pid {holder['pid']} on {holder.get('host')} since {holder.get('since')}" if holder
           else "a run whose claim cannot be read")
    return (f"{out!r} is being written by another prediction ({who}; claim {path!r}); wait for it to finish or "
            f"choose another out=. If that run is gone (a crash on another host), delete {path!r}")


def release(out: str) -> None:
    """Drop this process's claim on ``out`` (its file, if it still holds this run's token)."""
    held = _claims.pop(out, None)
    if held is None:
        return
    path = claim_path(out)
    holder = _holder(path)
    if holder is not None and holder.get("token") == held[0]:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def releasing_claims(fn: Callable) -> Callable:
    """``fn`` (a front end's ``predict``, ``capture``...) releasing, however it ends, every claim it took."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        before = set(_claims)
        try:
            return fn(*args, **kwargs)
        finally:
            me = threading.get_ident()
            for out in [o for o, (_, _, thread) in list(_claims.items()) if thread == me and o not in before]:
                release(out)

    return wrapper


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
    """Move the complete array ``tmp`` to ``out``, replacing an older output of ours there only when this
    run's claim says ``overwrite`` (a run without one: as before claims, an output of ours); then release
    the claim."""
    try:
        if os.path.lexists(out):
            if not is_ours(out):  # it appeared while the workers ran
                raise ValueError(f"{out!r} appeared during the prediction and was not written by bigconv; the "
                                 f"prediction is kept at {tmp!r}")
            if not _claims.get(out, ("", True, 0))[1]:
                raise ValueError(f"{out!r} appeared during the prediction (written by a run that took no claim, "
                                 f"such as an older bigconv's) and overwrite=False keeps it; the prediction is kept "
                                 f"at {tmp!r}")
            old = tmp + "-old"
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old) if os.path.isdir(old) else os.unlink(old)
        else:
            os.rename(tmp, out)
    finally:
        release(out)
    return out


def shown(path: str) -> str:
    """The output a staging path stands for, as the user named it: ``/d/.pred.zarr.bigconv-partial-TOKEN/np``
    is ``/d/pred.zarr/np`` (an OME-TIFF's staging levels: the ``.ome.tif``)."""
    parts = path.split(os.sep)
    for i, part in enumerate(parts):
        if part.startswith(".") and PARTIAL in part:
            name = part[1:part.index(PARTIAL)]
            parts[i] = name[:-len(".zarr")] if name.lower().endswith((".tif.zarr", ".tiff.zarr")) else name
    return os.sep.join(parts)


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
