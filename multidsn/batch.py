"""``Batch``: one training step's images, checked against a ``DSNConfig`` before any compute."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .config import DSNConfig


@dataclass
class Batch:
    """``source`` is (images_NCHW, labels_N); ``targets`` holds one images_NCHW per target domain.

    Domains may have different batch sizes; every image has the config's channels and size.
    """

    source: tuple[torch.Tensor, torch.Tensor]
    targets: Sequence[torch.Tensor]

    @property
    def images(self) -> list[torch.Tensor]:
        """Every domain's images, source first."""
        return [self.source[0], *self.targets]

    @property
    def labels(self) -> torch.Tensor:
        return self.source[1]

    def to(self, device: torch.device | str) -> "Batch":
        """The same batch on ``device`` (a copy where it moves)."""
        return Batch(source=(self.source[0].to(device), self.source[1].to(device)),
                     targets=[x.to(device) for x in self.targets])

    def check(self, cfg: DSNConfig) -> None:
        """Raise ValueError naming the first problem: target count, image shape or dtype, labels."""
        if not (isinstance(self.source, (tuple, list)) and len(self.source) == 2):
            raise ValueError("Batch.source must be a pair (images_NCHW, labels_N)")
        if isinstance(self.targets, torch.Tensor) or not isinstance(self.targets, (list, tuple)):
            raise ValueError("Batch.targets must be a list with one images_NCHW tensor per target domain")
        if len(self.targets) != cfg.num_targets:
            raise ValueError(f"the batch has {len(self.targets)} target batches but the model has num_targets="
                             f"{cfg.num_targets}; pass exactly one images_NCHW tensor per target domain")
        want = (cfg.channels, cfg.image_size, cfg.image_size)
        dtype = None
        for d, x in enumerate(self.images):
            where = "the source images" if d == 0 else f"target {d}'s images (targets[{d - 1}])"
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"{where} must be a tensor, got {type(x).__name__}")
            if x.dim() != 4 or tuple(x.shape[1:]) != want or x.shape[0] < 1:
                raise ValueError(f"{where} have shape {tuple(x.shape)}; the model expects (N, {want[0]}, {want[1]}, "
                                 f"{want[2]}) with N >= 1 (channels={cfg.channels}, image_size={cfg.image_size})")
            if not x.is_floating_point():
                raise ValueError(f"{where} have dtype {x.dtype}; use floating-point images, e.g. x.float()")
            if dtype is not None and x.dtype != dtype:
                raise ValueError(f"{where} have dtype {x.dtype} but the source images have {dtype}; use one dtype")
            dtype = x.dtype
        self._check_labels(cfg)

    def _check_labels(self, cfg: DSNConfig) -> None:
        x, y = self.source
        if not isinstance(y, torch.Tensor) or y.dim() != 1 or len(y) != len(x):
            shape = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
            raise ValueError(f"source labels must be a 1-D tensor of length {len(x)} (one per source image), "
                             f"got {shape}")
        if y.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            raise ValueError(f"source labels must be integer class indices, got dtype {y.dtype}")
        low, high = int(y.min()), int(y.max())
        if low < 0 or high >= cfg.num_classes:
            raise ValueError(f"source labels range over [{low}, {high}] but num_classes={cfg.num_classes} allows "
                             f"[0, {cfg.num_classes - 1}]; fix the labels or num_classes")
