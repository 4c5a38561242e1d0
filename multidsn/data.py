"""Data for DSN training: a procedural multi-domain benchmark and a loader for real image folders.

A ``Domain`` holds a training split (labels optional: targets are trained without them) and a
labelled test split, used for evaluation only.

Procedural benchmark: the source is scikit-learn's bundled handwritten digits (1,797 real 8 x 8 scans,
scaled up to ``image_size`` with an MNIST-like margin, grey on black, three channels). Each target
applies one shift of ``multidsn.shifts`` to the same digit pool, as MNIST-M is made from MNIST; test
digits are held out from training in every domain.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .batch import Batch
from .shifts import SHIFTS

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff")


@dataclass
class Domain:
    name: str
    train_x: torch.Tensor
    """(N, C, H, W) float32: in [0, 1] as loaded, zero mean and unit variance per image once ``standardized``."""
    train_y: torch.Tensor | None
    """Labels of the training split, or None for an unlabelled domain."""
    test_x: torch.Tensor
    test_y: torch.Tensor | None
    test_light: torch.Tensor | None = None
    """Per test image, whether its strokes are brighter than its background (bool), where the generator
    knows it (``multidsn.mnist``'s MNIST-M-style target); accuracy is then also reported per polarity."""


def digits(image_size: int, seed: int, test_fraction: float) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """Grey digits (N, 1, S, S) in [0, 1], labels, and a boolean test mask."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise ImportError("the procedural benchmark's source is scikit-learn's load_digits; "
                          "pip install scikit-learn (or bigconv[data])") from exc
    raw = load_digits()
    x = torch.from_numpy(raw.images.astype(np.float32) / 16.0)[:, None]
    inner = max(1, round(image_size * 20 / 28))  # MNIST: a 20 px digit in a 28 px frame
    x = F.interpolate(x, size=(inner, inner), mode="bilinear", align_corners=False).clamp(0, 1)
    lo = (image_size - inner) // 2
    x = F.pad(x, (lo, image_size - inner - lo, lo, image_size - inner - lo))
    rng = np.random.default_rng(seed)
    test = np.zeros(len(x), dtype=bool)
    test[rng.permutation(len(x))[: int(round(test_fraction * len(x)))]] = True
    return x, torch.from_numpy(raw.target).long(), test


def procedural_domains(num_targets: int, image_size: int = 28, seed: int = 0, test_fraction: float = 0.2,
                       shifts: list[str] | None = None) -> tuple[Domain, list[Domain]]:
    """(source, targets): clean digits and ``num_targets`` shifted copies (the first K of ``SHIFTS``)."""
    names = list(shifts) if shifts is not None else list(SHIFTS)[:num_targets]
    unknown = [n for n in names if n not in SHIFTS]
    if unknown:
        raise ValueError(f"unknown shift(s) {unknown}; choose from {list(SHIFTS)}")
    if len(names) != num_targets:
        raise ValueError(f"{num_targets} targets asked for but {len(names)} shifts available/given "
                         f"({names}); the benchmark has {len(SHIFTS)} shifts")
    x, y, test = digits(image_size, seed, test_fraction)
    grey = x.expand(-1, 3, -1, -1).contiguous()
    source = Domain("digits", grey[~test], y[~test], grey[test], y[test])
    targets = []
    for k, name in enumerate(names):
        rng = np.random.default_rng([seed, k + 1])
        shifted = SHIFTS[name](x, rng).contiguous()
        targets.append(Domain(name, shifted[~test], y[~test], shifted[test], y[test]))
    return source, targets


def load_folder_domains(root: str | Path, source: str, image_size: int, channels: int = 3, seed: int = 0,
                        test_fraction: float = 0.2) -> tuple[Domain, list[Domain]]:
    """Real data, one folder per domain under ``root``: ``root/<domain>/<class>/*.png`` for a labelled
    domain (class folders sorted by name give the label indices), or ``root/<domain>/*.png`` for an
    unlabelled one. ``source`` names the labelled source folder; the others, sorted, are the targets.
    A target without labels gets an unlabelled test split (no accuracy can be reported for it)."""
    root = Path(root)
    folders = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    if not folders:
        raise ValueError(f"{root} has no domain folders; expected {root}/<domain>/<class>/<image>")
    names = [p.name for p in folders]
    if source not in names:
        raise ValueError(f"source domain {source!r} is not a folder of {root}; found {names}")
    classes = sorted(p.name for p in (root / source).iterdir() if p.is_dir())
    if not classes:
        raise ValueError(f"the source folder {root / source} needs one sub-folder per class")
    domains = {}
    for k, folder in enumerate(folders):
        x, y = _read_folder(folder, classes, image_size, channels)
        rng = np.random.default_rng([seed, k])
        test = np.zeros(len(x), dtype=bool)
        test[rng.permutation(len(x))[: int(round(test_fraction * len(x)))]] = True
        domains[folder.name] = Domain(folder.name, x[~test], None if y is None else y[~test], x[test],
                                      None if y is None else y[test])
    if domains[source].train_y is None:
        raise ValueError(f"the source folder {root / source} has no labelled images")
    return domains[source], [domains[n] for n in names if n != source]


def _read_folder(folder: Path, classes: list[str], image_size: int, channels: int):
    from PIL import Image

    subdirs = [p for p in folder.iterdir() if p.is_dir()]
    if subdirs:
        extra = sorted({p.name for p in subdirs} - set(classes))
        if extra:
            raise ValueError(f"{folder} has class folders {extra} that the source does not have ({classes})")
        files = [(f, classes.index(p.name)) for p in sorted(subdirs) for f in sorted(p.iterdir())
                 if f.suffix.lower() in IMAGE_SUFFIXES]
    else:
        files = [(f, -1) for f in sorted(folder.iterdir()) if f.suffix.lower() in IMAGE_SUFFIXES]
    if not files:
        raise ValueError(f"{folder} holds no images ({', '.join(IMAGE_SUFFIXES)})")
    mode = {1: "L", 3: "RGB"}.get(channels)
    if mode is None:
        raise ValueError(f"image folders can be read as 1 or 3 channels, not {channels}")
    arrays = [np.asarray(Image.open(f).convert(mode).resize((image_size, image_size)), dtype=np.float32) / 255.0
              for f, _ in files]
    x = torch.from_numpy(np.stack(arrays)).reshape(len(arrays), image_size, image_size, channels).permute(0, 3, 1, 2)
    labels = [label for _, label in files]
    return x.contiguous(), (None if labels[0] < 0 else torch.tensor(labels))


def standardize(x_NCHW: torch.Tensor, eps: float = 1e-3) -> torch.Tensor:
    """Each image shifted to zero mean and scaled to unit standard deviation over all its pixels and channels
    (TF's per_image_standardization). It removes a domain's global brightness and contrast, which no
    convolution of a small source can learn to ignore, and keeps the relations between colours."""
    flat = x_NCHW.flatten(1)
    mean, std = flat.mean(1), flat.std(1, unbiased=False).clamp_min(eps)
    return (x_NCHW - mean[:, None, None, None]) / std[:, None, None, None]


def standardized(domain: Domain) -> Domain:
    """``domain`` with both splits ``standardize``d (labels shared, not copied)."""
    return Domain(domain.name, standardize(domain.train_x), domain.train_y, standardize(domain.test_x), domain.test_y)


class Sampler:
    """Random training batches: labelled source images plus one unlabelled batch per target."""

    def __init__(self, source: Domain, targets: list[Domain], batch_size: int, seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> None:
        if source.train_y is None:
            raise ValueError(f"the source domain {source.name!r} has no labels")
        self.source, self.targets, self.batch_size, self.dtype = source, targets, batch_size, dtype
        self.gen = torch.Generator().manual_seed(seed)

    def _pick(self, n: int) -> torch.Tensor:
        return torch.randint(0, n, (self.batch_size,), generator=self.gen)

    def __next__(self) -> Batch:
        i = self._pick(len(self.source.train_x))
        return Batch(source=(self.source.train_x[i].to(self.dtype), self.source.train_y[i]),
                     targets=[t.train_x[self._pick(len(t.train_x))].to(self.dtype) for t in self.targets])

    def __iter__(self) -> "Sampler":
        return self
