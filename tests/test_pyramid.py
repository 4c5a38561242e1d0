"""Predictions as pyramids a slide viewer opens (issue 39, items 3-5).

- ``reduce`` is a 2x2 block mean (labels: nearest), checked against a loop over blocks, and a region's
  reduction is that part of the whole array's;
- the workers' regions of every level never share a chunk, and the writers of a pyramid (run here in one
  process, one per shard, level by level) produce the one-process pyramid bit for bit, from their own
  regions and, where a boundary is off the halved grid, from the level stored above;
- ``predict(out="x.ome.zarr")`` on a World is opened with ``ome-zarr``'s reader and validated with
  ``ome-zarr-models`` (NGFF 0.5): every level's shape, the scale metadata (microns per pixel times the
  model's stride times 2^k), the label image, and values against one process; ``x.ome.tif`` is opened
  with tifffile's series and levels;
- what is kept: uint8 probabilities, argmax labels, float16.

A failure here points to ``bigconv/data/pyramid.py`` or ``bigconv/prediction.py``.
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch
import torch.nn as nn

import bigconv
from bigconv.data import pyramid
from bigconv.data.outputs import MARK_KEY

MPP = 0.25


def naive_reduce(a: np.ndarray, kind: str) -> np.ndarray:
    """The next level by a loop over (C, y, x) blocks: the mean of what lies in each (labels: its first)."""
    c, h, w = a.shape
    out = np.zeros((c, -(-h // 2), -(-w // 2)), dtype=a.dtype)
    for i, j in itertools.product(range(out.shape[1]), range(out.shape[2])):
        block = a[:, 2 * i:2 * i + 2, 2 * j:2 * j + 2]
        if kind == "labels":
            out[:, i, j] = block[:, 0, 0]
        else:
            m = block.astype(np.float64).reshape(c, -1).mean(axis=1)
            out[:, i, j] = np.clip(np.rint(m), 0, 255) if a.dtype == np.uint8 else m
    return out


@pytest.mark.parametrize("kind,dtype", [("float", np.float64), ("float16", np.float16), ("probabilities", np.uint8),
                                        ("labels", np.uint8)])
def test_reduce_is_a_block_mean_and_regions_reduce_as_the_whole(kind, dtype):
    rng = np.random.default_rng(0)
    a = (rng.integers(0, 256, (2, 13, 10)) if dtype == np.uint8 else rng.standard_normal((2, 13, 10))).astype(dtype)
    whole = pyramid.reduce(a, kind, 2)
    want = naive_reduce(a, kind)
    if dtype == np.float64:
        assert np.allclose(whole, want, rtol=1e-14, atol=1e-15)
    else:
        assert np.array_equal(whole, want)
    assert whole.shape == (2, 7, 5)
    # an even-started region reduces to its part of the whole, bit for bit
    assert np.array_equal(pyramid.reduce(a[:, 4:13, 2:10], kind, 2), whole[:, 2:7, 1:5])


def test_level_bounds_give_every_chunk_one_writer():
    for spatial, grid, chunk in [((200, 120), (2, 2), 32), ((3000, 3000), (3, 2), 1024), ((1000, 96), (4, 1), 1024)]:
        spec = pyramid.spec_for(("float",), 2, "float32", spatial, grid, None, chunk, ome=True)
        for k, shape in enumerate(spec.shapes):
            for a, n in enumerate(shape):
                b = spec.bounds[k][a]
                assert b[0] == 0 and b[-1] == n and list(b) == sorted(b)
                assert all(x % spec.chunks[a] == 0 or x == n for x in b[1:-1]), (k, a, b)  # no chunk has two writers
        assert max(spec.shapes[-1]) <= 512


class CountingReads:
    """Counts the reads of stored levels (the writers' fallback) through zarr.open_array(mode="r")."""

    def __init__(self, monkeypatch):
        import zarr

        self.reads = 0
        real = zarr.open_array

        def counting(path, mode="r", **kw):
            self.reads += mode == "r"
            return real(path, mode=mode, **kw)

        monkeypatch.setattr(zarr, "open_array", counting)


def test_writers_of_every_shard_build_the_one_process_pyramid(tmp_path, monkeypatch):
    """One writer per shard of a (3, 2) grid, run level by level as the workers would: bit for bit the
    one-process pyramid, with some levels reduced from a writer's own region and some read back."""
    from bigconv.data import outputs
    from bigconv.geometry.boxes import all_coords, shard_box

    torch.manual_seed(0)
    out = torch.randn(1, 3, 150, 128, dtype=torch.float64)
    grid = (3, 2)
    spec = pyramid.spec_for(("probabilities", "labels"), 3, "float64", (150, 128), grid, 5, 25, ome=True)
    tmp = outputs.begin_group(str(tmp_path / "p.ome.zarr"))
    pyramid.create(tmp, spec, [MPP, MPP], True, None, "p")
    counter = CountingReads(monkeypatch)
    writers = []
    for c in all_coords(grid):
        box = shard_box((150, 128), grid, c)
        w = pyramid.LevelWriter(spec, tmp, c)
        w.first(out[(slice(None), slice(None)) + tuple(slice(a, b) for a, b in box)])
        writers.append(w)
    for k in range(1, spec.levels):
        for w in writers:
            w.next(k)
    import zarr

    for kind, group in spec.arrays():
        level = pyramid.convert(kind, out, 3)[0]
        for k in range(spec.levels):
            got = zarr.open_array(pyramid.array_path(tmp, group, k), mode="r")[:]
            assert np.array_equal(got, level), (kind, k)
            level = naive_reduce(level, kind)
    assert counter.reads > 0, "no level was read back: the fallback is untested"
    assert counter.reads < 2 * (spec.levels - 1) * len(writers), "every level was read back: the regions kept are unused"


def test_what_is_kept():
    torch.manual_seed(0)
    out = torch.randn(1, 3, 4, 5, dtype=torch.float64)
    p = pyramid.convert("probabilities", out, 3)
    assert p.dtype == np.uint8 and np.abs(p.astype(int).sum(axis=1) - 255).max() <= 2
    assert np.array_equal(pyramid.convert("labels", out, 3)[:, 0], out.argmax(1).numpy())
    assert pyramid.convert("float16", out, 3).dtype == np.float16
    assert np.array_equal(pyramid.convert("probabilities", out[:, :1], 1), np.rint(torch.sigmoid(out[:, :1]).numpy() * 255))
    for bad in ("uint8", ("labels", "labels"), ("float", "float16"), ()):
        with pytest.raises(ValueError, match="keep"):
            pyramid.check_keep(bad)


def segmenter() -> nn.Module:
    """A segmentation head of stride 2: the output's pixel is twice the input's."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 3, 3, stride=2, padding=1)).double()


def read_with_ome_zarr(path: str) -> list:
    from ome_zarr.io import parse_url
    from ome_zarr.reader import Reader

    return list(Reader(parse_url(path))())


@pytest.mark.world(4)
@pytest.mark.timeout(240)
def test_predict_writes_an_ome_zarr_pyramid_that_readers_open(world, tmp_path):
    import zarr
    from ome_zarr_models.v05.image import Image
    from ome_zarr_models.v05.image_label import ImageLabel

    model = segmenter()
    x = torch.randn(1, 3, 400, 240, dtype=torch.float64)
    with torch.no_grad():
        full = model(x)
    net = bigconv.parallelize(model, world, grid=(2, 2))
    path = net.predict(x, out=tmp_path / "pred.ome.zarr", keep=("probabilities", "labels"), levels=4, mpp=MPP,
                       max_chunk=32, classes=["background", "tumour", "stroma"])
    assert sorted(os.listdir(tmp_path)) == ["pred.ome.zarr"]
    root = zarr.open_group(path, mode="r")
    assert root.attrs[MARK_KEY]["kind"] == "prediction"
    Image.from_zarr(root)  # NGFF 0.5, validated by an independent model of the spec
    ImageLabel.from_zarr(zarr.open_group(os.path.join(path, "labels", "classes"), mode="r"))

    nodes = read_with_ome_zarr(path)
    image = nodes[0]
    label = next(n for n in nodes if "color" in n.metadata)
    assert [tuple(d.shape) for d in image.data] == [(3, 200, 120), (3, 100, 60), (3, 50, 30), (3, 25, 15)]
    assert [tuple(d.shape) for d in label.data] == [(1, 200, 120), (1, 100, 60), (1, 50, 30), (1, 25, 15)]
    assert [a["name"] for a in image.metadata["axes"]] == ["c", "y", "x"]
    pixel = 2 * MPP  # the model's stride 2
    for k, transforms in enumerate(image.metadata["coordinateTransformations"]):
        assert transforms[0] == {"type": "scale", "scale": [1.0, pixel * 2 ** k, pixel * 2 ** k]}
    assert label.metadata["properties"][1]["class"] == "tumour"

    want = {"probabilities": pyramid.convert("probabilities", full, 3)[0], "labels": pyramid.convert("labels", full, 3)[0]}
    for kind, node in (("probabilities", image), ("labels", label)):
        level = want[kind]
        for k, data in enumerate(node.data):
            assert np.array_equal(np.asarray(data), level), (kind, k)
            level = naive_reduce(level, kind)
    assert np.abs(np.asarray(image.data[0]).astype(np.float64) / 255
                  - torch.softmax(full, 1)[0].numpy()).max() <= 0.5 / 255 + 1e-12


@pytest.mark.world(4)
@pytest.mark.timeout(240)
def test_predict_writes_a_pyramidal_ome_tiff_and_slim_zarr(world, tmp_path):
    import tifffile
    import zarr

    from bigconv.data import open_image, synthetic_slide

    model = segmenter()
    slide = synthetic_slide(tmp_path / "slide.tif", 512, levels=2, tile=128, mpp=MPP)
    src = [open_image(slide, level=1, dtype="float64", scale=1 / 255)]  # 256², at 2 * MPP
    with torch.no_grad():
        full = model(bigconv.data.SourceBatch(src).read())
    net = bigconv.parallelize(model, world, grid=(2, 2))
    path = net.predict(src, out=tmp_path / "pred.ome.tif", keep="labels", levels=3)
    with tifffile.TiffFile(path) as tif:
        assert tif.is_ome
        levels = tif.series[0].levels
        assert [lv.shape for lv in levels] == [(128, 128), (64, 64), (32, 32)]  # one channel: squeezed
        level = pyramid.convert("labels", full, 3)[0]
        for lv in levels:
            assert np.array_equal(lv.asarray(), level[0])
            level = naive_reduce(level, "labels")
        pixels = tif.ome_metadata
        assert f'PhysicalSizeX="{4 * MPP}"' in pixels  # the source's level-1 pixel, times the stride
    with pytest.raises(ValueError, match="is one of the inputs"):
        net.predict(src, out=slide, overwrite=True)
    tifffile.imwrite(tmp_path / "theirs.ome.tif", np.ones((8, 8), np.uint8))
    with pytest.raises(ValueError, match="was not written by bigconv"):
        net.predict(src, out=tmp_path / "theirs.ome.tif", overwrite=True)
    path2 = net.predict(src, out=path, keep="labels", levels=3, overwrite=True)  # its own output: replaced
    assert sorted(os.listdir(tmp_path)) == ["pred.ome.tif", "slide.tif", "theirs.ome.tif"] and path2 == path
    assert np.array_equal(tifffile.imread(tmp_path / "theirs.ome.tif"), np.ones((8, 8), np.uint8))

    flat = net.predict(src, out=tmp_path / "half.zarr", keep="float16")
    got = zarr.open_array(flat, mode="r")
    assert got.dtype == np.float16 and got.shape == (1, 3, 128, 128)
    assert np.array_equal(got[:], full.to(torch.float16).numpy())


@pytest.mark.world(4)
@pytest.mark.timeout(120)
def test_bad_pyramid_options_are_refused_before_remote_work(world, tmp_path, rpc_calls):
    net = bigconv.parallelize(segmenter(), world, grid=(2, 2))
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    net.plan(x)
    rpc_calls.clear()
    cases = [(dict(out=tmp_path / "a.ome.zarr"), "holds one image"),
             (dict(out=tmp_path / "a.zarr", levels=3), "levels=3 needs"),
             (dict(out=tmp_path / "a.zarr", keep=("probabilities", "labels")), "plain .zarr holds one array"),
             (dict(out=tmp_path / "a.ome.tif", keep="float16"), "no float16"),
             (dict(out=tmp_path / "a.zarr", keep="labels", classes=["a"]), "classes must name")]
    for kw, words in cases:
        with pytest.raises(ValueError, match=words):
            net.predict(x[:1] if words == "no float16" else x, **kw)
    with pytest.raises(ValueError, match="more than"):
        net.predict(x[:1], out=tmp_path / "b.ome.zarr", levels=12)
    assert rpc_calls == [] and os.listdir(tmp_path) == []
