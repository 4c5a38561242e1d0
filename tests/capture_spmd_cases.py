"""What each SPMD rank runs for ``tests/test_capture_spmd.py``: captures against one process, per rank."""

from __future__ import annotations

import torch
import torch.nn as nn

import bigconv
from bigconv.capture import capture_local


def _errors(got: dict, want: dict) -> dict:
    out = {}
    for name, w in want.items():
        for part in ("output", "grad"):
            a, b = getattr(got[name], part), getattr(w, part)
            if b is None:
                out[f"{name}.{part}"] = 0.0 if a is None else float("inf")
            else:
                out[f"{name}.{part}"] = float((a - b).abs().max() / b.abs().max()) if a.shape == b.shape else float("inf")
    return out


def run() -> dict:
    import segmentation_models_pytorch as smp
    import torchvision

    with bigconv.World.from_env(mode="spmd") as world:
        torch.manual_seed(0)
        classifier = torchvision.models.resnet18(num_classes=5).double().eval()
        x = torch.randn(2, 3, 96, 64, dtype=torch.float64)
        net = bigconv.parallelize(classifier, world, grid=(2, 2)).eval()
        layers = ["layer2", "layer3", "avgpool", "fc"]
        errors = _errors(net.capture(layers, x, target=[1, 4]), capture_local(classifier, layers, x, target=[1, 4]))
        y = torch.tensor([0, 3])
        errors.update({f"loss/{k}": v for k, v in _errors(
            net.capture(["layer3", "fc"], x, y, loss_fn=nn.CrossEntropyLoss()),
            capture_local(classifier, ["layer3", "fc"], x, y, loss_fn=nn.CrossEntropyLoss())).items()})
        torch.manual_seed(0)
        seg = smp.Unet("resnet18", encoder_weights=None, encoder_depth=3, decoder_channels=(32, 16, 16), classes=3,
                       decoder_attention_type="scse").double().eval()
        xs = torch.randn(1, 3, 64, 96, dtype=torch.float64)
        seg_net = bigconv.parallelize(seg, world, grid=(2, 2)).eval()
        se = "decoder.blocks.0.attention1.attention.cSE"
        layers = ["encoder.layer1", f"{se}.0", f"{se}.1", "segmentation_head"]
        errors.update({f"seg/{k}": v for k, v in _errors(seg_net.capture(layers, xs, target=2),
                                                          capture_local(seg, layers, xs, target=2)).items()})
        ys = torch.randint(0, 3, (1, 64, 96))
        errors.update({f"seg-loss/{k}": v for k, v in _errors(
            seg_net.capture(layers, xs, ys, loss_fn=nn.CrossEntropyLoss()),
            capture_local(seg, layers, xs, ys, loss_fn=nn.CrossEntropyLoss())).items()})
        return errors
