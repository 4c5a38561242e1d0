"""``predict``: the driver mode's workers (``predict``) or the SPMD ranks (``predict_spmd``) write a prediction
where they compute it.

Three formats, by the name of ``out``:

- ``NAME.zarr``: one zarr array (N, C, *spatial) of what ``keep`` says, each worker writing its region;
- ``NAME.ome.zarr``: an OME-Zarr pyramid (NGFF 0.5) of one image, every level written by the workers,
  each reducing its own region (``bigconv.data.pyramid``); class maps are label images;
- ``NAME.ome.tif``: the same pyramid as a tiled, pyramidal OME-TIFF (tifffile), written by the driver
  tile by tile from the OME-Zarr the workers wrote (one tile in memory at a time; a TIFF has one writer).

A model returning several outputs (a list, tuple or dict: deep supervision, HoVerNet's heads) writes a
``NAME.zarr`` group holding an array per dense output, named by its place in the structure (``"0"``,
``"np"``); vectors per image are not written (``net.full(x)`` returns them). Both modes: the workers or
the SPMD ranks each write their region of every dense output from one forward.

Whatever the format, nothing the user had is lost (``bigconv.data.outputs``): the output is refused
before any remote work when it is, holds or lies inside an input or exists without bigconv's mark, and
it is written under a temporary sibling moved into place when every worker is done. On SPMD ranks, rank 0
checks ``out`` and makes the store and every rank learns of every failure (``bigconv.runtime.spmd_outputs``).
"""

from __future__ import annotations

import os
from typing import Sequence

from .data import outputs, pyramid
from .data.sources import SourceBatch, is_source_batch
from .geometry.boxes import all_coords, shard_box

OME_ZARR = (".ome.zarr",)
OME_TIFF = (".ome.tif", ".ome.tiff")


def output_format(out: str) -> str:
    name = os.path.basename(os.fspath(out)).lower()
    if name.endswith(OME_ZARR):
        return "ome.zarr"
    if name.endswith(OME_TIFF):
        return "ome.tif"
    return "zarr"


def pixel_size(plan, x, mpp) -> tuple[list[float], bool]:
    """The output's pixel size per spatial axis in micrometres (and True), from ``mpp`` (the input's, a
    number) or the sources' own; else 1 input pixel (and False: no unit)."""
    if mpp is None and is_source_batch(x):
        known = {s.mpp for s in x}
        mpp = known.pop() if len(known) == 1 else None
    if mpp is not None and (isinstance(mpp, bool) or not isinstance(mpp, (int, float)) or not mpp > 0):
        raise ValueError(f"mpp must be a positive number of microns per input pixel, got {mpp!r}")
    stride = [i / o for i, o in zip(plan.in_shape, plan.out_shape)]
    return [float(mpp if mpp is not None else 1.0) * s for s in stride], mpp is not None


def check_options(plan, x, fmt: str, kinds: tuple[str, ...], levels, classes) -> None:
    channels = plan.out_full_shape[1]
    if fmt == "zarr" and len(kinds) > 1:
        raise ValueError(f"keep={kinds!r}: a plain .zarr holds one array; write an .ome.zarr for an image with "
                         "its label image, or predict twice")
    if fmt != "zarr" and plan.out_full_shape[0] != 1:
        raise ValueError(f"an OME-Zarr or OME-TIFF holds one image, but this batch has {plan.out_full_shape[0]}; "
                         "predict one slide per call (for s in slides: net.predict([s], out=...))")
    if fmt == "ome.tif" and (len(kinds) > 1 or len(plan.out_shape) != 2):
        raise ValueError("an OME-TIFF prediction holds one kind of a 2D output; write an .ome.zarr for labels beside "
                         "an image, or for a 3D output")
    if fmt == "ome.tif" and "float16" in kinds:
        raise ValueError("OME-TIFF has no float16 pixel type; keep 'float', 'probabilities' or 'labels' in an "
                         ".ome.tif, or write float16 to an .ome.zarr")
    if fmt == "zarr" and levels not in (None, 1):
        raise ValueError(f"levels={levels!r} needs an .ome.zarr or .ome.tif out=; a plain .zarr holds one level")
    if classes is not None and (not isinstance(classes, (list, tuple)) or len(classes) != channels):
        raise ValueError(f"classes must name each of the output's {channels} channels, got {classes!r}")
    if "labels" in kinds and channels < 2:
        raise ValueError("keep='labels' takes the argmax over the channels, but this output has one channel; "
                         "keep 'probabilities' (a sigmoid) instead")


