"""Image sources: a path, a level and a conversion, small enough to send to every worker.

A worker given a source reads only its own box of it, in the stored dtype (uint8 for slides), and
converts on its side: dtype, scale (e.g. 1/255), per-channel mean and std. Nothing the size of the
image passes through the driver. Reads outside the image come back as ``fill`` (255: white glass).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np
import torch

from . import readers, views

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class ImageSource:
    """One image at one level; see ``open_image``."""

    path: str
    format: str
    level: int
    shape: tuple[int, ...]
    """(C, *spatial) at this level."""
    stored_dtype: str
    dtype: str = "float32"
    """What the model receives."""
    scale: float | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    fill: float = 0
    key: str | None = None
    channels_last: bool = False
    axes: str | None = None
    mpp: float | None = None
    levels: tuple[tuple[int, ...], ...] = field(default=(), repr=False)
    """Every level's stored (C, *spatial)."""
    crop: Box | None = None
    """A view's region of the stored level (may reach beyond the image: ``fill`` there)."""
    dihedral: int = 0
    """A view's symmetry of the square (``bigconv.data.views``), after the crop."""
    jitter: tuple[float, float] | None = None
    """A view's (contrast, brightness): ``x * contrast + brightness`` after ``scale``."""

    def view(self, crop: Box | None = None, dihedral: int = 0, jitter: tuple[float, float] | None = None
             ) -> "ImageSource":
        """This image cropped, turned or flipped, and colour-jittered: each worker still reads only the
        stored box under its own part of the view."""
        if self.crop is not None or self.dihedral or self.jitter is not None:
            raise ValueError("a view of a view is not supported; make one view of the opened image")
        if dihedral and len(self.spatial) != 2:
            raise ValueError("flips and rotations are for 2D images")
        crop = tuple((0, n) for n in self.spatial) if crop is None else tuple(tuple(map(int, b)) for b in crop)
        if len(crop) != len(self.spatial) or any(b <= a for a, b in crop):
            raise ValueError(f"crop {crop} must give one non-empty (start, stop) per spatial dim of {self.spatial}")
        sizes = tuple(b - a for a, b in crop)
        spatial = views.view_shape(sizes, dihedral) if len(sizes) == 2 else sizes
        return replace(self, crop=crop, dihedral=int(dihedral) % 8, jitter=jitter, shape=(self.shape[0], *spatial))

    @property
    def spatial(self) -> tuple[int, ...]:
        return self.shape[1:]

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def read(self, box: Box | None = None) -> np.ndarray:
        """The stored values of ``box`` (one (start, stop) per spatial dim; None: all), channels first;
        positions outside the image are ``fill``."""
        box = tuple((0, n) for n in self.spatial) if box is None else tuple(tuple(b) for b in box)
        if len(box) != len(self.spatial):
            raise ValueError(f"a box needs {len(self.spatial)} (start, stop) pairs for {self}, got {box}")
        if self.crop is None:
            return self._read_stored(box)
        sizes = tuple(b - a for a, b in self.crop)
        region = views.preimage(box, sizes, self.dihedral) if len(sizes) == 2 else box
        data = self._read_stored(tuple((a + o, b + o) for (a, b), (o, _) in zip(region, self.crop)))
        return views.apply(data, self.dihedral) if len(sizes) == 2 else data

    def _read_stored(self, box: Box) -> np.ndarray:
        stored = self.levels[self.level][1:] if self.levels else self.spatial
        inside = tuple((max(a, 0), min(b, n)) for (a, b), n in zip(box, stored))
        out_shape = (self.shape[0], *(b - a for a, b in box))
        if any(b <= a for a, b in inside):
            return np.full(out_shape, self.fill, dtype=self.stored_dtype)
        try:
            h = readers.handle(self.format, self.path, self.level, self.key)
            data = readers.read_inside(self.format, h, inside, self.level, self.channels_last, self.axes)
        except Exception as exc:  # a worker's traceback alone names neither the slide nor the box
            raise ValueError(f"cannot read {self.path!r} at level {self.level}, box {inside}: "
                             f"{type(exc).__name__}: {exc}") from exc
        if inside == box:
            return data
        out = np.full(out_shape, self.fill, dtype=data.dtype)
        out[(slice(None),) + tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(inside, box))] = data
        return out

    def tensor(self, box: Box | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """``read(box)`` converted as declared: dtype, then scale, then (x - mean) / std per channel.

        In place, into ``out`` when given: a worker's shard is converted without a second copy."""
        raw = self.read(box)
        if raw.dtype.byteorder not in "=|":  # torch takes native byte order only (big-endian .npy files)
            raw = raw.astype(raw.dtype.newbyteorder("="))
        if not raw.flags.writeable or any(s < 0 for s in raw.strides):  # a memmap's view, or a flipped one
            raw = raw.copy()
        data = torch.from_numpy(raw)
        if out is None:
            out = torch.empty(data.shape, dtype=self.torch_dtype)
        if self.scale is not None and out.dtype in (torch.float32, torch.float64):
            # Stored HWC arrives as a CHW view. numpy casts, transposes and scales in one pass over the
            # pixels; torch's strided copy then a multiply was the slower half of a worker's read.
            dst = out.numpy()
            np.multiply(raw, np.asarray(self.scale, dtype=dst.dtype), out=dst, dtype=dst.dtype)
        else:
            out.copy_(data)
            if self.scale is not None:
                out.mul_(self.scale)
        del data
        if self.jitter is not None:
            out.mul_(self.jitter[0]).add_(self.jitter[1])
        view = (-1,) + (1,) * len(self.spatial)
        if self.mean is not None:
            out.sub_(torch.tensor(self.mean, dtype=out.dtype).view(view))
        if self.std is not None:
            out.div_(torch.tensor(self.std, dtype=out.dtype).view(view))
        return out


def open_image(path: str | os.PathLike, level: int | None = None, *, mpp: float | None = None,
               format: str | None = None, dtype: str | torch.dtype = "float32", scale: float | None = None,
               mean: Sequence[float] | None = None, std: Sequence[float] | None = None, fill: float = 0,
               key: str | None = None, channels_last: bool | None = None,
               missing_chunks: str = "warn") -> ImageSource:
    """A source for one image: ``level`` by index (default 0), or the level nearest ``mpp`` microns
    per pixel. Reads only headers. ``channels_last``: how a plain array (npy, zarr) stores channels
    (None: HWC only when the last axis has at most 4 entries and the first more).

    The file's structure is checked here, on the driver, before any remote work: a TIFF whose tile
    table is cut or points past the end of the file is refused; chunks a zarr store lacks (they read
    as the fill value) are named in a warning (``missing_chunks="warn"``), refused (``"error"``) or
    accepted silently (``"fill"``, for stores sparse by design). Complex data is refused; big-endian
    and bool data are converted as they are read."""
    path = os.fspath(path)
    if missing_chunks not in ("warn", "error", "fill"):
        raise ValueError(f"missing_chunks must be 'warn', 'error' or 'fill', got {missing_chunks!r}")
    fmt = format or readers.guess_format(path)
    infos = readers.levels(fmt, path, key, channels_last)
    index = _choose_level(infos, level, mpp, path)
    info = infos[index]
    kind = np.dtype(info.dtype).kind
    if kind not in "biuf":
        raise ValueError(f"{path!r} stores {info.dtype} values ({'complex' if kind == 'c' else 'not real numbers'}); "
                         "a source reads real numbers only: store the real part, magnitude or phase as its own image")
    if fmt == "zarr":
        readers.check_chunks(path, readers.handle(fmt, os.path.abspath(path), index, key), index, missing_chunks)
    dtype_name = _dtype(dtype, converting=scale is not None or mean is not None or std is not None)
    channels = info.shape[0]
    for name, values in (("mean", mean), ("std", std)):
        if values is not None and len(values) not in (1, channels):
            raise ValueError(f"{name} has {len(values)} values but {path!r} has {channels} channels; give one per "
                             "channel (or one for all)")
    return ImageSource(path=os.path.abspath(path), format=fmt, level=index, shape=tuple(info.shape),
                       stored_dtype=info.dtype, dtype=dtype_name, scale=scale,
                       mean=tuple(float(v) for v in mean) if mean is not None else None,
                       std=tuple(float(v) for v in std) if std is not None else None, fill=fill, key=key,
                       channels_last=info.channels_last, axes=info.axes, mpp=info.mpp,
                       levels=tuple(tuple(i.shape) for i in infos))


def _choose_level(infos: list, level: int | None, mpp: float | None, path: str) -> int:
    if level is not None and mpp is not None:
        raise ValueError("give level= or mpp=, not both")
    if mpp is not None:
        known = [(i, info.mpp) for i, info in enumerate(infos) if info.mpp]
        if not known:
            raise ValueError(f"{path!r} records no resolution (microns per pixel); choose a level by index instead")
        best, found = min(known, key=lambda p: abs(np.log(p[1] / mpp)))
        if abs(found / mpp - 1) > 0.1:
            raise ValueError(f"{path!r} has no level near {mpp} µm/px; its levels have "
                             f"{', '.join(f'{m:.3g}' for _, m in known)} µm/px")
        return best
    level = 0 if level is None else level
    if not (isinstance(level, int) and 0 <= level < len(infos)):
        raise ValueError(f"{path!r} has levels 0 to {len(infos) - 1} (shapes {[i.shape for i in infos]}); "
                         f"level {level!r} does not exist")
    return level


def _dtype(dtype, converting: bool) -> str:
    """A torch dtype's name: floating point for images (and whenever scale, mean or std apply); an
    integer one is fine for label maps."""
    name = str(dtype).replace("torch.", "")
    kind = getattr(torch, name, None)
    if not isinstance(kind, torch.dtype) or kind.is_complex or kind == torch.bool:
        raise ValueError(f"dtype {dtype!r} is not a real torch dtype a source can convert to; use float32, float64, "
                         "bfloat16 or float16 for images, int64 for label maps")
    if converting and not kind.is_floating_point:
        raise ValueError(f"dtype {dtype!r} is not a floating-point torch dtype, but scale, mean or std ask for one; "
                         "use float32 (integer dtypes are for label maps, read as stored)")
    return name


def is_source_batch(x) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(s, ImageSource) for s in x)


