"""Seeing inside a parallel model (issue 39, items 1-2): ``net.capture`` and ``bigconv.gradcam``.

Each against one process in float64 (``tests/capture_reference.py``: plain forward and tensor hooks, the score's
gradient from ``out[arange(n), target].sum()``, ``F.interpolate``; not the library's ``capture_local``, which shares
the workers' recorder), every tensor within 1e-9 of its own max-norm:

- capture of a zoo classifier (torchvision ResNet-18) and a zoo segmentation model (smp U-Net): outputs,
  and gradients of an output score (``target=``) and of a loss, at sharded maps and at the whole vectors
  after pooling; a module called twice (``name#1``); the model unchanged after a capture;
- Grad-CAM and input-gradient saliency, upsampled to the input grid by the workers, returned whole and
  written as an OME-Zarr pyramid;
- bad input refused before remote work; a module backward hook refused with its real reason.

A failure here points to ``bigconv/capture.py``, ``bigconv/engine/capture.py`` or the capture methods of
``bigconv/runtime/model_part.py``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn as nn
from capture_reference import capture_reference, gradcam_reference

import bigconv

TOL = 1e-9


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, (what, got.shape, want.shape)
    scale = float(want.abs().max())
    assert scale > 0, f"{what}: the reference is zero, the comparison would prove nothing"
    err = float((got - want).abs().max())
    assert err <= TOL * scale, f"{what}: off by {err:.3g} of {scale:.3g}"


def resnet() -> nn.Module:
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=5).double().eval()


def unet() -> nn.Module:
    import segmentation_models_pytorch as smp

    torch.manual_seed(0)
    return smp.Unet("resnet18", encoder_weights=None, encoder_depth=3, decoder_channels=(32, 16, 16), classes=3,
                    decoder_attention_type="scse").double().eval()  # squeeze-excitation: whole vectors mid-map


def same(got: dict, want: dict, grads: bool) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        close(got[name].output, want[name].output, f"{name} output")
        if grads:
            close(got[name].grad, want[name].grad, f"{name} gradient")
        else:
            assert got[name].grad is None


@pytest.mark.world(4)
@pytest.mark.timeout(300)
def test_capture_of_a_classifier_is_exact(world):
    model = resnet()
    x = torch.randn(2, 3, 96, 64, dtype=torch.float64)
    net = bigconv.parallelize(model, world, grid=(2, 2)).eval()
    before = net.state_dict()
    layers = ["layer2", "layer3", "avgpool", "fc"]  # sharded maps, then whole vectors after pooling
    got = net.capture(layers, x, target=[1, 4])
    same(got, capture_reference(model, layers, x, target=[1, 4]), grads=True)
    with torch.no_grad():
        close(got["fc"].output, model(x), "fc against model(x)")
    assert torch.equal(got["fc"].grad, torch.tensor([[0, 1, 0, 0, 0], [0, 0, 0, 0, 1.0]], dtype=torch.float64))
    y = torch.tensor([0, 3])
    same(net.capture(["layer3", "fc"], x, y, loss_fn=nn.CrossEntropyLoss()),
         capture_reference(model, ["layer3", "fc"], x, y, loss_fn=nn.CrossEntropyLoss()), grads=True)
    twice = net.capture("layer1.0.relu", x)  # BasicBlock calls its ReLU twice
    assert sorted(twice) == ["layer1.0.relu", "layer1.0.relu#1"]
    same(twice, capture_reference(model, "layer1.0.relu", x), grads=False)
    after = net.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing changed in the model
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.world(4)
@pytest.mark.timeout(300)
def test_capture_of_a_segmentation_model_is_exact(world):
    model = unet()
    x = torch.randn(1, 3, 64, 96, dtype=torch.float64)
    net = bigconv.parallelize(model, world, grid=(2, 2)).eval()
    # a sharded map, a whole vector after pooling whose gradient each shard's copy carries a part of, a 1x1
    # convolution's output that an in-place ReLU overwrites next, and the output
    se = "decoder.blocks.0.attention1.attention.cSE"
    layers = ["encoder.layer1", f"{se}.0", f"{se}.1", "decoder", "segmentation_head"]
    got = net.capture(layers, x, target=2)
    same(got, capture_reference(model, layers, x, target=2), grads=True)
    # checks independent of the hooks the reference shares: the copy precedes the in-place ReLU, and the last
    # capture is the model's output, whose score gradient is one at class 2
    assert (got[f"{se}.1"].output < 0).any(), "captured after the in-place ReLU overwrote it"
    with torch.no_grad():
        close(got["segmentation_head"].output, model(x), "the output against model(x)")
    assert torch.equal(got["segmentation_head"].grad[0, 2], torch.ones(64, 96))
    assert not got["segmentation_head"].grad[0, :2].any()
    y = torch.randint(0, 3, (1, 64, 96))
    same(net.capture(layers, x, y, loss_fn=nn.CrossEntropyLoss()),
         capture_reference(model, layers, x, y, loss_fn=nn.CrossEntropyLoss()), grads=True)


@pytest.mark.world(4)
@pytest.mark.timeout(300)
def test_gradcam_and_saliency_are_exact_and_written_as_a_pyramid(world, tmp_path):
    import zarr
    from ome_zarr.io import parse_url
    from ome_zarr.reader import Reader

    from bigconv.data import pyramid

    model = resnet()
    x = torch.randn(2, 3, 128, 96, dtype=torch.float64)
    net = bigconv.parallelize(model, world, grid=(2, 2)).eval()
    for layer in ("layer2", "layer3"):  # maps of 16 x 12 and 8 x 6: upsampling across shard edges
        cam = bigconv.gradcam(net, x, layer=layer, target=[2, 0])
        close(cam, gradcam_reference(model, x, layer=layer, target=[2, 0]), f"Grad-CAM at {layer}")
        assert cam.shape == (2, 1, 128, 96)
    close(bigconv.gradcam(net, x, target=[2, 0], method="saliency"),
          gradcam_reference(model, x, target=[2, 0], method="saliency"), "saliency")
    seg = unet()
    seg_net = bigconv.parallelize(seg, world, grid=(2, 2)).eval()
    xs = torch.randn(1, 3, 64, 96, dtype=torch.float64)
    close(bigconv.gradcam(seg_net, xs, layer="encoder.layer2", target=1),
          gradcam_reference(seg, xs, layer="encoder.layer2", target=1), "Grad-CAM of a segmentation model")

    path = bigconv.gradcam(net, x[:1], layer="layer3", target=2, out=tmp_path / "cam.ome.zarr", levels=3, mpp=0.5)
    assert sorted(os.listdir(tmp_path)) == ["cam.ome.zarr"]
    want = gradcam_reference(model, x[:1], layer="layer3", target=2)[0].numpy()
    node = list(Reader(parse_url(path))())[0]
    assert [tuple(d.shape) for d in node.data] == [(1, 128, 96), (1, 64, 48), (1, 32, 24)]
    assert node.metadata["coordinateTransformations"][2][0]["scale"] == [1.0, 2.0, 2.0]
    close(torch.from_numpy(np.asarray(node.data[0])), torch.from_numpy(want), "written Grad-CAM")
    stored = zarr.open_array(os.path.join(path, "0"), mode="r")[:]
    assert np.array_equal(np.asarray(node.data[1]), pyramid.reduce(stored, "float", 2))
    flat = bigconv.gradcam(net, x, layer="layer3", target=[2, 0], out=tmp_path / "cam.zarr")
    close(torch.from_numpy(zarr.open_array(flat, mode="r")[:]),
          gradcam_reference(model, x, layer="layer3", target=[2, 0]), "Grad-CAM in a zarr array")


@pytest.mark.world(4)
@pytest.mark.timeout(120)
def test_bad_captures_are_refused_before_remote_work(world, rpc_calls):
    net = bigconv.parallelize(resnet(), world, grid=(2, 2)).eval()
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    net.plan(x)
    rpc_calls.clear()
    for call, words in [(lambda: net.capture("layer9", x), "no module named 'layer9'"),
                        (lambda: net.capture(["layer4"], x, target=5), r"target must be a class index in \[0, 5\)"),
                        (lambda: net.capture(["layer4"], x, target=[1]), "one per image"),
                        (lambda: net.capture(["layer4"], x, torch.tensor([0, 1])), "needs both y= and loss_fn="),
                        (lambda: net.capture(["layer4"], x, torch.tensor([0, 1]), nn.CrossEntropyLoss(), target=1),
                         "not both"),
                        (lambda: bigconv.gradcam(net, x, target=1), "needs layer="),
                        (lambda: bigconv.gradcam(net, x, layer="layer4", target=1, method="cam"), "method must be")]:
        with pytest.raises(ValueError, match=words):
            call()
    assert rpc_calls == []


def test_a_module_backward_hook_is_refused_with_its_real_reason():
    model = resnet()
    handle = model.layer4.register_full_backward_hook(lambda *a: None)
    planner_error = None
    try:
        from bigconv.planning import Planner

        Planner(model, (2, 2), 4, False)
    except ValueError as exc:
        planner_error = str(exc)
    handle.remove()
    assert planner_error is not None and "backward hooks are registered on layer4" in planner_error
    assert "shard's gradient" in planner_error and "net.capture" in planner_error
    assert "Flatten" not in planner_error
    from bigconv.planning import Planner

    Planner(model, (2, 2), 4, False)  # without the hook: accepted


@pytest.mark.world(4)
@pytest.mark.timeout(300)
def test_captures_written_by_the_workers(world, tmp_path):
    """Slide-sized captures: each worker writes its region of each map (a whole vector: worker 0, its
    gradient summed on the driver) into a zarr group, moved into place when all are done."""
    model = resnet()
    x = torch.randn(2, 3, 96, 64, dtype=torch.float64)
    net = bigconv.parallelize(model, world, grid=(2, 2)).eval()
    layers = ["layer2", "layer1.0.relu", "avgpool", "fc"]
    got = net.capture(layers, x, target=[1, 4], out=tmp_path / "caps.zarr")
    want = capture_reference(model, layers, x, target=[1, 4])
    assert sorted(got) == sorted(want) and sorted(os.listdir(tmp_path)) == ["caps.zarr"]
    for key in want:
        close(torch.from_numpy(got[key].output[...]), want[key].output, f"written {key}")
        close(torch.from_numpy(got[key].grad[...]), want[key].grad, f"written gradient of {key}")
    (tmp_path / "mine").mkdir()
    with pytest.raises(ValueError, match="was not written by bigconv"):
        net.capture("layer2", x, out=tmp_path / "mine", overwrite=True)
    again = net.capture("layer2", x, out=tmp_path / "caps.zarr", overwrite=True)  # its own: replaced
    assert sorted(again) == ["layer2"] and again["layer2"].grad is None