def output_names(plan) -> list[str]:
    """A name for each output tensor of a model with several (``plan.spec``): list and tuple items by their
    index, dict entries by their key, nested ones joined by dots (``"0"``, ``"aux"``, ``"heads.1"``)."""
    import torch.utils._pytree as pytree

    paths, _ = pytree.tree_flatten_with_path(pytree.tree_unflatten(list(range(len(plan.outputs))), plan.spec))
    return [".".join(str(getattr(k, "idx", getattr(k, "key", k))) for k in path) for path, _ in paths]


def _check_several(plan, fmt: str, kinds: tuple[str, ...], levels, classes) -> list[str | None]:
    """Several outputs go to one zarr group, an array per dense output named by ``output_names``; each
    output's name, or None for a vector (not written). Refused before remote work where that cannot be."""
    if fmt != "zarr":
        raise ValueError(f"this model returns {len(plan.outputs)} outputs; predict writes them to one .zarr group "
                         "(an array per dense output), not to an OME-Zarr or OME-TIFF image: give out= a .zarr name, "
                         "or predict with a wrapper returning the one map to write")
    if len(kinds) > 1 or levels not in (None, 1) or classes is not None:
        raise ValueError("several outputs are written as one kind each (keep= one of float, float16, probabilities, "
                         "labels), one level, no class names")
    names = [name if shape is not None else None for name, (shape, _) in zip(output_names(plan), plan.outputs)]
    if not any(names):
        raise ValueError(f"predict writes dense maps, but none of this model's {len(names)} outputs is one (vectors "
                         "per image); use net.full(x) for them")
    if kinds[0] == "labels":
        thin = [n for n, (shape, full) in zip(names, plan.outputs) if n is not None and full[1] < 2]
        if thin:
            raise ValueError(f"keep='labels' takes the argmax over the channels, but output(s) {thin} have one "
                             "channel; keep 'probabilities' (a sigmoid) or 'float' instead")
    return names


def _several_chunks(plan, names: list, max_chunk: int) -> list:
    """Each written output's chunks (never crossing shards; refused where they cannot be), None where not
    written."""
    return [None if n is None else outputs.aligned_chunks(shape, plan.grid, max_chunk)
            for n, (shape, _) in zip(names, plan.outputs)]


def _create_several(tmp: str, plan, names: list, chunks: list, kind: str, dtype: str) -> list:
    """The arrays of several outputs in the zarr group ``tmp``: for each output ``(its array's path, its
    spatial shape)``, or None for one not written."""
    import zarr

    group = zarr.open_group(tmp, mode="r+")
    arrays = []
    for name, (shape, full), chunk in zip(names, plan.outputs, chunks):
        if name is None:
            arrays.append(None)
            continue
        channels = pyramid.kept_channels(kind, full[1])
        group.create_array(name, shape=(full[0], channels, *shape), chunks=(1, channels, *chunk),
                           dtype=pyramid.kept_dtype(kind, dtype, full[1]))
        arrays.append((os.path.join(tmp, name), shape))
    return arrays


def _predict_several(net, x, out, plan, overwrite: bool, max_chunk: int, kind: str, names: list) -> str:
    """``predict`` of a model with several outputs: a zarr group at ``out`` holding an array per dense output
    (``names``), each worker writing its region of every one in the same forward."""
    path = outputs.check_out(out, [s.path for s in x] if is_source_batch(x) else [], overwrite)
    dtype = _input_dtype(x)
    chunks = _several_chunks(plan, names, max_chunk)  # refused here, before remote work, where they cannot be
    shards = net._shard_calls(plan, x)
    coords = list(all_coords(plan.grid))
    net.world.check_usable()
    tmp = outputs.begin_group(path)
    try:
        arrays = _create_several(tmp, plan, names, chunks, kind, dtype)
        work = [(s, [None if a is None else (a[0], shard_box(a[1], plan.grid, c)) for a in arrays], kind)
                for s, c in zip(shards, coords)]
        net._wait(net._launch("predict_several", work), f"prediction {shards[0].call} (predict_several)")
    except BaseException:
        if not net.world.broken:
            outputs.abandon(tmp)
        raise
    return outputs.finish(tmp, path)


