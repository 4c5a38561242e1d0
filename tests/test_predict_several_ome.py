"""``predict`` of a model with several outputs to an OME-Zarr: one NGFF container (the
``bioformats2raw.layout``), an image per dense output, each its own pyramid.

The model (``heads``) returns HoVerNet/deep-supervision-like outputs in a dict: ``np`` at the input's
resolution (3 channels), ``half`` at half of it (2 channels) and ``cls``, a vector per image (not
written). On a 2x2 grid in float64, both modes: every level of every image against the one-process
output, reduced by the tests' own loop (``test_pyramid.naive_reduce``); the container's and each image's
metadata against the spec (``ome-zarr-models``' independent model of NGFF 0.5, and ``ome-zarr``'s reader
opening each listed series as a viewer does); each image's pixel size from its own stride; per-output
``keep``, ``levels`` and ``classes``; the same images as the series of one OME-TIFF (tifffile); refusals
before remote work; the atomic write. A failure points at
``bigconv.prediction._check_several`` / ``Several`` (what is written where), ``bigconv.data.pyramid``'s
``create_collection`` (the metadata) or ``ModelPart.predict_several`` / ``pyramid.Writers`` (the levels).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn

import bigconv
from bigconv.data import pyramid
from bigconv.data.outputs import MARK_KEY

sys.path.insert(0, os.path.dirname(__file__))
from test_pyramid import naive_reduce  # noqa: E402

MPP = 0.5
KEEP = {"np": ("probabilities", "labels"), "half": "float"}
LEVELS = {"np": 3, "half": 2}
CLASSES = {"np": ["background", "nucleus", "stroma"]}


class Heads(nn.Module):
    """A full-resolution map, a half-resolution map and a vector per image (in a dict)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.down = nn.Conv2d(4, 4, 3, stride=2, padding=1)
        self.np, self.coarse = nn.Conv2d(4, 3, 1), nn.Conv2d(4, 2, 1)
        self.cls = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 5))

    def forward(self, x):
        f = torch.tanh(self.stem(x))
        d = torch.tanh(self.down(f))
        return {"np": self.np(f), "half": self.coarse(d), "cls": self.cls(d)}


def heads() -> nn.Module:
    torch.manual_seed(0)
    return Heads().double()


