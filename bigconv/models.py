"""Reference models of the ORNL spatial-decomposition study: CNN1D, CNN2D, CNN3D and FCN2D.

The vanilla CNNs are ``depth`` blocks of convolution + ReLU, then global average pooling and a
linear classifier. FCN2D is a fully convolutional segmentation network. All are plain ``torch.nn``
modules: they train in one process as they are, and on a World after ``bigconv.parallelize``.
"""

from __future__ import annotations

import torch.nn as nn

_CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_POOL = {1: nn.AdaptiveAvgPool1d, 2: nn.AdaptiveAvgPool2d, 3: nn.AdaptiveAvgPool3d}


def _check_sizes(**sizes) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


class VanillaCNN(nn.Module):
    """``depth`` conv+ReLU blocks of ``width`` channels, global average pooling, a linear head."""

    def __init__(self, dims: int, in_channels: int = 1, num_classes: int = 2, width: int = 16, depth: int = 3,
                 kernel_size: int = 3) -> None:
        super().__init__()
        if dims not in _CONV:
            raise ValueError(f"dims must be 1, 2 or 3, got {dims!r}")
        _check_sizes(in_channels=in_channels, num_classes=num_classes, width=width, depth=depth,
                     kernel_size=kernel_size)
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


class FCN2D(nn.Module):
    """A fully convolutional segmentation network in the style of Long et al. (FCN-8s).

    The encoder has ``depth`` stages of two 3x3 convolutions + ReLU and a 2x2 max pooling, with
    ``width * 2**i`` channels at stage ``i``. Each stage's pooled features are scored per class by a
    1x1 convolution; the decoder upsamples the deepest scores by 2 with a learned transposed
    convolution, adds the next stage's scores (skip connection), and repeats up to the input
    resolution. The output has ``num_classes`` channels per pixel, for a per-pixel loss such as
    ``nn.CrossEntropyLoss`` on a label map. Inputs need sides divisible by ``2**depth`` (otherwise the
    skip additions do not line up, and PyTorch says so).
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 2, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        _check_sizes(in_channels=in_channels, num_classes=num_classes, width=width, depth=depth)
        self.depth = depth
        self.stages = nn.ModuleList()
        channels = in_channels
        for i in range(depth):
            out = width * 2**i
            self.stages.append(nn.Sequential(
                nn.Conv2d(channels, out, 3, padding=1), nn.ReLU(inplace=True),
                nn.Conv2d(out, out, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2)))
            channels = out
        self.scores = nn.ModuleList(nn.Conv2d(width * 2**i, num_classes, 1) for i in range(depth))
        self.ups = nn.ModuleList(nn.ConvTranspose2d(num_classes, num_classes, 4, stride=2, padding=1)
                                 for _ in range(depth))

    def forward(self, x):
        features = []
        for stage in self.stages:
            x = stage(x)
            features.append(x)
        y = self.scores[-1](features[-1])
        for i in reversed(range(self.depth - 1)):
            y = self.ups[i + 1](y) + self.scores[i](features[i])
        return self.ups[0](y)


class SlideCNN(nn.Sequential):
    """A small classifier for RGB whole slides: a 4x4 stride-4 stem (so the first activation is a
    sixteenth of the image's positions), two stride-2 convolutions, global pooling, a linear head."""

    def __init__(self, num_classes: int = 2, width: int = 8, in_channels: int = 3) -> None:
        _check_sizes(num_classes=num_classes, width=width, in_channels=in_channels)
        super().__init__(
            nn.Conv2d(in_channels, width, 4, stride=4), nn.ReLU(),
            nn.Conv2d(width, width, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, num_classes),
        )