def _input_dtype(x) -> str:
    return str(SourceBatch(x).dtype if is_source_batch(x) else x.dtype).replace("torch.", "")


def _predict_several_spmd(net, x, out, plan, overwrite: bool, max_chunk: int, kind: str, names: list) -> str:
    """``predict_spmd`` of a model with several outputs: rank 0 makes the zarr group at ``out`` (an array per
    dense output, ``names``), every rank writes its region of every one from one forward."""
    from .engine import step as shard_step
    from .engine.plan import output_leaves
    from .geometry.boxes import box_index, coord_of
    from .runtime import spmd_outputs

    dtype = _input_dtype(x)
    chunks = _several_chunks(plan, names, max_chunk)  # refused on every rank alike, before the store is made

    def make() -> tuple[str, tuple]:  # on rank 0 only; every rank gets its answer
        path = outputs.check_out(out, [s.path for s in x] if is_source_batch(x) else [], overwrite)
        tmp = outputs.begin_group(path)
        try:
            return path, (tmp, _create_several(tmp, plan, names, chunks, kind, dtype))
        except BaseException:
            outputs.abandon(tmp)
            raise

    path, (tmp, arrays) = spmd_outputs.made_by_rank_zero(net.world, net.engine, make, "predict")
    coord = coord_of(net.mesh.shard, plan.grid)

    def write() -> None:
        leaves = output_leaves(shard_step.forward(net.engine, net._shard_call(plan, x), False))
        for t, array in zip(leaves, arrays):
            if array is not None:  # this rank's box of the output's own grid, of its replica's images
                array_path, shape = array
                outputs.write(array_path, box_index(shard_box(shape, plan.grid, coord), t.dim(), net._items(x)),
                              pyramid.convert(kind, t, t.shape[1]))

    spmd_outputs.together(net.world, net.engine, write, "predict (several outputs)", tmp, f"; {out!r} is as it was")
    if net.world.rank == 0:
        outputs.finish(tmp, path)
    net.world.barrier()
    return path


def _prepared(net, x, out, keep, levels, mpp, classes, max_chunk) -> tuple:
    """What both front ends check and plan before any remote work: the kept kinds, the plan, the chunks
    and dtype, the format, the pixel size, the output's channels and (OME) the pyramid's spec."""
    kinds = pyramid.check_keep(keep)
    plan = net.plan(x)
    chunks, dtype = net.planner.prediction(plan, x, max_chunk)
    fmt = output_format(out)
    check_options(plan, x, fmt, kinds, levels, classes)
    pixel, unit = pixel_size(plan, x, mpp)
    channels = plan.out_full_shape[1]
    spec = None if fmt == "zarr" else pyramid.spec_for(kinds, channels, dtype, plan.out_shape, plan.grid, levels,
                                                        max_chunk, ome=True)
    return kinds, plan, chunks, dtype, fmt, pixel, unit, channels, spec


def predict(net, x, out, *, overwrite: bool = False, max_chunk: int = 1024, keep="float", levels: int | None = None,
            mpp: float | None = None, classes: Sequence[str] | None = None) -> str:
    """``ParallelModel.predict`` (see its doc)."""
    plan = net.plan(x)
    if plan.several:
        kinds = pyramid.check_keep(keep)
        names = _check_several(plan, output_format(out), kinds, levels, classes)
        return _predict_several(net, x, out, plan, overwrite, max_chunk, kinds[0], names)
    kinds, plan, chunks, dtype, fmt, pixel, unit, channels, spec = _prepared(net, x, out, keep, levels, mpp,
                                                                             classes, max_chunk)
    path = outputs.check_out(out, [s.path for s in x] if is_source_batch(x) else [], overwrite)
    shards = net._shard_calls(plan, x)
    coords = list(all_coords(plan.grid))
    net.world.check_usable()
    if fmt == "zarr":
        kind = kinds[0]
        shape = (plan.out_full_shape[0], pyramid.kept_channels(kind, channels), *plan.out_shape)
        tmp = outputs.begin(path, shape, chunks, pyramid.kept_dtype(kind, dtype, channels))
        boxes = [shard_box(plan.out_shape, plan.grid, c) for c in coords]
        work = [("predict", [(s, tmp, box, kind) for s, box in zip(shards, boxes)])]
    else:
        tmp = outputs.begin_group(path if fmt == "ome.zarr" else path + ".zarr")
        pyramid.create(tmp, spec, pixel, unit, classes, os.path.basename(path))
        work = [("predict_pyramid", [(s, tmp, spec, c) for s, c in zip(shards, coords)])]
        work += [("pyramid_level", [(k,)] * len(shards)) for k in range(1, spec.levels)]
    try:
        for method, args in work:
            net._wait(net._launch(method, args), f"prediction {shards[0].call} ({method})")
        if fmt == "ome.tif":
            tif = outputs.temporary(path)
            try:
                pyramid.write_ome_tiff(tmp, tif, spec, pixel, unit)
            except BaseException:
                outputs.abandon(tif)
                raise
            outputs.abandon(tmp)
            tmp = tif
    except BaseException:
        if not net.world.broken:  # a broken World's workers may still be writing: leave it, named
            outputs.abandon(tmp)
        raise
    return outputs.finish(tmp, path)


