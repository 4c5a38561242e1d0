"""File formats behind ``bigconv.data.open_image``: metadata from headers alone, and box reads.

Each reader works on a path and a level and returns arrays channels first (C, *spatial). Handles
are opened once per process and cached (``handle``): a source pickles as a path, and each worker
opens the file itself on first use. ``OPENED`` counts the opens, per process, for tests.

Formats: ``.npy`` (a numpy memmap), TIFF/SVS pyramids (tifffile; levels as SubIFDs or as reduced
pages; RGB stored HWC), zarr v3 arrays and OME-Zarr multiscales (zarr), and anything OpenSlide reads
(openslide-python with openslide-bin). The last three are optional (``pip install bigconv[slides]``)
and imported only when used.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections import Counter
from dataclasses import dataclass

import numpy as np

OPENED: Counter = Counter()
_HANDLE_CACHE: dict[tuple, object] = {}
"""A cache, not state: each process's open handles by (format, path, level, key), reopened on demand."""
_LOCK = threading.Lock()

TIFF_SUFFIXES = (".tif", ".tiff", ".svs", ".ome.tif", ".ome.tiff", ".btf", ".tf8")
OPENSLIDE_SUFFIXES = (".ndpi", ".mrxs", ".vms", ".vmu", ".scn", ".bif", ".czi")


@dataclass(frozen=True)
class LevelInfo:
    """One level of an image: its channels-first shape, dtype and microns per pixel (None: unknown)."""

    shape: tuple[int, ...]
    dtype: str
    mpp: float | None
    channels_last: bool = False
    """Stored with channels as the last axis (RGB TIFF, an HWC array)."""
    axes: str | None = None
    """OME-Zarr axis names as stored (e.g. ``tczyx``); unit t and z axes are read at index 0."""


def guess_format(path: str) -> str:
    lower = path.lower().rstrip("/")
    if lower.endswith(".npy"):
        return "npy"
    if lower.endswith(TIFF_SUFFIXES):
        return "tiff"
    if lower.endswith(".zarr") or os.path.isdir(path) and os.path.exists(os.path.join(path, "zarr.json")):
        return "zarr"
    if lower.endswith(OPENSLIDE_SUFFIXES):
        return "openslide"
    raise ValueError(
        f"cannot tell the format of {path!r} from its name; give format='npy', 'tiff', 'zarr' or 'openslide'"
    )


def _need(module: str, extra: str = "slides"):
    try:
        return __import__(module)
    except ImportError:
        raise ValueError(f"reading this file needs the {module!r} package: pip install bigconv[{extra}]") from None


def handle(fmt: str, path: str, level: int, key: str | None):
    """This process's open handle of one level (opened on first use, then reused)."""
    ident = (fmt, path, level, key)
    with _LOCK:
        if ident not in _HANDLE_CACHE:
            _HANDLE_CACHE[ident] = _open(fmt, path, level, key)
            OPENED[ident] += 1
        return _HANDLE_CACHE[ident]


def _open(fmt: str, path: str, level: int, key: str | None):
    if fmt == "npy":
        return np.load(path, mmap_mode="r")
    if fmt == "tiff":
        tifffile, zarr = _need("tifffile"), _need("zarr")
        series = tifffile.TiffFile(path).series[0]
        return zarr.open(series.aszarr(level=level), mode="r")
    if fmt == "zarr":
        return _zarr_level(path, level, key)
    if fmt == "openslide":
        return _need("openslide").OpenSlide(path)
    raise ValueError(f"unknown format {fmt!r}; use 'npy', 'tiff', 'zarr' or 'openslide'")


# -- metadata ---------------------------------------------------------------------------------------
def levels(fmt: str, path: str, key: str | None, channels_last: bool | None) -> list[LevelInfo]:
    if not os.path.exists(path):
        raise ValueError(f"no image at {path!r}; check the path")
    if fmt == "npy":
        a = np.load(path, mmap_mode="r")
        shape, last = _chw_shape(a.shape, channels_last)
        return [LevelInfo(shape, str(a.dtype), None, last)]
    if fmt == "tiff":
        return _tiff_levels(path)
    if fmt == "zarr":
        return _zarr_levels(path, key, channels_last)
    if fmt == "openslide":
        slide = _need("openslide").OpenSlide(path)
        mpp = slide.properties.get("openslide.mpp-x")
        return [LevelInfo((3, h, w), "uint8", float(mpp) * d if mpp else None, True)
                for (w, h), d in zip(slide.level_dimensions, slide.level_downsamples)]
    raise ValueError(f"unknown format {fmt!r}; use 'npy', 'tiff', 'zarr' or 'openslide'")


