"""What each SPMD rank runs for ``tests/test_capture_spmd.py``: captures against one process (plain torch:
``tests/capture_reference.py``), per rank."""

from __future__ import annotations

import torch
import torch.nn as nn
from capture_reference import capture_reference, gradcam_reference

import bigconv


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


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max()) if a.shape == b.shape else float("inf")


def gradcams(world, out_dir: str) -> dict:
    """Grad-CAM and saliency through ``bigconv.gradcam`` on the ranks (maps gathered, and written)."""
    import os

    import numpy as np
    import torchvision
    import zarr

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=5).double().eval()
    x = torch.randn(2, 3, 128, 96, dtype=torch.float64)
    net = bigconv.parallelize(model, world, grid=(2, 2)).eval()
    errors = {}
    for layer in ("layer2", "layer3"):  # maps of 16 x 12 and 8 x 6: upsampling across shard edges
        errors[f"gradcam/{layer}"] = _rel(bigconv.gradcam(net, x, layer=layer, target=[2, 0]),
                                          gradcam_reference(model, x, layer=layer, target=[2, 0]))
    errors["saliency"] = _rel(bigconv.gradcam(net, x, target=[2, 0], method="saliency"),
                              gradcam_reference(model, x, target=[2, 0], method="saliency"))
    want = gradcam_reference(model, x[:1], layer="layer3", target=2)
    path = bigconv.gradcam(net, x[:1], layer="layer3", target=2, out=os.path.join(out_dir, "cam.ome.zarr"), levels=3)
    errors["written/ome.zarr"] = _rel(torch.from_numpy(np.asarray(zarr.open_array(os.path.join(path, "0"))[:])),
                                      want[0])
    flat = bigconv.gradcam(net, x, layer="layer3", target=[2, 0], out=os.path.join(out_dir, "cam.zarr"))
    errors["written/zarr"] = _rel(torch.from_numpy(zarr.open_array(flat, mode="r")[:]),
                                  gradcam_reference(model, x, layer="layer3", target=[2, 0]))
    errors["written/listing"] = 0.0 if sorted(os.listdir(out_dir)) == ["cam.ome.zarr", "cam.zarr"] else float("inf")
    return errors


def run(out_dir: str | None = None) -> dict:
    import segmentation_models_pytorch as smp
    import torchvision

    with bigconv.World.from_env(mode="spmd") as world:
        torch.manual_seed(0)
        classifier = torchvision.models.resnet18(num_classes=5).double().eval()
        x = torch.randn(2, 3, 96, 64, dtype=torch.float64)
        net = bigconv.parallelize(classifier, world, grid=(2, 2)).eval()
        layers = ["layer2", "layer3", "avgpool", "fc"]
        errors = _errors(net.capture(layers, x, target=[1, 4]),
                         capture_reference(classifier, layers, x, target=[1, 4]))
        y = torch.tensor([0, 3])
        errors.update({f"loss/{k}": v for k, v in _errors(
            net.capture(["layer3", "fc"], x, y, loss_fn=nn.CrossEntropyLoss()),
            capture_reference(classifier, ["layer3", "fc"], x, y, loss_fn=nn.CrossEntropyLoss())).items()})
        torch.manual_seed(0)
        seg = smp.Unet("resnet18", encoder_weights=None, encoder_depth=3, decoder_channels=(32, 16, 16), classes=3,
                       decoder_attention_type="scse").double().eval()
        xs = torch.randn(1, 3, 64, 96, dtype=torch.float64)
        seg_net = bigconv.parallelize(seg, world, grid=(2, 2)).eval()
        se = "decoder.blocks.0.attention1.attention.cSE"
        layers = ["encoder.layer1", f"{se}.0", f"{se}.1", "segmentation_head"]
        errors.update({f"seg/{k}": v for k, v in _errors(seg_net.capture(layers, xs, target=2),
                                                          capture_reference(seg, layers, xs, target=2)).items()})
        ys = torch.randint(0, 3, (1, 64, 96))
        errors.update({f"seg-loss/{k}": v for k, v in _errors(
            seg_net.capture(layers, xs, ys, loss_fn=nn.CrossEntropyLoss()),
            capture_reference(seg, layers, xs, ys, loss_fn=nn.CrossEntropyLoss())).items()})
        if out_dir is not None:
            errors.update(gradcams(world, out_dir))
        return errors
