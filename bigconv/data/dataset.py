"""``SlideDataset``: slides with labels, cut to their tissue and augmented, batched as lists of sources.

Everything here runs on the driver and reads only each slide's smallest level (to find the tissue);
the items it yields are views (``ImageSource.view``) that the workers read box by box. Augmentation
is drawn per item and epoch from ``seed`` and carried in the view, so every worker applies the same
flip, rotation and colour change to its part: one process on the transformed slide gets the same
pixels.
"""

from __future__ import annotations

import csv
import os
from typing import Iterator, Sequence

import numpy as np
import torch

from . import readers
from .sources import ImageSource, open_image

Box = tuple[tuple[int, int], ...]


def tissue_box(source: ImageSource, threshold: int = 220) -> Box:
    """The bounding box, in ``source``'s level, of pixels darker than ``threshold`` in any channel on
    the smallest level (white glass is ~255); the whole image when there is no such pixel."""
    low_level = len(source.levels) - 1
    low = open_image(source.path, level=low_level, format=source.format, key=source.key).read()
    mask = low.min(axis=0) < threshold
    if not mask.any():
        return tuple((0, n) for n in source.spatial)
    box = []
    for axis, (n_low, n) in enumerate(zip(low.shape[1:], source.spatial)):
        hit = np.flatnonzero(mask.any(axis=tuple(a for a in range(mask.ndim) if a != axis)))
        ratio = n / n_low
        box.append((int(np.floor(hit[0] * ratio)), min(n, int(np.ceil((hit[-1] + 1) * ratio)))))
    return tuple(box)


def _records(items) -> list[tuple[str, object]]:
    """(path, label) pairs from a folder of class subfolders, a CSV of path,label rows, or a list."""
    if isinstance(items, (list, tuple)):
        return [(os.fspath(p), label) for p, label in items]
    items = os.fspath(items)
    if os.path.isdir(items):
        classes = sorted(d for d in os.listdir(items) if os.path.isdir(os.path.join(items, d)))
        out = []
        for label, name in enumerate(classes):
            folder = os.path.join(items, name)
            for f in sorted(os.listdir(folder)):
                path = os.path.join(folder, f)
                try:
                    readers.guess_format(path)
                except ValueError:
                    continue  # not an image: notes, thumbnails, ...
                out.append((path, label))
        if not out:
            raise ValueError(f"{items!r} has no slides in class subfolders (folder/<class>/<slide>)")
        return out
    if items.lower().endswith(".csv"):
        base = os.path.dirname(os.path.abspath(items))
        with open(items, newline="") as fh:
            rows = [r for r in csv.reader(fh) if r and not r[0].startswith("#")]
        if rows and rows[0][0].strip().lower() in ("path", "file", "slide"):
            rows = rows[1:]
        out = []
        for r in rows:
            if len(r) < 2:
                raise ValueError(f"{items!r}: each row needs a path and a label, got {r}")
            path = r[0].strip()
            out.append((path if os.path.isabs(path) else os.path.join(base, path), int(r[1])))
        return out
    raise ValueError(f"SlideDataset takes a folder of class subfolders, a .csv of path,label rows or a list of "
                     f"(path, label); got {items!r}")


class SlideDataset:
    """Slides with labels; ``size`` (H, W) cuts every item to one shape around its tissue (so items
    batch together), ``augment`` adds a random crop within the tissue, one of the 8 flips and
    rotations, and colour jitter (``contrast``, ``brightness``)."""

    def __init__(self, items, *, level: int | None = None, mpp: float | None = None,
                 size: tuple[int, int] | None = None, augment: bool = False, seed: int = 0, threshold: int = 220,
                 contrast: float = 0.1, brightness: float = 0.05, **source_args) -> None:
        source_args.setdefault("fill", 255)
        self.records = _records(items)
        self.sources = [open_image(p, level=level, mpp=mpp, **source_args) for p, _ in self.records]
        self.boxes = [tissue_box(s, threshold) for s in self.sources]
        self.size, self.augment, self.seed = size, augment, seed
        self.contrast, self.brightness = contrast, brightness

    def __len__(self) -> int:
        return len(self.records)

    def item(self, i: int, epoch: int = 0) -> tuple[ImageSource, object]:
        """The view of slide ``i`` in ``epoch`` (the same every time it is asked for) and its label."""
        rng = np.random.default_rng([self.seed, epoch, i])
        box = self.boxes[i]
        if self.size is not None:
            crop = []
            for (a, b), edge in zip(box, self.size):
                slack = (b - a) - edge
                start = a + (int(rng.integers(0, slack + 1)) if self.augment and slack > 0 else slack // 2)
                crop.append((start, start + edge))
            box = tuple(crop)
        dihedral, jitter = 0, None
        if self.augment:
            # A quarter turn swaps height and width: a non-square size keeps to the turns and flips that
            # keep its shape, so the items of a batch still match.
            square = self.size is None or self.size[0] == self.size[1]
            dihedral = int(rng.integers(8)) if square else int(rng.choice([0, 2, 4, 6]))
            jitter = (1 + float(rng.uniform(-self.contrast, self.contrast)),
                      float(rng.uniform(-self.brightness, self.brightness)))
        return self.sources[i].view(crop=box, dihedral=dihedral, jitter=jitter), self.records[i][1]

    def __getitem__(self, i: int) -> tuple[ImageSource, object]:
        return self.item(i)

    def batches(self, batch_size: int, *, shuffle: bool = True, epoch: int = 0, drop_last: bool = False,
                prefetch=None) -> Iterator[tuple[list[ImageSource], torch.Tensor]]:
        """One epoch of (sources, labels): what ``net.train_step`` takes. ``prefetch``: a parallel model
        whose workers start reading each batch while the one before it trains."""
        batches = self._batches(batch_size, shuffle, epoch, drop_last)
        if prefetch is None:
            yield from batches
            return
        current = next(batches, None)
        if current is None:
            return
        prefetch.prefetch(current[0])
        for following in batches:
            prefetch.prefetch(following[0])  # read while ``current`` trains
            yield current
            current = following
        yield current

    def _batches(self, batch_size: int, shuffle: bool, epoch: int,
                 drop_last: bool) -> Iterator[tuple[list[ImageSource], torch.Tensor]]:
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self)) if shuffle \
            else np.arange(len(self))
        for start in range(0, len(order), batch_size):
            pick: Sequence[int] = order[start:start + batch_size]
            if drop_last and len(pick) < batch_size:
                return
            items = [self.item(int(i), epoch) for i in pick]
            yield [s for s, _ in items], torch.tensor([label for _, label in items])