def image() -> torch.Tensor:
    return torch.randn(1, 3, 128, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def predict_both(net, folder: str) -> list[str]:
    """The two predictions every mode writes: per-output kinds, levels and classes; one kind for all."""
    x = image()
    return [net.predict(x, os.path.join(folder, "pred.ome.zarr"), keep=KEEP, levels=LEVELS, mpp=MPP,
                        classes=CLASSES, max_chunk=16),
            net.predict(x, os.path.join(folder, "f16.ome.zarr"), keep="float16", levels=2, max_chunk=16),
            net.predict(x, os.path.join(folder, "pred.ome.tif"), keep={"np": "labels"}, levels=LEVELS, mpp=MPP,
                        max_chunk=16)]


def spmd_rank(folder: str) -> list[str]:
    with bigconv.World.from_env(mode="spmd") as world:
        return predict_both(bigconv.parallelize(heads(), world, grid=(2, 2)), folder)


def single() -> dict:
    with torch.no_grad():
        return heads()(image())


def series(path: str) -> list:
    """Each image the container lists, opened by ome-zarr's reader as a viewer opens it: its nodes."""
    import zarr
    from ome_zarr.io import parse_url
    from ome_zarr.reader import Reader

    listed = zarr.open_group(os.path.join(path, "OME"), mode="r").attrs["ome"]["series"]
    return [list(Reader(parse_url(os.path.join(path, s)))()) for s in listed]


def assert_levels(nodes: list, want: np.ndarray, kind: str, levels: int) -> None:
    """Every stored level of one image equals the one-process output reduced by the tests' own loop."""
    assert len(nodes) == levels, (kind, len(nodes))
    level = want
    for k, data in enumerate(nodes):
        got = np.asarray(data)
        assert got.shape == level.shape and got.dtype == level.dtype, (kind, k, got.shape, level.shape)
        if got.dtype == np.uint8:
            assert np.array_equal(got, level), (kind, k)
        else:
            tol = (1e-12 if got.dtype == np.float64 else 1e-3) * max(1.0, float(np.abs(level).max()))
            assert np.abs(got.astype(np.float64) - level.astype(np.float64)).max() <= tol, (kind, k)
        level = naive_reduce(level, kind)


def check_container(path: str, full: dict) -> None:
    """The per-output prediction ``pred.ome.zarr``: layout, metadata, pixel sizes and every level."""
    import zarr
    from ome_zarr_models.v05.bioformats2raw import BioFormats2Raw
    from ome_zarr_models.v05.image import Image
    from ome_zarr_models.v05.image_label import ImageLabel

    root = zarr.open_group(path, mode="r")
    assert root.attrs[MARK_KEY]["kind"] == "prediction"
    assert root.attrs["ome"] == {"version": "0.5", "bioformats2raw.layout": 3}
    assert zarr.open_group(os.path.join(path, "OME"), mode="r").attrs["ome"] == {"version": "0.5",
                                                                                  "series": ["0", "1"]}
    assert sorted(root.group_keys()) == ["0", "1", "OME"]  # the vector "cls" is not written
    container = BioFormats2Raw.from_zarr(root)  # NGFF 0.5, by an independent model of the spec
    assert sorted(container.images) == ["0", "1"]
    for s in ("0", "1"):
        Image.from_zarr(root[s])
    ImageLabel.from_zarr(root["0/labels/classes"])

    (np_image, *np_rest), (half_image, *half_rest) = series(path)
    assert not half_rest  # "half" keeps floats only: no label image
    np_label = next(n for n in np_rest if "color" in n.metadata)
    assert [m.metadata["name"] for m in (np_image, half_image)] == ["np", "half"]
    # each image's own pixel: the input's 0.5 µm times its own stride (1 and 2), times 2^k at level k
    for node, stride in ((np_image, 1), (np_label, 1), (half_image, 2)):
        assert [a["name"] for a in node.metadata["axes"]] == ["c", "y", "x"]
        assert node.metadata["axes"][1]["unit"] == "micrometer"
        scales = [t[0] for t in node.metadata["coordinateTransformations"]]
        assert scales == [{"type": "scale", "scale": [1.0, MPP * stride * 2 ** k, MPP * stride * 2 ** k]}
                          for k in range(LEVELS["np" if stride == 1 else "half"])], scales
    assert [np_label.metadata["properties"][i]["class"] for i in range(3)] == CLASSES["np"]

    assert_levels(np_image.data, pyramid.convert("probabilities", full["np"], 3)[0], "probabilities", 3)
    assert_levels(np_label.data, pyramid.convert("labels", full["np"], 3)[0], "labels", 3)
    assert_levels(half_image.data, full["half"][0].numpy(), "float", 2)


def check_one_kind(path: str, full: dict) -> None:
    """``f16.ome.zarr``: one kind and one number of levels for every output; no mpp: pixels in input pixels."""
    (np_image,), (half_image,) = series(path)
    assert_levels(np_image.data, pyramid.convert("float16", full["np"], 3)[0], "float16", 2)
    assert_levels(half_image.data, pyramid.convert("float16", full["half"], 2)[0], "float16", 2)
    assert half_image.metadata["coordinateTransformations"][1][0]["scale"] == [1.0, 4.0, 4.0]  # stride 2 x 2^1
    assert "unit" not in half_image.metadata["axes"][1]


def check_tiff(path: str, full: dict) -> None:
    """``pred.ome.tif``: a series per output in order, each its own pyramid, name and pixel size."""
    import xml.etree.ElementTree as ET

    import tifffile

    with tifffile.TiffFile(path) as tif:
        assert len(tif.series) == 2
        labels, half = tif.series
        level = pyramid.convert("labels", full["np"], 3)[0]
        assert [lv.shape for lv in labels.levels] == [(128, 64), (64, 32), (32, 16)]  # one channel: squeezed
        for lv in labels.levels:
            assert np.array_equal(lv.asarray(), level[0])
            level = naive_reduce(level, "labels")
        level = full["half"][0].numpy()
        assert [lv.shape for lv in half.levels] == [(2, 64, 32), (2, 32, 16)]
        for lv in half.levels:
            assert np.abs(lv.asarray() - level).max() <= 1e-12 * np.abs(level).max()
            level = naive_reduce(level, "float")
        ns = {"ome": "http://www.openmicroscopy.org/Schemas/OME/2016-06"}
        images = ET.fromstring(tif.ome_metadata).findall("ome:Image", ns)
        assert [i.get("Name") for i in images] == ["np", "half"]
        assert [float(i.find("ome:Pixels", ns).get("PhysicalSizeX")) for i in images] == [MPP, 2 * MPP]


@pytest.mark.world(4)
@pytest.mark.timeout(240)
def test_each_output_is_its_own_ngff_image(world, tmp_path):
    net = bigconv.parallelize(heads(), world, grid=(2, 2))
    paths = predict_both(net, str(tmp_path))
    full = single()
    check_container(paths[0], full)
    check_one_kind(paths[1], full)
    check_tiff(paths[2], full)
    assert sorted(os.listdir(tmp_path)) == ["f16.ome.zarr", "pred.ome.tif", "pred.ome.zarr"]  # no temporary sibling

    # overwrite replaces our own; an existing folder that is not ours is refused and left as it was
    with pytest.raises(ValueError, match="exists; choose another out= or pass overwrite=True"):
        net.predict(image(), paths[1], keep="float16", levels=2, max_chunk=16)
    assert net.predict(image(), paths[1], keep="labels", max_chunk=16, overwrite=True) == paths[1]
    (np_image,), _ = series(paths[1])
    assert len(np_image.data) == 1 and np.asarray(np_image.data[0]).dtype == np.uint8

    # a failure while the levels are written leaves the earlier prediction as it was, and no temporary sibling
    launch = net._launch

    def failing(method, args):
        if method == "pyramid_level":
            raise RuntimeError("planted: a worker failed at level 1")
        return launch(method, args)

    net._launch = failing
    with pytest.raises(RuntimeError, match="planted"):
        net.predict(image(), paths[0], keep="float", levels=2, max_chunk=16, overwrite=True)
    net._launch = launch
    check_container(paths[0], full)
    assert sorted(os.listdir(tmp_path)) == ["f16.ome.zarr", "pred.ome.tif", "pred.ome.zarr"]

    theirs = tmp_path / "theirs.ome.zarr"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not written by bigconv"):
        net.predict(image(), str(theirs), overwrite=True)
    assert sorted(os.listdir(theirs)) == ["notes.txt"]
    assert sorted(os.listdir(tmp_path)) == ["f16.ome.zarr", "pred.ome.tif", "pred.ome.zarr", "theirs.ome.zarr"]


@pytest.mark.world(4)
@pytest.mark.timeout(120)
def test_several_ome_refusals_before_remote_work(world, monkeypatch, tmp_path):
    net = bigconv.parallelize(heads(), world, grid=(2, 2))
    monkeypatch.setattr(net, "_launch", lambda *_: pytest.fail("remote work started"))
    x, out = image(), str(tmp_path / "p.ome.zarr")
    refused = [
        (dict(keep={"nuclei": "labels"}),
         r"keep= names \['nuclei'\], but this model's dense outputs are \['np', 'half'\]"),
        (dict(keep={"cls": "float"}), r"keep= names \['cls'\].*vectors are not written"),
        (dict(levels={"half": 9}), r"output 'half' \(\(64, 32\)\): levels=9 is more than"),
        (dict(levels=8), r"output 'half' \(\(64, 32\)\): levels=8 is more than"),  # np halves 8 times (128), half not
        (dict(classes=["a", "b", "c"]), r"classes for output 'half' must name each of its 2 channels"),
        (dict(keep={"half": "labels"}, classes={"half": ["a"]}), r"output 'half' must name each of its 2"),
        (dict(keep={"half": ("float", "float16")}), "one image kind at most"),
    ]
    for kwargs, message in refused:
        with pytest.raises(ValueError, match=message):
            net.predict(x, out, **kwargs)
    for name in (out, str(tmp_path / "p.ome.tif")):
        with pytest.raises(ValueError, match="this batch has 2; predict one slide per call"):
            net.predict(torch.cat([x, x]), name)
    with pytest.raises(ValueError, match=r"output 'np': an OME-TIFF series holds one kind of a 2D output, not float16"):
        net.predict(x, str(tmp_path / "p.ome.tif"), keep={"np": ("probabilities", "labels")})
    with pytest.raises(ValueError, match=r"output 'half': an OME-TIFF series .* \(got keep=\('float16',\)"):
        net.predict(x, str(tmp_path / "p.ome.tif"), keep={"half": "float16"})
    with pytest.raises(ValueError, match="a .zarr group holds one kind, one level and no class names per output"):
        net.predict(x, str(tmp_path / "p.zarr"), levels=2)
    assert os.listdir(tmp_path) == []


@pytest.mark.world(4)
@pytest.mark.timeout(120)
def test_plain_zarr_group_keeps_a_kind_per_output(world, tmp_path):
    """``keep=`` as a dict applies to the plain ``.zarr`` group too: an array of each output's own kind."""
    import zarr

    net = bigconv.parallelize(heads(), world, grid=(2, 2))
    path = net.predict(image(), str(tmp_path / "p.zarr"), keep={"np": "labels"})
    group, full = zarr.open_group(path, mode="r"), single()
    assert sorted(group.array_keys()) == ["half", "np"]
    assert np.array_equal(group["np"][...], pyramid.convert("labels", full["np"], 3))
    assert np.abs(group["half"][...] - full["half"].numpy()).max() <= 1e-12 * full["half"].abs().max().item()


@pytest.mark.own_world
@pytest.mark.timeout(300)
def test_spmd_ranks_write_each_output_as_its_own_image(exclusive, tmp_path):
    from bigconv.runtime import spmd_launch as launch

    per_rank = launch.run(spmd_rank, 4, (str(tmp_path),), timeout=240)
    assert all(p == per_rank[0] for p in per_rank)  # every rank returns the same paths
    full = single()
    check_container(per_rank[0][0], full)
    check_one_kind(per_rank[0][1], full)
    check_tiff(per_rank[0][2], full)
    assert sorted(os.listdir(tmp_path)) == ["f16.ome.zarr", "pred.ome.tif", "pred.ome.zarr"]
