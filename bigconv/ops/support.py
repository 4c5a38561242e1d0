"""Which ``torch.nn`` layers bigconv decomposes, checked when a model is parallelized.

Only built-in ``torch.nn`` layers are judged here; a user's own modules are judged by what their
``forward`` does, in the dry run. Layers listed as "not yet" fail early with the module path.
"""

from __future__ import annotations

import torch.nn as nn

CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
CONV_TRANSPOSE = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
POINTWISE = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish, nn.Sigmoid, nn.Tanh,
    nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softplus, nn.Softsign, nn.Tanhshrink, nn.Threshold,
    nn.LogSigmoid, nn.PReLU, nn.Identity,
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout,
)
POOLING = (
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
)
NORMS = (
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
    nn.GroupNorm, nn.LayerNorm,
)
RESAMPLING = (nn.Upsample, nn.UpsamplingNearest2d, nn.UpsamplingBilinear2d, nn.PixelShuffle, nn.PixelUnshuffle)
PADDING = tuple(getattr(nn, f"{kind}Pad{d}d") for kind in ("Zero", "Constant", "Reflection", "Replication", "Circular")
                for d in (1, 2, 3) if hasattr(nn, f"{kind}Pad{d}d"))
# Exact only after a global reduction, or on maps small enough to be held whole (the dry run checks).
HEAD = (nn.Flatten, nn.Unflatten, nn.Linear, nn.Bilinear, nn.Softmax, nn.LogSoftmax)
CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
SUPPORTED = CONV + CONV_TRANSPOSE + POINTWISE + POOLING + NORMS + RESAMPLING + PADDING + HEAD + CONTAINERS


def check_modules(model: nn.Module) -> None:
    """Raise a ValueError naming the first built-in layer bigconv cannot decompose.

    Only ``torch.nn``'s own layers are judged here; anything else (a user's or a library's
    module) is judged by the operations its ``forward`` runs, in the dry run.
    """
    for name, module in model.named_modules():
        kind = type(module)
        if not kind.__module__.startswith("torch.nn.") or isinstance(module, SUPPORTED):
            continue
        raise ValueError(
            f"layer '{name or '<root>'}' ({kind.__name__}) is not supported by bigconv; supported are "
            "convolutions (any padding mode), transposed convolutions, pooling, normalization, upsampling, "
            "padding and pointwise layers, and a head after global pooling (AdaptiveAvgPoolNd(1), Flatten, Linear)"
        )


def conv_dims(model: nn.Module) -> int | None:
    """Spatial dims of the model's convolutions, or None when it has none."""
    dims = {int(c.__name__[-2]) for m in model.modules() for c in CONV + CONV_TRANSPOSE if isinstance(m, c)}
    if len(dims) > 1:
        raise ValueError(f"the model mixes convolutions of {sorted(dims)} spatial dims; bigconv shards one grid")
    return dims.pop() if dims else None