def _chw_shape(shape: tuple[int, ...], channels_last: bool | None) -> tuple[tuple[int, ...], bool]:
    """The channels-first shape of a stored array, and whether it stores channels last."""
    if len(shape) == 2:
        return (1, *shape), False
    if channels_last is None:  # a guess only where it cannot be wrong: 3-4 channels against a large edge
        channels_last = shape[-1] <= 4 < shape[0]
    return ((shape[-1], *shape[:-1]) if channels_last else tuple(shape)), channels_last


def _tiff_levels(path: str) -> list[LevelInfo]:
    tifffile = _need("tifffile")
    try:
        tf = tifffile.TiffFile(path)
    except Exception as exc:
        raise ValueError(f"{path!r} is not a readable TIFF ({type(exc).__name__}: {exc}); use an intact copy") from exc
    with tf:
        series = tf.series[0]
        check_tiff_structure(path, series.levels)
        page = series.pages[0] if hasattr(series, "pages") else tf.pages[0]
        mpp0 = _tiff_mpp(page)
        width0 = series.levels[0].shape[series.levels[0].axes.index("X")]
        out = []
        for lv in series.levels:
            axes, shape = lv.axes, lv.shape
            spatial = tuple(shape[axes.index(a)] for a in axes if a in "ZYX")
            channels = next((shape[axes.index(a)] for a in axes if a in "SC"), 1)
            width = shape[axes.index("X")]
            out.append(LevelInfo((channels, *spatial), str(lv.dtype), mpp0 * width0 / width if mpp0 else None,
                                 axes[-1] in "SC"))
        return out


def check_tiff_structure(path: str, tiff_levels) -> None:
    """Refuse a TIFF whose directories (IFDs) lost their tile table or point past the end of the file:
    tifffile opens such a file and reads its tiles as zeros, so a cut file would train as a black image.
    Headers only: the offsets and byte counts of every page of every level, no pixel."""
    size = os.path.getsize(path)
    for index, lv in enumerate(tiff_levels):
        for page in lv.pages:
            if page is None:
                continue
            offsets = np.asarray(page.dataoffsets, dtype=np.int64)
            counts = np.asarray(page.databytecounts, dtype=np.int64)
            if offsets.size == 0 or counts.size != offsets.size or not counts.any():
                raise ValueError(f"{path!r} is truncated or corrupt: level {index} has no table of its image data "
                                 f"in its directory (IFD) ({size} bytes in the file); use an intact copy")
            end = int((offsets + counts).max())
            if end > size:
                raise ValueError(f"{path!r} is truncated: the image data of level {index} ends at byte {end}, past "
                                 f"the end of the file ({size} bytes); use an intact copy")


def check_chunks(path: str, h, level: int, missing: str) -> None:
    """Name the chunks (or shards) a zarr level's store lacks: they read as the fill value. ``missing``:
    ``"warn"`` (zarr leaves out chunks equal to the fill value, so a sparse store is normal), ``"error"``
    or ``"fill"`` (silent). One listing of the store, no pixel."""
    if missing == "fill":
        return
    try:
        from zarr.core.sync import sync

        expected = list(h._iter_shard_keys())
        prefix = f"{h.path}/" if h.path else ""

        async def listing():
            return {k async for k in h.store.list_prefix(h.path)}

        stored = sync(listing())
    except (AttributeError, ImportError):  # another zarr: count instead of naming
        expected, prefix, stored = None, "", set()
    if expected is None:
        lacking, total = [], h.nchunks
        count = total - h.nchunks_initialized
    else:
        lacking = [k for k in expected if prefix + k not in stored]
        total, count = len(expected), len(lacking)
    if not count:
        return
    names = f" ({', '.join(lacking[:5])}{', ...' if len(lacking) > 5 else ''})" if lacking else ""
    message = (f"{path!r} level {level} lacks {count} of its {total} chunks{names}: they read as the fill value "
               f"{h.metadata.fill_value}")
    if missing == "error":
        raise ValueError(f"{message}; restore them, or pass missing_chunks='fill' if the store is sparse by design")
    warnings.warn(f"{message}. Pass missing_chunks='fill' if the store is sparse by design, 'error' to refuse it",
                  stacklevel=3)


