"""``predict``: the driver mode's workers (``predict``) or the SPMD ranks (``predict_spmd``) write a prediction
where they compute it.

Three formats, by the name of ``out``:

- ``NAME.zarr``: one zarr array (N, C, *spatial) of what ``keep`` says, each worker writing its region;
- ``NAME.ome.zarr``: an OME-Zarr pyramid (NGFF 0.5) of one image, every level written by the workers,
  each reducing its own region (``bigconv.data.pyramid``); class maps are label images;
- ``NAME.ome.tif``: the same pyramid as a tiled, pyramidal OME-TIFF (tifffile), written by the driver
  tile by tile from the OME-Zarr the workers wrote (one tile in memory at a time; a TIFF has one writer).

A model returning several outputs (a list, tuple or dict: deep supervision, HoVerNet's heads) writes
each dense output under its name, its place in the structure (``"0"``, ``"np"``; ``output_names``);
vectors per image are not written (``net.full(x)`` returns them):

- ``NAME.zarr``: a zarr group holding an array per dense output;
- ``NAME.ome.zarr``: one NGFF container holding an OME-Zarr image per dense output, each its own pyramid
  (NGFF 0.5's ``bioformats2raw.layout``: images ``0``, ``1``, ... listed by the ``OME`` group's ``series``;
  why that convention: ``bigconv.data.pyramid``'s doc). Each image has its own levels, its own pixel size
  (the input's times that output's own stride: a deep-supervision map at half resolution has twice the
  pixel), its own kept kinds and class names where ``keep=``, ``levels=`` and ``classes=`` are dicts by
  output name (one value applies to every output);
- ``NAME.ome.tif``: the same images as the series of one pyramidal OME-TIFF (one kind of a 2D output
  each, no float16), copied by the driver (rank 0) from the OME-Zarr container the workers wrote.

Both modes: the workers or the SPMD ranks each write their region of every dense output from one
forward, then each further level of every image from their own regions.

Whatever the format, nothing the user had is lost (``bigconv.data.outputs``): the output is refused
before any remote work when it is, holds or lies inside an input or exists without bigconv's mark, and
it is written under a temporary sibling moved into place when every worker is done. On SPMD ranks, rank 0
checks ``out`` and makes the store and every rank learns of every failure (``bigconv.runtime.spmd_outputs``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
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


def pixel_size(plan, x, mpp, out_shape=None) -> tuple[list[float], bool]:
    """The output's pixel size per spatial axis in micrometres (and True), from ``mpp`` (the input's, a
    number) or the sources' own; else 1 input pixel (and False: no unit). ``out_shape``: one output's spatial
    shape among several (its stride against the input scales its pixel), else the plan's one output's."""
    if mpp is None and is_source_batch(x):
        known = {s.mpp for s in x}
        mpp = known.pop() if len(known) == 1 else None
    if mpp is not None and (isinstance(mpp, bool) or not isinstance(mpp, (int, float)) or not mpp > 0):
        raise ValueError(f"mpp must be a positive number of microns per input pixel, got {mpp!r}")
    stride = [i / o for i, o in zip(plan.in_shape, plan.out_shape if out_shape is None else out_shape)]
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


def _by_output(value, what: str, names: list, default=None) -> list:
    """``value`` for each output: one value for every written output, or a dict by output name (an output
    it does not name gets ``default``); None for an output not written. Unknown names are refused."""
    written = [n for n in names if n is not None]
    if not isinstance(value, dict):
        return [None if n is None else (default if value is None else value) for n in names]
    given = {str(k): v for k, v in value.items()}
    unknown = sorted(set(given) - set(written))
    if unknown:
        raise ValueError(f"{what}= names {unknown}, but this model's dense outputs are {written} (list and tuple "
                         "items by index, dict entries by key, nested ones joined by dots); vectors are not written")
    return [None if n is None else given.get(n, default) for n in names]


@dataclass(frozen=True)
class Several:
    """What a prediction of several outputs writes, per output tensor (None where it is not written, a
    vector per image): its name, its kept kinds, and for a ``.zarr`` group its chunks or for an OME-Zarr
    container its image ``(pyramid spec, pixel size, unit known, classes, name)``."""

    names: tuple
    kinds: tuple
    shapes: tuple
    """Each output's spatial shape."""
    full: tuple
    """Each output's full shape (N, C, *spatial)."""
    grid: tuple
    dtype: str
    chunks: tuple = ()
    images: tuple = ()
    tiff: bool = False
    """An OME-TIFF of several series: the images are staged in an OME-Zarr container, then copied."""

    @property
    def ome(self) -> bool:
        return bool(self.images)

    @property
    def levels(self) -> int:
        return max((i[0].levels for i in self.images if i is not None), default=1)

    def create(self, tmp: str) -> list:
        """The empty arrays (or images) in the marked group ``tmp``: each output's path, None if not written."""
        if self.ome:
            roots = iter(pyramid.create_collection(tmp, [i for i in self.images if i is not None]))
            return [None if i is None else next(roots) for i in self.images]
        import zarr

        group = zarr.open_group(tmp, mode="r+")
        made = []
        for name, kinds, shape, chunk, full in zip(self.names, self.kinds, self.shapes, self.chunks, self.full):
            if name is None:
                made.append(None)
                continue
            channels = pyramid.kept_channels(kinds[0], full[1])
            group.create_array(name, shape=(full[0], channels, *shape), chunks=(1, channels, *chunk),
                               dtype=pyramid.kept_dtype(kinds[0], self.dtype, full[1]))
            made.append(os.path.join(tmp, name))
        return made

    def write_tiff(self, tmp: str, made: list, path: str) -> str:
        """The OME-TIFF at a temporary sibling of ``path`` from the container ``tmp`` (then removed): one
        series per image, in order; its path."""
        tif = outputs.temporary(path, staging=tmp)
        try:
            pyramid.write_ome_tiff_series(tif, [(root, i[0], i[1], i[2], i[4]) for root, i in zip(made, self.images)
                                                if i is not None])
        except BaseException:
            outputs.abandon(tif)
            raise
        outputs.abandon(tmp)
        return tif

    def targets(self, made: list, coord) -> list:
        """One shard's ``ModelPart.predict_several`` targets: ``("ome", image root, spec, coord)`` or
        ``(array path, the shard's box, kind)``, None where nothing is written."""
        if self.ome:
            return [None if i is None else ("ome", root, i[0], tuple(coord)) for i, root in zip(self.images, made)]
        return [None if p is None else (p, shard_box(shape, self.grid, coord), kinds[0])
                for p, shape, kinds in zip(made, self.shapes, self.kinds)]


