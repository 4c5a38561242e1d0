"""The models a sweep can train, by name: one entry each.

An entry says how to build the model, what its input and target look like, and which input edges
are legal (pooling nets need multiples of 2**depth). Add a model with one ``ModelSpec`` in
``MODELS``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from bigconv import models


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """How to build and feed one model."""

    name: str
    """Registry key, as given to ``--model``."""
    dims: int
    """Spatial dims of the input (1, 2 or 3)."""
    task: str
    """``classify``: one label per image, ``segment``: one label per pixel, ``dsn``: a Domain Separation
    Network trained by ``multidsn.bench`` (1 source + ``targets`` domains)."""
    build: Callable[[int, int, int, int], nn.Module] | None
    """``build(in_channels, num_classes, width, depth)``; None for ``dsn``."""
    edge_multiple: Callable[[int], int] = lambda depth: 1
    """Input edges must be multiples of ``edge_multiple(depth)``."""
    figure: str = ""
    """The ORNL study figure this model reproduces, if any."""

    def __post_init__(self) -> None:
        if self.dims not in (1, 2, 3):
            raise ValueError(f"{self.name}: dims must be 1, 2 or 3, got {self.dims}")
        if self.task not in ("classify", "segment", "dsn"):
            raise ValueError(f"{self.name}: task must be classify or segment, got {self.task!r}")

    def round_size(self, size: int, depth: int) -> int:
        """The nearest legal edge at or below ``size`` (at least one multiple)."""
        m = self.edge_multiple(depth)
        return max(m, size // m * m)

    def target(self, batch: int, size: int, num_classes: int = 2) -> torch.Tensor:
        shape = (batch,) if self.task == "classify" else (batch, *[size] * self.dims)
        return torch.randint(0, num_classes, shape)


def _vanilla(cls) -> Callable[[int, int, int, int], nn.Module]:
    return lambda c, k, width, depth: cls(c, k, width=width, depth=depth)


def _monai_unet(c: int, k: int, width: int, depth: int) -> nn.Module:
    from monai.networks.nets import UNet

    return UNet(2, c, k, channels=tuple(width * 2**i for i in range(depth)), strides=(2,) * (depth - 1),
                num_res_units=1)


MODELS: dict[str, ModelSpec] = {s.name: s for s in (
    ModelSpec(name="cnn1d", dims=1, task="classify", build=_vanilla(models.CNN1D), figure="Figure 2"),
    ModelSpec(name="cnn2d", dims=2, task="classify", build=_vanilla(models.CNN2D), figure="Figure 3"),
    ModelSpec(name="cnn3d", dims=3, task="classify", build=_vanilla(models.CNN3D), figure="Figure 4"),
    ModelSpec(name="fcn2d", dims=2, task="segment", build=_vanilla(models.FCN2D), edge_multiple=lambda d: 2**d,
              figure="Figure 5"),
    ModelSpec(name="unet", dims=2, task="segment", build=_monai_unet, edge_multiple=lambda d: 2 ** (d - 1)),
    ModelSpec(name="dsn", dims=2, task="dsn", build=None, edge_multiple=lambda d: 2**d, figure="Figure 7"),
)}


def spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}") from None