def predict_spmd(net, x, out, *, overwrite: bool = False, max_chunk: int = 1024, keep="float",
                 levels: int | None = None, mpp: float | None = None, classes: Sequence[str] | None = None) -> str:
    """``SpmdModel.predict`` for what the driver mode's ``predict`` writes beyond a plain float array:
    every rank calls it; rank 0 checks ``out`` and makes the store, every rank writes its region of each
    level (a collective after each, so a level is complete before the next reads it, and every rank
    learns of a failure), rank 0 moves the result into place (and writes an OME-TIFF)."""
    from .geometry.boxes import box_index, coord_of
    from .runtime import spmd_outputs

    plan = net.plan(x)
    if plan.several:  # the driver mode's checks, on every rank alike
        kinds = pyramid.check_keep(keep)
        names = _check_several(plan, output_format(out), kinds, levels, classes)
        return _predict_several_spmd(net, x, out, plan, overwrite, max_chunk, kinds[0], names)
    kinds, plan, chunks, dtype, fmt, pixel, unit, channels, spec = _prepared(net, x, out, keep, levels, mpp,
                                                                             classes, max_chunk)

    def make() -> tuple[str, str]:  # on rank 0 only; every rank gets its answer
        path = outputs.check_out(out, [s.path for s in x] if is_source_batch(x) else [], overwrite)
        if fmt == "zarr":
            shape = (plan.out_full_shape[0], pyramid.kept_channels(kinds[0], channels), *plan.out_shape)
            return path, outputs.begin(path, shape, chunks, pyramid.kept_dtype(kinds[0], dtype, channels))
        tmp = outputs.begin_group(path if fmt == "ome.zarr" else path + ".zarr")
        pyramid.create(tmp, spec, pixel, unit, classes, os.path.basename(path))
        return path, tmp

    path, tmp = spmd_outputs.made_by_rank_zero(net.world, net.engine, make, "predict")
    coord = coord_of(net.mesh.shard, plan.grid)

    def together(work, what: str) -> None:
        spmd_outputs.together(net.world, net.engine, work, f"predict ({what})", tmp, f"; {out!r} is as it was")

    writer = pyramid.LevelWriter(spec, tmp, coord) if spec is not None else None

    def first() -> None:
        from .engine import step as shard_step

        result = shard_step.forward(net.engine, net._shard_call(plan, x), False)
        if writer is not None:
            writer.first(result)
        else:
            box = shard_box(plan.out_shape, plan.grid, coord)
            outputs.write(tmp, box_index(box, result.dim(), net._items(x)),
                          pyramid.convert(kinds[0], result, channels))

    together(first, "level 0")
    for k in range(1, spec.levels if spec is not None else 1):
        together(lambda k=k: writer.next(k), f"level {k}")
    if net.world.rank == 0:
        final = tmp
        if fmt == "ome.tif":
            final = outputs.temporary(path)
            try:
                pyramid.write_ome_tiff(tmp, final, spec, pixel, unit)
            except BaseException:
                outputs.abandon(final)
                outputs.abandon(tmp)
                raise
            outputs.abandon(tmp)
        outputs.finish(final, path)
    net.world.barrier()
    return path