def _check_several(plan, x, fmt: str, keep, levels, mpp, classes, max_chunk: int) -> Several:
    """Several outputs go to one zarr group (an array per dense output, named by ``output_names``), one
    OME-Zarr container (an NGFF image per dense output, ``bigconv.data.pyramid.create_collection``) or one
    OME-TIFF (a series per dense output, copied from such a container).
    Everything is refused here, before remote work, where it cannot be written."""
    names = [name if shape is not None else None for name, (shape, _) in zip(output_names(plan), plan.outputs)]
    if not any(names):
        raise ValueError(f"predict writes dense maps, but none of this model's {len(names)} outputs is one (vectors "
                         "per image); use net.full(x) for them")
    kinds = [None if k is None else pyramid.check_keep(k) for k in _by_output(keep, "keep", names, "float")]
    per_levels = _by_output(levels, "levels", names)
    per_classes = _by_output(classes, "classes", names)
    full = [f for _, f in plan.outputs]
    several_kinds = any(k is not None and len(k) > 1 for k in kinds)
    if fmt == "zarr" and (several_kinds or any(lv not in (None, 1) for lv in per_levels)
                          or any(c is not None for c in per_classes)):
        raise ValueError("a .zarr group holds one kind, one level and no class names per output; write an .ome.zarr "
                         "for labels beside an image, levels or class names")
    thin = [n for n, k, f in zip(names, kinds, full) if n is not None and "labels" in k and f[1] < 2]
    if thin:
        raise ValueError(f"keep='labels' takes the argmax over the channels, but output(s) {thin} have one "
                         "channel; keep 'probabilities' (a sigmoid) or 'float' instead")
    for n, c, f in zip(names, per_classes, full):
        if c is not None and (not isinstance(c, (list, tuple)) or len(c) != f[1]):
            raise ValueError(f"classes for output {n!r} must name each of its {f[1]} channels, got {c!r} (give "
                             "classes= a dict by output name where the outputs' channels differ)")
    dtype = _input_dtype(x)
    shapes = tuple(shape for shape, _ in plan.outputs)
    base = dict(names=tuple(names), kinds=tuple(kinds), shapes=shapes, grid=tuple(plan.grid), dtype=dtype,
                full=tuple(full))
    if fmt == "zarr":  # chunks never crossing shards, refused here where they cannot be
        return Several(**base, chunks=tuple(None if n is None else outputs.aligned_chunks(shape, plan.grid, max_chunk)
                                            for n, shape in zip(names, shapes)))
    if fmt == "ome.tif":
        for n, k, shape in zip(names, kinds, shapes):
            if n is not None and (len(k) > 1 or len(shape) != 2 or "float16" in k):
                raise ValueError(f"output {n!r}: an OME-TIFF series holds one kind of a 2D output, not float16 (got "
                                 f"keep={k!r}, {len(shape)} spatial axes); write an .ome.zarr for labels beside an "
                                 "image, a 3D output or float16")
    batch = next(f[0] for n, f in zip(names, full) if n is not None)
    if batch != 1:
        raise ValueError(f"an OME-Zarr or OME-TIFF holds one image per output, but this batch has {batch}; predict "
                         "one slide per call (for s in slides: net.predict([s], out=...))")
    images = []
    for n, k, lv, c, shape, f in zip(names, kinds, per_levels, per_classes, shapes, full):
        if n is None:
            images.append(None)
            continue
        try:
            spec = pyramid.spec_for(k, f[1], dtype, shape, plan.grid, lv, max_chunk, ome=True)
        except ValueError as exc:
            hint = " (levels= takes a dict by output name)" if str(exc).startswith("levels=") else ""
            raise ValueError(f"output {n!r} ({tuple(shape)}): {exc}{hint}") from None
        pixel, unit = pixel_size(plan, x, mpp, shape)
        images.append((spec, pixel, unit, c, n))
    return Several(**base, images=tuple(images), tiff=fmt == "ome.tif")


