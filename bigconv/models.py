"""Reference models: the "vanilla" CNN1D, CNN2D and CNN3D of the ORNL spatial-decomposition study.

Each is ``depth`` blocks of convolution + ReLU, then global average pooling and a linear classifier.
They are plain ``torch.nn`` modules: they train in one process as they are, and on a World after
``bigconv.parallelize``.
"""

from __future__ import annotations

import torch.nn as nn

_CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_POOL = {1: nn.AdaptiveAvgPool1d, 2: nn.AdaptiveAvgPool2d, 3: nn.AdaptiveAvgPool3d}


class VanillaCNN(nn.Module):
    """``depth`` conv+ReLU blocks of ``width`` channels, global average pooling, a linear head."""

    def __init__(self, dims: int, in_channels: int = 1, num_classes: int = 2, width: int = 16, depth: int = 3,
                 kernel_size: int = 3) -> None:
        super().__init__()
        if dims not in _CONV:
            raise ValueError(f"dims must be 1, 2 or 3, got {dims!r}")
        for name, value in (("in_channels", in_channels), ("num_classes", num_classes), ("width", width),
                            ("depth", depth), ("kernel_size", kernel_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        layers: list[nn.Module] = []
        channels = in_channels
        for _ in range(depth):
            layers += [_CONV[dims](channels, width, kernel_size, padding=kernel_size // 2), nn.ReLU(inplace=True)]
            channels = width
        self.features = nn.Sequential(*layers)
        self.pool = _POOL[dims](1)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(width, num_classes))

    def forward(self, x):
        return self.head(self.pool(self.features(x)))


class CNN1D(VanillaCNN):
    def __init__(self, in_channels: int = 1, num_classes: int = 2, width: int = 16, depth: int = 3,
                 kernel_size: int = 3) -> None:
        super().__init__(1, in_channels, num_classes, width, depth, kernel_size)


class CNN2D(VanillaCNN):
    def __init__(self, in_channels: int = 1, num_classes: int = 2, width: int = 16, depth: int = 3,
                 kernel_size: int = 3) -> None:
        super().__init__(2, in_channels, num_classes, width, depth, kernel_size)


class CNN3D(VanillaCNN):
    def __init__(self, in_channels: int = 1, num_classes: int = 2, width: int = 16, depth: int = 3,
                 kernel_size: int = 3) -> None:
        super().__init__(3, in_channels, num_classes, width, depth, kernel_size)