def _tiff_mpp(page) -> float | None:
    tags = page.tags
    if "XResolution" not in tags:
        return None
    num, den = tags["XResolution"].value
    unit = tags["ResolutionUnit"].value if "ResolutionUnit" in tags else 2
    per_unit = num / den if den else 0
    if not per_unit or int(unit) == 1:
        return None
    microns = {2: 25400.0, 3: 10000.0}.get(int(unit))
    return microns / per_unit if microns else None


def _zarr_group_levels(group) -> list[str] | None:
    attrs = dict(group.attrs)
    ome = attrs.get("ome", attrs)
    scales = ome.get("multiscales")
    if not scales:
        return None
    return [d["path"] for d in scales[0]["datasets"]]


def _zarr_level(path: str, level: int, key: str | None):
    zarr = _need("zarr")
    node = zarr.open(path, mode="r")
    if key is not None:
        return node[key]
    if hasattr(node, "shape"):
        return node
    paths = _zarr_group_levels(node)
    if paths is None:
        raise ValueError(f"{path!r} is a zarr group without OME multiscales; give key='name of the array'")
    return node[paths[level]]


def _zarr_levels(path: str, key: str | None, channels_last: bool | None) -> list[LevelInfo]:
    zarr = _need("zarr")
    node = zarr.open(path, mode="r")
    if key is not None or hasattr(node, "shape"):
        a = node[key] if key is not None else node
        shape, last = _chw_shape(a.shape, channels_last)
        return [LevelInfo(shape, str(a.dtype), None, last)]
    paths = _zarr_group_levels(node)
    if paths is None:
        raise ValueError(f"{path!r} is a zarr group without OME multiscales; give key='name of the array'")
    ome = dict(node.attrs).get("ome", dict(node.attrs))
    names = "".join(a["name"] if isinstance(a, dict) else a for a in ome["multiscales"][0].get("axes", "tczyx"))
    axes = ome["multiscales"][0].get("axes", [])
    microns = [isinstance(a, dict) and a.get("unit") == "micrometer" for a in axes]
    out = []
    for p, dataset in zip(paths, ome["multiscales"][0]["datasets"]):
        a = node[p]
        names = names[-len(a.shape):]
        sizes = dict(zip(names, a.shape))
        spatial = tuple(sizes[n] for n in names if n in "zyx" and not (n == "z" and sizes[n] == 1))
        scale = next((t["scale"] for t in dataset.get("coordinateTransformations", []) if t.get("type") == "scale"),
                     None)
        mpp = float(scale[-1]) if scale and microns and microns[-1] else None  # the x axis, in micrometres
        out.append(LevelInfo((sizes.get("c", 1), *spatial), str(a.dtype), mpp, False, names))
    return out


# -- reads --------------------------------------------------------------------------------------------
def read_inside(fmt: str, h, box: tuple[tuple[int, int], ...], level: int, channels_last: bool,
                axes: str | None = None) -> np.ndarray:
    """The CHW array of ``box`` (spatial, within the image) at one level; channels stored last come
    back as a CHW view of the HWC data, not a copy."""
    sl = tuple(slice(a, b) for a, b in box)
    if axes is not None:  # OME-Zarr
        spatial = iter(sl)
        index = tuple(slice(None) if n == "c" else 0 if n == "t" or (n == "z" and size == 1) else next(spatial)
                      for n, size in zip(axes, h.shape))
        data = np.asarray(h[index])
        return data if "c" in axes else data[None]
    if fmt == "openslide":
        (y0, y1), (x0, x1) = box
        down = h.level_downsamples[level]
        region = h.read_region((int(round(x0 * down)), int(round(y0 * down))), level, (x1 - x0, y1 - y0))
        return np.asarray(region)[..., :3].transpose(2, 0, 1)  # a CHW view: see ImageSource.tensor
    nd = len(h.shape)
    if nd == len(box):  # no channel axis stored
        return np.asarray(h[sl])[None]
    if channels_last:
        return np.moveaxis(np.asarray(h[sl + (slice(None),)]), -1, 0)  # a CHW view: see ImageSource.tensor
    return np.asarray(h[(slice(None),) + sl])
