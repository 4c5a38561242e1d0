"""Which ``torch.nn`` layers bigconv decomposes, checked when a model is parallelized.

Only built-in ``torch.nn`` layers are judged here; a user's own modules are judged by what their
``forward`` does, in the dry run. Layers listed as "not yet" fail early with the module path.
"""

from __future__ import annotations

import torch.nn as nn

CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
POINTWISE = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish, nn.Sigmoid, nn.Tanh,
    nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softplus, nn.Softsign, nn.Tanhshrink, nn.Threshold,
    nn.LogSigmoid, nn.PReLU, nn.Identity,
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout,
)
# Exact only after a global reduction (the dry run checks where they are used).
HEAD = (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.Flatten, nn.Unflatten, nn.Linear,
        nn.Bilinear, nn.Softmax, nn.LogSoftmax)
CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
SUPPORTED = CONV + POINTWISE + HEAD + CONTAINERS


def check_modules(model: nn.Module) -> None:
    """Raise a ValueError naming the first built-in layer bigconv cannot decompose yet."""
    for name, module in model.named_modules():
        kind = type(module)
        if not kind.__module__.startswith("torch.nn.") or isinstance(module, SUPPORTED):
            if isinstance(module, CONV) and module.padding_mode != "zeros":
                raise ValueError(
                    f"layer '{name}' ({kind.__name__}) uses padding_mode={module.padding_mode!r}; bigconv "
                    "supports padding_mode='zeros' so far. Use zero padding, or wait for padding-mode support"
                )
            continue
        raise ValueError(
            f"layer '{name or '<root>'}' ({kind.__name__}) is not supported by bigconv yet; supported are "
            "convolutions, pointwise layers and a head after global average pooling "
            "(AdaptiveAvgPoolNd(1), Flatten, Linear)"
        )


def conv_dims(model: nn.Module) -> int | None:
    """Spatial dims of the model's convolutions, or None when it has none."""
    dims = {int(c.__name__[-2]) for m in model.modules() for c in CONV if isinstance(m, c)}
    if len(dims) > 1:
        raise ValueError(f"the model mixes convolutions of {sorted(dims)} spatial dims; bigconv shards one grid")
    return dims.pop() if dims else None
