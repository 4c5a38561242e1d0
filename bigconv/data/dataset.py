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


PATH_HEADERS = ("path", "file", "filename", "slide", "slide_id", "slide_path", "image", "image_id", "image_path",
                "id", "name")
LABEL_HEADERS = ("label", "labels", "class", "class_name", "target", "y", "diagnosis", "category")


def _records(items, columns: tuple[str, str] | None = None) -> list[tuple[str, object]]:
    """(path, label) pairs from a folder of class subfolders, a CSV of path,label rows, or a list;
    labels as given (ints or class names; ``class_indices`` maps names)."""
    if isinstance(items, (list, tuple)):
        out = []
        for i, item in enumerate(items):
            if not (isinstance(item, (list, tuple)) and len(item) == 2):
                raise ValueError(f"item {i} of the list is {item!r}; give (path, label) pairs")
            out.append((os.fspath(item[0]), item[1]))
        return out
    items = os.fspath(items)
    if os.path.isdir(items):
        return _folder_records(items)
    if items.lower().endswith(".csv"):
        return _csv_records(items, columns)
    raise ValueError(f"SlideDataset takes a folder of class subfolders, a .csv of path,label rows or a list of "
                     f"(path, label); got {items!r}")


def _folder_records(items: str) -> list[tuple[str, object]]:
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


def _csv_records(items: str, columns: tuple[str, str] | None) -> list[tuple[str, object]]:
    """Rows of a CSV: a header row is recognised by its names (``PATH_HEADERS``, ``LABEL_HEADERS``) or
    named by ``columns=(path column, label column)``; row numbers in errors are the file's lines."""
    base = os.path.dirname(os.path.abspath(items))
    with open(items, newline="") as fh:
        rows = [(n, r) for n, r in enumerate(csv.reader(fh), 1) if r and not r[0].lstrip().startswith("#")]
    cols = (0, 1)
    if rows:
        head = [c.strip().lower() for c in rows[0][1]]
        if columns is not None:
            wanted = [c.strip().lower() for c in columns]
            missing = [c for c in wanted if c not in head]
            if missing:
                raise ValueError(f"{items!r}: its first row {rows[0][1]} has no column {missing[0]!r} of columns="
                                 f"{tuple(columns)}; name the header's path and label columns")
            cols = (head.index(wanted[0]), head.index(wanted[1]))
            rows = rows[1:]
        elif head and (head[0] in PATH_HEADERS or (len(head) > 1 and head[1] in LABEL_HEADERS)):
            rows = rows[1:]
    out = []
    for n, r in rows:
        if len(r) <= max(cols) or not r[cols[0]].strip() or not r[cols[1]].strip():
            raise ValueError(f"{items!r} row {n}: needs a path and a label, got {r}; fix the row (or name the "
                             "columns with columns=(path, label))")
        path, label = r[cols[0]].strip(), r[cols[1]].strip()
        out.append((path if os.path.isabs(path) else os.path.join(base, path), _label(label)))
    return out


def _label(text: str) -> object:
    try:
        return int(text)
    except ValueError:
        return text  # a class name


def class_indices(records: list[tuple[str, object]]) -> tuple[list[tuple[str, int]], list[str] | None]:
    """Records with integer labels, and the class names (index -> name) when the labels were names.

    Integer labels stay as they are; names map to their index in sorted order. A mix is refused:
    it is usually a typo or a shifted column."""
    labels = [label for _, label in records]
    bad = [(i, label) for i, label in enumerate(labels) if isinstance(label, bool) or not isinstance(label, (int, str))]
    if bad:
        raise ValueError(f"slide {records[bad[0][0]][0]!r} has the label {bad[0][1]!r}; labels are integer classes "
                         "or class names")
    names = [label for label in labels if isinstance(label, str)]
    if not names:
        return [(p, int(label)) for p, label in records], None
    if len(names) != len(labels):
        i = next(i for i, label in enumerate(labels) if not isinstance(label, str))
        raise ValueError(f"slide {records[i][0]!r} has the integer label {labels[i]!r} among class names "
                         f"(e.g. {names[0]!r}); give every slide a class name or every slide an integer")
    classes = sorted(set(names))
    index = {name: i for i, name in enumerate(classes)}
    return [(p, index[label]) for p, label in records], classes


class SlideDataset:
    """Slides with labels; ``size`` (H, W) cuts every item to one shape around its tissue (so items
    batch together), ``augment`` adds a random crop within the tissue, one of the 8 flips and
    rotations, and colour jitter (``contrast``, ``brightness``)."""

    def __init__(self, items, *, level: int | None = None, mpp: float | None = None,
                 size: tuple[int, int] | None = None, augment: bool = False, seed: int = 0, threshold: int = 220,
                 contrast: float = 0.1, brightness: float = 0.05, columns: tuple[str, str] | None = None,
                 **source_args) -> None:
        source_args.setdefault("fill", 255)
        self.records, self.classes = class_indices(_records(items, columns))
        """``classes``: the class names when labels were given as names (label i is ``classes[i]``; sorted),
        else None. Folders give their subfolders' names. Keep it with a checkpoint, e.g.
        ``net.save(path, extra={"classes": ds.classes})``."""
        if self.classes is None and not isinstance(items, (list, tuple)) and os.path.isdir(os.fspath(items)):
            root = os.fspath(items)
            self.classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
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