def _predict_several(net, x, out, plan, overwrite: bool, several: Several) -> str:
    """``predict`` of a model with several outputs: a zarr group or an OME-Zarr container at ``out``
    (``several``), each worker writing its region of every output in the same forward, then (OME) each
    further level of every image."""
    path = outputs.check_out(out, [s.path for s in x] if is_source_batch(x) else [], overwrite)
    shards = net._shard_calls(plan, x)
    coords = list(all_coords(plan.grid))
    net.world.check_usable()
    tmp = outputs.begin_group(path + ".zarr" if several.tiff else path)
    try:
        made = several.create(tmp)
        work = [(s, several.targets(made, c)) for s, c in zip(shards, coords)]
        net._wait(net._launch("predict_several", work), f"prediction {shards[0].call} (predict_several)")
        for k in range(1, several.levels):
            net._wait(net._launch("pyramid_level", [(k,)] * len(shards)), f"prediction {shards[0].call} (level {k})")
        if several.tiff:
            tmp = several.write_tiff(tmp, made, path)
    except BaseException:
        if not net.world.broken:
            outputs.abandon(tmp)
        raise
    return outputs.finish(tmp, path)


def _input_dtype(x) -> str:
    return str(SourceBatch(x).dtype if is_source_batch(x) else x.dtype).replace("torch.", "")


def _predict_several_spmd(net, x, out, plan, overwrite: bool, several: Several) -> str:
    """``predict_spmd`` of a model with several outputs: rank 0 makes the zarr group or OME-Zarr container at
    ``out``, every rank writes its region of every output from one forward, then (OME) of each further level
    of every image (a collective after each, so a level is complete before the next reads it)."""
    from .engine import step as shard_step
    from .engine.plan import output_leaves
    from .geometry.boxes import box_index, coord_of
    from .runtime import spmd_outputs

    def make() -> tuple[str, tuple]:  # on rank 0 only; every rank gets its answer
        path = outputs.check_out(out, [s.path for s in x] if is_source_batch(x) else [], overwrite)
        tmp = outputs.begin_group(path + ".zarr" if several.tiff else path)
        try:
            return path, (tmp, several.create(tmp))
        except BaseException:
            outputs.abandon(tmp)
            raise

    path, (tmp, made) = spmd_outputs.made_by_rank_zero(net.world, net.engine, make, "predict")
    targets = several.targets(made, coord_of(net.mesh.shard, plan.grid))
    writers = []

    def write() -> None:
        leaves = output_leaves(shard_step.forward(net.engine, net._shard_call(plan, x), False))
        for t, target in zip(leaves, targets):
            if target is None:
                continue
            if several.ome:
                writers.append(pyramid.LevelWriter(target[2], target[1], target[3]))
                writers[-1].first(t)
            else:  # this rank's box of the output's own grid, of its replica's images
                array_path, box, kind = target
                outputs.write(array_path, box_index(box, t.dim(), net._items(x)),
                              pyramid.convert(kind, t, t.shape[1], box, array_path))

    def together(work, what: str) -> None:
        spmd_outputs.together(net.world, net.engine, work, f"predict ({what})", tmp, f"; {out!r} is as it was")

    together(write, "several outputs")
    for k in range(1, several.levels):
        together(lambda k=k: pyramid.Writers(writers).next(k), f"several outputs, level {k}")
    if net.world.rank == 0:
        final = tmp
        if several.tiff:
            try:
                final = several.write_tiff(tmp, made, path)
            except BaseException:
                outputs.abandon(tmp)
                raise
        outputs.finish(final, path)
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


@outputs.releasing_claims
def predict(net, x, out, *, overwrite: bool = False, max_chunk: int = 1024, keep="float", levels: int | None = None,
            mpp: float | None = None, classes: Sequence[str] | None = None) -> str:
    """``ParallelModel.predict`` (see its doc)."""
    plan = net.plan(x)
    if plan.several:
        several = _check_several(plan, x, output_format(out), keep, levels, mpp, classes, max_chunk)
        return _predict_several(net, x, out, plan, overwrite, several)
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
            tif = outputs.temporary(path, staging=tmp)
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


@outputs.releasing_claims
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
        several = _check_several(plan, x, output_format(out), keep, levels, mpp, classes, max_chunk)
        return _predict_several_spmd(net, x, out, plan, overwrite, several)
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
                          pyramid.convert(kinds[0], result, channels, box, tmp))

    together(first, "level 0")
    for k in range(1, spec.levels if spec is not None else 1):
        together(lambda k=k: writer.next(k), f"level {k}")
    if net.world.rank == 0:
        final = tmp
        if fmt == "ome.tif":
            final = outputs.temporary(path, staging=tmp)
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