class SourceBatch:
    """A batch given as sources: the shape and dtype the model sees, without reading a pixel."""

    def __init__(self, sources: Sequence[ImageSource]) -> None:
        sources = list(sources)
        first = sources[0]
        for i, s in enumerate(sources[1:], 1):
            if (s.shape, s.dtype) != (first.shape, first.dtype):
                raise ValueError(
                    f"the sources of one batch must share shape and dtype: item 0 is {first.shape} {first.dtype}, "
                    f"item {i} ({s.path}) is {s.shape} {s.dtype}; crop or choose levels that match"
                )
        self.sources = sources
        self.shape = torch.Size((len(sources), *first.shape))
        self.dtype = first.torch_dtype

    def dim(self) -> int:
        return len(self.shape)

    def read(self, box: Box | None = None) -> torch.Tensor:
        """(N, C, *box) as the model receives it."""
        return read_batch(self.sources, box)


@dataclass(frozen=True)
class ShardRead:
    """What a worker gets instead of its input (or target) shard: the sources and its own box."""

    sources: tuple[ImageSource, ...]
    box: Box
    squeeze_channel: bool = False
    """A label map of one channel for a class-index loss: (N, *spatial), as the loss takes it."""
    check_finite: bool = False
    """Refuse NaN and inf in this box, naming the slide (``parallelize(check_finite=True)``)."""

    def read(self) -> torch.Tensor:
        out = read_batch(self.sources, self.box, self.check_finite)
        return out[:, 0] if self.squeeze_channel else out

    @property
    def stored_bytes(self) -> int:
        """What the read takes from the files (stored dtype, e.g. one byte per uint8 value)."""
        cells = int(np.prod([b - a for a, b in self.box]))
        return sum(s.shape[0] * cells * np.dtype(s.stored_dtype).itemsize for s in self.sources)


