"""Predictions as slide viewers open them: what to keep of the output, and OME-Zarr pyramids written by
the workers, each level reduced from the workers' own regions.

**What is kept** (``keep=``, one per call): ``"float"`` (the model's output as computed), ``"float16"``,
``"probabilities"`` (softmax over the channels, sigmoid for one channel, as ``uint8`` 0..255: a 100,000²
slide of 3 classes is 30 GB instead of 120 GB in float32) or ``"labels"`` (the argmax class, one channel
of ``uint8``, or ``uint16`` beyond 256 classes). ``convert`` is that function; a worker applies it to its own
region, and one process applying it to the whole output gets the same values.

**Levels.** Level ``k`` has every spatial side of level ``k - 1`` halved (rounded up). ``reduce`` makes
it: the mean of each 2×2 (2×2×2) block, clipped at the far edges, computed in float64 and cast back to
the kept dtype (``uint8``: rounded to nearest); for labels the block's first element (nearest
neighbour: a mean of classes is no class). Each level is a function of the level above it *as stored*,
so a level can be recomputed from the stored array above it, and one process iterating ``reduce`` gets
the same array bit for bit.

**Who writes what.** Level 0's chunks never cross shards (``outputs.aligned_chunks``). The boundaries
between the workers' regions of level ``k`` are those of level ``k - 1`` halved and rounded to the chunk
edge (``level_bounds``), so each chunk of each level has exactly one writer. A worker keeps its region
of the level it just wrote and reduces the next from it when that region covers the footprint of its next
region (the usual case); where a shard boundary does not fall on the halved grid, it reads that footprint
from the level stored above, which every worker finished before the driver asked for the next level.
Nothing the size of a level reaches the driver.

**Metadata** (NGFF 0.5 on zarr v3): ``multiscales`` naming every level, ``axes`` (``c``, then ``z``,
``y``, ``x`` in micrometres when the pixel size is known), ``coordinateTransformations`` per level (scale:
the source's microns per pixel times the model's output stride times 2^k; translation: the centre of a
mean's block); class maps are label images (``image-label`` with a colour and name per class), under
``labels/classes`` of the probability image when both are kept.

**Several images in one container** (a model with several dense outputs: deep supervision's maps at
several scales, HoVerNet's heads; ``create_collection``). NGFF 0.5 defines one convention for a container
of several independent images, each with its own multiscales: the ``bioformats2raw.layout`` (NGFF 0.5,
section 2.2 "bioformats2raw.layout", https://ngff.openmicroscopy.org/0.5/#bf2raw). The root's ``ome``
attributes say ``"bioformats2raw.layout": 3``; the images are the groups ``0``, ``1``, ... (consecutive
numbers, so that readers that ignore the series list, such as ``ome-zarr-models``, find them too), each a
complete image as above (its own levels, pixel size, kind and labels) named in its ``multiscales`` by the
output's name; the ``OME`` group's ``series`` lists their paths in order. Why this one: plates and wells
(the other multi-image convention) describe a microscope's wells and fields, not maps of one slide, and
labels are integer segmentations, not float maps. Not written: ``OME/METADATA.ome.xml`` (a SHOULD, used by
Bio-Formats' OME-XML readers): OME-XML has no pixel type for ``float16``, and the ``series`` list already
names every image for NGFF readers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from . import outputs

KEEP = ("float", "float16", "probabilities", "labels")
NGFF_VERSION = "0.5"
LABELS = "classes"
"""The name of the label image under ``labels/``."""
PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
           (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]


def check_keep(keep) -> tuple[str, ...]:
    """``keep`` as a tuple of kinds: one kind, or for an OME-Zarr an image kind and ``"labels"``."""
    kinds = (keep,) if isinstance(keep, str) else tuple(keep) if isinstance(keep, (tuple, list)) else None
    if not kinds or any(k not in KEEP for k in kinds) or len(set(kinds)) != len(kinds):
        raise ValueError(f"keep must be one of {', '.join(map(repr, KEEP))}, or for an .ome.zarr an image kind and "
                         f"'labels' (e.g. ('probabilities', 'labels')); got {keep!r}")
    if len(kinds) > 2 or (len(kinds) == 2 and "labels" not in kinds):
        raise ValueError(f"keep={keep!r}: one image kind at most, with 'labels' beside it (labels/classes)")
    return tuple(sorted(kinds, key=lambda k: k == "labels"))  # the image first


def kept_dtype(kind: str, dtype: str, channels: int) -> str:
    if kind == "float":
        return dtype
    if kind == "float16":
        return "float16"
    if kind == "probabilities":
        return "uint8"
    return "uint8" if channels <= 256 else "uint16"


def kept_channels(kind: str, channels: int) -> int:
    return 1 if kind == "labels" else channels


def convert(kind: str, out, channels: int, box: Sequence[tuple[int, int]] | None = None, where: str = ""):
    """What is kept of the model's output ``out`` (a torch tensor (N, C, *spatial)), as a numpy array.

    uint8 probabilities and labels have no value for NaN (a cast would make it 0: background, class 0), and
    no no-data value is defined for them: a NaN there (in the output, or made by the softmax from infinities)
    is a ``ValueError`` naming the output (``where``: the array's path, staging or not), the kind, how many
    positions hold one and the first (in the output's spatial coordinates when ``box``, this region's place in
    the output, is given), before anything is written.
    ``float`` and ``float16`` keep NaN as it is."""
    import torch

    out = out.detach()
    if kind == "float":
        return out.cpu().numpy()
    if kind == "float16":
        return out.to(torch.float16).cpu().numpy()
    if kind == "probabilities":
        p = torch.sigmoid(out) if channels == 1 else torch.softmax(out, dim=1)
        _refuse_nan(kind, p, box, where)
        return torch.round(p.double() * 255).clamp(0, 255).to(torch.uint8).cpu().numpy()
    _refuse_nan(kind, out, box, where)
    return out.argmax(dim=1, keepdim=True).cpu().numpy().astype(kept_dtype(kind, "", channels))


def _refuse_nan(kind: str, values, box: Sequence[tuple[int, int]] | None, where: str) -> None:
    """The ``ValueError`` of ``convert`` when ``values`` (N, C, *spatial) hold NaN at some position."""
    import torch

    nan = torch.isnan(values).any(dim=1)
    if not bool(nan.any()):
        return
    first = [int(i) for i in torch.nonzero(nan)[0]]
    image, at = first[0], first[1:]
    if box is not None:
        at = [a + i for (a, _), i in zip(box, at)]
    region = f" of this region {tuple(tuple(b) for b in box)}" if box is not None else ""
    output = f"{outputs.shown(where)!r}: " if where else ""
    raise ValueError(
        f"{output}keep={kind!r} writes uint8, which has no value for NaN, and the model's output holds NaN at "
        f"{int(nan.sum())} of {nan.numel()} positions{region} (the first: image {image}, position {tuple(at)}); "
        "cast, they would read as 0 (background, class 0). Find what makes NaN there (check_finite=True refuses "
        "a NaN input), or keep='float' or 'float16', which keep NaN as NaN")


def reduce(values: np.ndarray, kind: str, spatial: int) -> np.ndarray:
    """The next level of ``values`` (any leading axes, then ``spatial`` axes): 2×...×2 block means in
    float64, cast back (labels: each block's first element). Only elementwise operations in a fixed
    order, so a region's reduction equals that part of the whole array's."""
    lead = values.ndim - spatial
    if kind == "labels":
        return np.ascontiguousarray(values[(slice(None),) * lead + (slice(None, None, 2),) * spatial])
    total = values.astype(np.float64)
    count = np.ones(values.shape[lead:], dtype=np.float64)
    for axis in range(spatial):
        a = lead + axis
        n = total.shape[a]
        evens = [slice(None)] * total.ndim
        odds = [slice(None)] * total.ndim
        evens[a], odds[a] = slice(0, n, 2), slice(1, n, 2)
        s = total[tuple(evens)].copy()
        c = count[tuple(evens[lead:])].copy()
        pairs = [slice(None)] * total.ndim
        pairs[a] = slice(0, n // 2)
        s[tuple(pairs)] += total[tuple(odds)]
        c[tuple(pairs[lead:])] += count[tuple(odds[lead:])]
        total, count = s, c
    mean = total / count
    if values.dtype == np.uint8:
        return np.clip(np.rint(mean), 0, 255).astype(np.uint8)
    return mean.astype(values.dtype)


def level_shapes(spatial: Sequence[int], levels: int) -> list[tuple[int, ...]]:
    shapes = [tuple(spatial)]
    for _ in range(levels - 1):
        shapes.append(tuple(-(-n // 2) for n in shapes[-1]))
    return shapes


def default_levels(spatial: Sequence[int], smallest: int = 512) -> int:
    """Levels until the largest side is at most ``smallest`` pixels."""
    return 1 + max(0, math.ceil(math.log2(max(spatial) / smallest))) if max(spatial) > smallest else 1


def level_bounds(starts: Sequence[Sequence[int]], shapes: list[tuple[int, ...]], chunks: Sequence[int]
                 ) -> list[list[list[int]]]:
    """Per level, per spatial axis, the boundaries ``[0, b_1, ..., n]`` of the workers' regions along it:
    level 0's are the shards'; level k's are level k-1's halved and rounded to the chunk edge (so no chunk
    has two writers; a region may be empty)."""
    out = [[list(s) + [shapes[0][a]] for a, s in enumerate(starts)]]
    for k in range(1, len(shapes)):
        axes = []
        for a, prev in enumerate(out[-1]):
            n, c = shapes[k][a], chunks[a]
            inner = [min(n, math.floor(b / (2 * c) + 0.5) * c) for b in prev[1:-1]]
            axes.append([0] + inner + [n])
        out.append(axes)
    return out


@dataclass(frozen=True)
class Pyramid:
    """Everything a worker needs to write its part of every level (pickled to each worker)."""

    kinds: tuple[str, ...]
    channels: int
    dtype: str
    """The model's output dtype (``"float"`` keeps it)."""
    shapes: tuple[tuple[int, ...], ...]
    """Spatial shape per level."""
    chunks: tuple[int, ...]
    bounds: tuple = field(default=())
    """``level_bounds``: per level, per axis, the workers' region boundaries."""
    ome: bool = True

    @property
    def levels(self) -> int:
        return len(self.shapes)

    def arrays(self) -> list[tuple[str, str]]:
        """(kind, path of its group in the store) of each kept kind."""
        return [(k, f"labels/{LABELS}" if k == "labels" and len(self.kinds) > 1 else "") for k in self.kinds]

    def region(self, level: int, coord: Sequence[int]) -> tuple[tuple[int, int], ...]:
        return tuple((self.bounds[level][a][c], self.bounds[level][a][c + 1]) for a, c in enumerate(coord))


def array_path(root: str, group: str, level: int) -> str:
    return "/".join(p for p in (root, group, str(level)) if p)


def _index(box) -> tuple:
    return (slice(None),) + tuple(slice(a, b) for a, b in box)


@dataclass(frozen=True)
class Pyramids:
    """The pyramids of several images written together (``Writers``): each has its own levels."""

    specs: tuple[Pyramid, ...]

    @property
    def levels(self) -> int:
        """The most levels of any image: the driver asks for each level up to it."""
        return max(s.levels for s in self.specs)


class LevelWriter:
    """A worker's side of a pyramid: its region of the level it wrote last, kept for the next."""

    def __init__(self, spec: Pyramid, root: str, coord: Sequence[int]) -> None:
        self.spec, self.root, self.coord = spec, root, tuple(coord)
        self.kept: dict[str, tuple] = {}

    def first(self, out) -> None:
        """Level 0: this shard's output (a torch tensor, one image) converted and written."""
        import zarr

        box = self.spec.region(0, self.coord)
        for kind, group in self.spec.arrays():
            values = convert(kind, out, self.spec.channels, box, array_path(self.root, group, 0))[0]
            zarr.open_array(array_path(self.root, group, 0), mode="r+")[_index(box)] = values
            self.kept[kind] = (box, values)

    def next(self, level: int) -> None:
        """Level ``level`` from this worker's region of ``level - 1`` (or the stored one where a boundary
        does not fall on the halved grid)."""
        import zarr

        box = self.spec.region(level, self.coord)
        spatial = len(box)
        for kind, group in self.spec.arrays():
            if any(b <= a for a, b in box):
                self.kept[kind] = (box, None)
                continue
            foot = tuple((2 * a, min(2 * b, n)) for (a, b), n in zip(box, self.spec.shapes[level - 1]))
            have, values = self.kept.get(kind, (None, None))
            if values is not None and all(ha <= fa and fb <= hb for (ha, hb), (fa, fb) in zip(have, foot)):
                above = values[(slice(None),) + tuple(slice(fa - ha, fb - ha) for (ha, _), (fa, fb) in zip(have, foot))]
            else:
                above = zarr.open_array(array_path(self.root, group, level - 1), mode="r")[_index(foot)]
            reduced = reduce(above, kind, spatial)
            if reduced.shape[1:] != tuple(b - a for a, b in box):  # zarr would cut or pad it silently
                raise RuntimeError(f"level {level}: reduced {reduced.shape[1:]} for the region {box}")
            zarr.open_array(array_path(self.root, group, level), mode="r+")[_index(box)] = reduced
            self.kept[kind] = (box, reduced)


class Writers:
    """A worker's side of several pyramids (one per dense output of one forward): each ``LevelWriter``
    writes the levels its own image has and skips the rest."""

    def __init__(self, writers: Sequence[LevelWriter]) -> None:
        self.writers = list(writers)
        self.spec = Pyramids(tuple(w.spec for w in self.writers))

    def next(self, level: int) -> None:
        for w in self.writers:
            if level < w.spec.levels:
                w.next(level)


# -- the store and its metadata, written by the driver before the workers start ----------------------------------
def _axes(spatial: int, unit: bool) -> list[dict]:
    names = ["z", "y", "x"][-spatial:]
    space = [{"name": n, "type": "space", **({"unit": "micrometer"} if unit else {})} for n in names]
    return [{"name": "c", "type": "channel"}] + space


def multiscales(spec: Pyramid, kind: str, pixel: Sequence[float], unit: bool, name: str) -> dict:
    """One ``multiscales`` entry: every level, with its scale (and, for means, the block's centre)."""
    datasets = []
    for k in range(spec.levels):
        f = 2 ** k
        scale = [1.0] + [p * f for p in pixel]
        transforms: list[dict] = [{"type": "scale", "scale": scale}]
        if kind != "labels" and k:
            transforms.append({"type": "translation", "translation": [0.0] + [p * (f - 1) / 2 for p in pixel]})
        datasets.append({"path": str(k), "coordinateTransformations": transforms})
    method = "nearest" if kind == "labels" else "mean"
    return {"name": name, "axes": _axes(len(pixel), unit), "datasets": datasets, "type": method,
            "metadata": {"method": f"bigconv.data.pyramid.reduce ({method} of 2x2 blocks)", "kind": kind}}


def image_label(channels: int, classes: Sequence[str] | None, source: str | None) -> dict:
    names = list(classes) if classes is not None else [str(i) for i in range(channels)]
    label = {"colors": [{"label-value": i, "rgba": [*PALETTE[i % len(PALETTE)], 255]} for i in range(channels)],
             "properties": [{"label-value": i, "class": n} for i, n in enumerate(names)]}
    if source is not None:
        label["source"] = {"image": source}
    return label


def create(tmp: str, spec: Pyramid, pixel: Sequence[float], unit: bool, classes: Sequence[str] | None,
           name: str) -> None:
    """The empty OME-Zarr at ``tmp`` (a temporary sibling; ``outputs.begin_group``): groups, metadata and
    every level's array, chunked so that no chunk has two writers."""
    import zarr

    root = zarr.open_group(tmp, mode="r+")
    for kind, group in spec.arrays():
        g = root if not group else root.require_group(group)
        if group:
            root.require_group("labels").attrs["ome"] = {"version": NGFF_VERSION, "labels": [LABELS]}
        channels = kept_channels(kind, spec.channels)
        dtype = kept_dtype(kind, spec.dtype, spec.channels)
        names = ["c"] + ["z", "y", "x"][-len(pixel):]
        for k, shape in enumerate(spec.shapes):
            chunks = (channels,) + tuple(min(c, n) for c, n in zip(spec.chunks, shape))
            g.create_array(str(k), shape=(channels, *shape), chunks=chunks, dtype=dtype, dimension_names=names,
                           fill_value=0)
        ome: dict = {"version": NGFF_VERSION, "multiscales": [multiscales(spec, kind, pixel, unit, name)]}
        if kind == "labels":
            ome["image-label"] = image_label(spec.channels, classes, "../../" if group else None)
        g.attrs["ome"] = ome
    root.attrs[outputs.MARK_KEY] = outputs.MARK


def create_collection(tmp: str, images: Sequence[tuple]) -> list[str]:
    """The empty NGFF container of several images at ``tmp`` (``outputs.begin_group``'s marked group): the
    ``bioformats2raw.layout`` (see the module doc), image ``i`` in the group ``str(i)`` made by ``create``
    from ``images[i] = (spec, pixel, unit, classes, name)``. Each image's root path, in order."""
    import os

    import zarr

    root = zarr.open_group(tmp, mode="r+")
    series = [str(i) for i in range(len(images))]
    roots = []
    for path, (spec, pixel, unit, classes, name) in zip(series, images):
        root.require_group(path)
        roots.append(os.path.join(tmp, path))
        create(roots[-1], spec, pixel, unit, classes, name)
    root.require_group("OME").attrs["ome"] = {"version": NGFF_VERSION, "series": series}
    root.attrs["ome"] = {"version": NGFF_VERSION, "bioformats2raw.layout": 3}
    return roots


def spec_for(kinds: tuple[str, ...], channels: int, dtype: str, spatial: Sequence[int], grid: Sequence[int],
             levels: int | None, max_chunk: int, ome: bool) -> Pyramid:
    """The pyramid of a prediction of ``spatial`` on ``grid``: its levels, chunks and writers' regions."""
    from ..geometry.boxes import balanced_bounds

    chunks = outputs.aligned_chunks(spatial, grid, max_chunk)
    if levels is None:
        levels = default_levels(spatial) if ome else 1
    if not isinstance(levels, int) or isinstance(levels, bool) or levels < 1:
        raise ValueError(f"levels must be a positive integer (1: full resolution only), got {levels!r}")
    if levels > 1 and not ome:
        raise ValueError(f"levels={levels} needs an OME-Zarr out= (a name ending in .ome.zarr); a plain .zarr "
                         "holds one array")
    shapes = level_shapes(spatial, levels)
    if min(shapes[-1]) < 1 or levels > 1 + math.ceil(math.log2(max(spatial))):
        raise ValueError(f"levels={levels} is more than a {tuple(spatial)} output halves into; use at most "
                         f"{1 + math.ceil(math.log2(max(spatial)))}")
    starts = [[lo for lo, _ in balanced_bounds(n, g)] for n, g in zip(spatial, grid)]
    bounds = level_bounds(starts, shapes, chunks)
    return Pyramid(kinds, channels, dtype, tuple(shapes), tuple(chunks), tuple(tuple(tuple(a) for a in lv)
                                                                          for lv in bounds), ome)


# -- a pyramidal OME-TIFF, from the OME-Zarr the workers wrote ---------------------------------------------------
TIFF_TILE = 256


def _tiles(array, tile: int):
    """The tiles of a zarr array (C, Y, X), plane by plane, row by row, each padded to ``tile`` × ``tile``:
    one tile in memory at a time."""
    channels, h, w = array.shape
    for c in range(channels):
        for y in range(0, h, tile):
            for x in range(0, w, tile):
                block = array[c, y:y + tile, x:x + tile]
                if block.shape != (tile, tile):
                    block = np.pad(block, ((0, tile - block.shape[0]), (0, tile - block.shape[1])))
                yield block


def write_ome_tiff(root: str, path: str, spec: Pyramid, pixel: Sequence[float], unit: bool) -> None:
    """Every level of the OME-Zarr at ``root`` (one kind) into a tiled, pyramidal OME-TIFF at ``path``:
    level 0 as the image, the others as its SubIFDs, each tile read from the zarr level as it is written."""
    write_ome_tiff_series(path, [(root, spec, pixel, unit, None)])


def write_ome_tiff_series(path: str, images: Sequence[tuple]) -> None:
    """Several OME-Zarr images, ``images[i] = (root, spec, pixel, unit, name)``, as the series of one
    OME-TIFF at ``path`` in order (each one pyramid as ``write_ome_tiff`` writes it; OME-XML names each
    ``name``, or ``bigconv KIND``)."""
    import tifffile
    import zarr

    with tifffile.TiffWriter(path, bigtiff=True, ome=True) as tif:
        for root, spec, pixel, unit, name in images:
            kind, group = spec.arrays()[0]
            levels = [zarr.open_array(array_path(root, group, k), mode="r") for k in range(spec.levels)]
            tile = max(16, min(TIFF_TILE, 16 * -(-max(spec.shapes[0]) // 16)))
            meta: dict = {"axes": "CYX", "Name": name or f"bigconv {kind}"}
            if unit:
                meta.update(PhysicalSizeY=pixel[0], PhysicalSizeX=pixel[1], PhysicalSizeYUnit="µm",
                            PhysicalSizeXUnit="µm")
            for k, a in enumerate(levels):
                tif.write(_tiles(a, tile), shape=a.shape, dtype=a.dtype, tile=(tile, tile), photometric="minisblack",
                          software=outputs.TIFF_SOFTWARE, compression="zlib",
                          **({"subifds": spec.levels - 1, "metadata": meta} if k == 0 else {"subfiletype": 1}))