def read_batch(sources: Sequence[ImageSource], box: Box | None, check_finite: bool = False) -> torch.Tensor:
    """(N, C, *box): each item converted in place into its slot of one tensor; with ``check_finite``, a
    NaN or inf raises naming the source and the box (each worker checks what it read)."""
    first = sources[0]
    box = tuple((0, n) for n in first.spatial) if box is None else tuple(tuple(b) for b in box)
    out = torch.empty((len(sources), first.shape[0], *(b - a for a, b in box)), dtype=first.torch_dtype)
    for i, s in enumerate(sources):
        s.tensor(box, out=out[i])
        if check_finite and out.is_floating_point() and not bool(torch.isfinite(out[i]).all()):
            bad = int((~torch.isfinite(out[i])).sum())
            raise ValueError(f"{s.path!r}, box {box} of level {s.level}, holds {bad} NaN or infinite values "
                             "(check_finite=True found them); clean the source")
    return out


def class_index_targets(batch: SourceBatch, loss_fn) -> bool:
    """Whether label-map sources feed a class-index loss (CrossEntropy/NLL), which takes (N, *spatial)."""
    from ..losses import LABEL_LOSSES

    return isinstance(loss_fn, LABEL_LOSSES) and not batch.dtype.is_floating_point \
        and batch.shape[1] == 1


def target_stand_in(y, loss_fn) -> torch.Tensor:
    """A meta tensor with the shape and dtype the loss will see for target sources ``y``."""
    batch = SourceBatch(y)
    shape = (batch.shape[0], *batch.shape[2:]) if class_index_targets(batch, loss_fn) else tuple(batch.shape)
    return torch.empty(shape, dtype=batch.dtype, device="meta")


def read_targets(y, loss_fn) -> torch.Tensor:
    """Target sources read whole, as the loss takes them (for single-process references)."""
    batch = SourceBatch(y)
    out = batch.read()
    return out[:, 0] if class_index_targets(batch, loss_fn) else out
