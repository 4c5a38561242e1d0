"""Training on image sources: every worker reads only its own box from the file, and the result is
one process's on the same pixels (uint8 / 255, channels first), float64, relative error <= 1e-9."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch
import torch.nn as nn
from verdicts import assert_exact

import bigconv
from bigconv.data import SourceBatch, open_image, synthetic_slide
from bigconv.verify import compare_training

TOL = 1e-9


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, stride=2), nn.BatchNorm2d(4),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2)).double()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("slides")
    tiff = [synthetic_slide(folder / f"s{i}.tif", (256, 512), levels=2, tile=128, seed=i, tissue=0.6)
            for i in range(2)]
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 256, size=(3, 90, 77), dtype=np.uint8) for _ in range(2)]
    npy = []
    for i, a in enumerate(arrays):
        np.save(folder / f"a{i}.npy", a)
        npy.append(str(folder / f"a{i}.npy"))
    import zarr

    zarrs = []
    for i, a in enumerate(arrays):
        z = zarr.create_array(str(folder / f"z{i}.zarr"), shape=a.shape, chunks=(3, 32, 32), dtype="uint8")
        z[:] = a
        zarrs.append(str(folder / f"z{i}.zarr"))
    return {"tiff": tiff, "npy": npy, "zarr": zarrs, "arrays": arrays}


def check(world, files, kind, level, grid):
    srcs = [open_image(p, level=level, dtype="float64", scale=1 / 255) for p in files[kind]]
    r = compare_training(model(), world, srcs, torch.tensor([0, 1]), nn.CrossEntropyLoss(), grid=grid)
    assert_exact(r, TOL)


@pytest.mark.world(4)
@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind,level", [("tiff", 0), ("tiff", 1), ("npy", 0), ("zarr", 0)])
def test_training_on_sources_equals_one_process_2x2(world, files, kind, level):
    check(world, files, kind, level, (2, 2))


@pytest.mark.world(3)
@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind,level,grid", [("tiff", 1, (3, 1)), ("zarr", 0, (1, 3)), ("npy", 0, (3, 1))])
def test_training_on_sources_equals_one_process_uneven(world, files, kind, level, grid):
    check(world, files, kind, level, grid)  # 128, 90 and 77 rows over 3 shards: uneven


def test_sources_read_the_stored_pixels(files):
    for p, a in zip(files["npy"] + files["zarr"], files["arrays"] * 2):
        src = open_image(p, mean=(0.5, 0.5, 0.5), std=(2.0, 2.0, 2.0), scale=1 / 255)
        assert src.shape == (3, 90, 77) and src.stored_dtype == "uint8"
        assert np.array_equal(src.read(((10, 50), (7, 70))), a[:, 10:50, 7:70])
        want = (torch.from_numpy(a[:, :4, :5]).float() * (1 / 255) - 0.5) / 2.0  # as declared: scale, mean, std
        assert torch.equal(src.tensor(((0, 4), (0, 5))), want)
    import tifffile

    with tifffile.TiffFile(files["tiff"][0]) as tf:
        level1 = tf.series[0].levels[1].asarray()
    src = open_image(files["tiff"][0], mpp=0.5, fill=255)  # written at 0.25 um/px: level 1
    assert src.level == 1 and src.shape == (3, 128, 256)
    out = src.read(((-3, 20), (250, 260)))  # a padded crop reaching beyond two edges
    assert np.array_equal(out[:, 3:, :6], level1[:20, 250:256].transpose(2, 0, 1))
    assert (out[:, :3] == 255).all() and (out[:, :, 6:] == 255).all()


def test_sources_pickle_small():
    src = open_image(synthetic_slide_path(), scale=1 / 255)
    assert len(pickle.dumps(src)) < 4096


def synthetic_slide_path(cache={}):
    if "p" not in cache:
        import tempfile

        cache["p"] = synthetic_slide(tempfile.mkdtemp() + "/p.tif", 1024, levels=3, tile=128)
    return cache["p"]


@pytest.mark.world(4)
def test_each_worker_opens_a_file_once(world, files):
    srcs = [open_image(p, level=0, dtype="float64", scale=1 / 255) for p in files["tiff"]]
    net = bigconv.parallelize(model(), world, grid=(2, 2))
    for _ in range(3):
        net(srcs)
    counts = world.call(_opened, [()] * world.workers, "counting opens")
    for c in counts:
        assert c and all(n == 1 for n in c.values()), counts


def _opened():
    from bigconv.data import OPENED

    return {str(k): v for k, v in OPENED.items()}


@pytest.mark.world(4)
def test_bad_sources_are_refused_before_remote_work(world, files, rpc_calls, tmp_path):
    net = bigconv.parallelize(model(), world, grid=(2, 2))
    rpc_calls.clear()
    two_levels = [open_image(files["tiff"][0], level=0, dtype="float64"), open_image(files["tiff"][1], level=1,
                                                                                       dtype="float64")]
    with pytest.raises(ValueError, match="must share shape and dtype.*item 1"):
        net(two_levels)
    gray = [open_image(files["npy"][0], dtype="float64").__class__(**{
        **open_image(files["npy"][0], dtype="float64").__dict__, "shape": (1, 90, 77)})]
    with pytest.raises(ValueError, match="cannot run on an input of shape"):
        net(gray)
    assert rpc_calls == []
    with pytest.raises(ValueError, match="no image at"):
        open_image(tmp_path / "missing.tif")
    with pytest.raises(ValueError, match="cannot tell the format"):
        open_image(tmp_path / "slide.xyz")
    with pytest.raises(ValueError, match="level 5 does not exist"):
        open_image(files["tiff"][0], level=5)
    with pytest.raises(ValueError, match="not a real torch dtype"):
        open_image(files["npy"][0], dtype="complex64")
    with pytest.raises(ValueError, match="not a floating-point torch dtype"):
        open_image(files["npy"][0], dtype="int64", scale=1 / 255)
    with pytest.raises(ValueError, match="no level near 4"):
        open_image(files["tiff"][0], mpp=4)
    with pytest.raises(ValueError, match="records no resolution"):
        open_image(files["npy"][0], mpp=0.5)


def test_a_source_batch_reads_whole(files):
    srcs = [open_image(p, dtype="float64", scale=1 / 255) for p in files["npy"]]
    x = SourceBatch(srcs).read()
    assert x.shape == (2, 3, 90, 77) and x.dtype == torch.float64
    assert torch.equal(x[1], torch.from_numpy(files["arrays"][1]).double() * (1 / 255))


def dense() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3, padding=1)).double()


@pytest.mark.world(4)
@pytest.mark.timeout(120)
def test_predict_writes_the_single_process_output_into_zarr(world, files, tmp_path):
    import zarr

    srcs = [open_image(p, level=1, dtype="float64", scale=1 / 255) for p in files["tiff"]]
    model = dense()
    net = bigconv.parallelize(model, world, grid=(2, 2))
    path = net.predict(srcs, out=tmp_path / "pred.zarr")
    got = zarr.open_array(path, mode="r")
    assert got.shape == (2, 2, 128, 256) and got.chunks == (1, 2, 64, 128)  # shards are 64 x 128
    with torch.no_grad():
        want = model(SourceBatch(srcs).read())
    assert np.abs(got[:] - want.numpy()).max() <= TOL * np.abs(want.numpy()).max()
    with pytest.raises(ValueError, match="exists; choose another out= or pass overwrite=True"):
        net.predict(srcs, out=path)
    net.predict(srcs, out=path, overwrite=True)
    head = bigconv.parallelize(nn.Sequential(dense(), nn.AdaptiveAvgPool2d(1)), world)
    with pytest.raises(ValueError, match="use net\\.full\\(x\\) for it"):
        head.predict(srcs, out=tmp_path / "head.zarr")


def test_chunks_never_cross_shards():
    from bigconv.data.outputs import aligned_chunks

    assert aligned_chunks((128, 256), (2, 2)) == (64, 128)
    assert aligned_chunks((4096, 1000), (4, 1)) == (1024, 1000)
    assert aligned_chunks((3000, 3000), (3, 2)) == (1000, 750)  # 750 divides the boundary at 1500
    with pytest.raises(ValueError, match="share no chunk edge"):
        aligned_chunks((101, 64), (3, 1))  # shards start at 33 and 67


@pytest.mark.world(4)
@pytest.mark.timeout(180)
@pytest.mark.parametrize("loss_kind", ["labels", "mask"])
def test_dense_targets_as_sources(world, files, tmp_path, loss_kind):
    """Label maps (class indices, one channel) and float masks read shard by shard on the workers."""
    rng = np.random.default_rng(3)
    if loss_kind == "labels":
        maps = [rng.integers(0, 2, size=(1, 90, 77), dtype=np.uint8) for _ in range(2)]
        loss, dtype = nn.CrossEntropyLoss(), "int64"
    else:
        maps = [rng.random(size=(2, 90, 77)) for _ in range(2)]
        loss, dtype = nn.BCEWithLogitsLoss(), "float64"
    paths = []
    for i, m in enumerate(maps):
        np.save(tmp_path / f"y{i}.npy", m)
        paths.append(tmp_path / f"y{i}.npy")
    ys = [open_image(p, dtype=dtype) for p in paths]
    xs = [open_image(p, dtype="float64", scale=1 / 255) for p in files["npy"]]
    r = compare_training(dense(), world, xs, ys, loss, grid=(2, 2))
    assert_exact(r, TOL)


@pytest.mark.world(4)
def test_bad_target_sources(world, files, tmp_path):
    np.save(tmp_path / "bad.npy", np.full((1, 90, 77), 7, dtype=np.uint8))
    xs = [open_image(files["npy"][0], dtype="float64", scale=1 / 255)]
    net = bigconv.parallelize(dense(), world, grid=(2, 2))
    net.optimizer(torch.optim.SGD, lr=0.1)
    with pytest.raises(bigconv.WorkerFailure, match=r"the label maps hold 7, outside \[0, 2\)"):
        net.train_step(xs, [open_image(tmp_path / "bad.npy", dtype="int64")], nn.CrossEntropyLoss())
    head = bigconv.parallelize(model(), world, grid=(2, 2))
    head.optimizer(torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"loss_fn cannot take the model's output of shape \(1, 2\)"):
        head.train_step(xs, [open_image(tmp_path / "bad.npy", dtype="int64")], nn.CrossEntropyLoss())
    np.save(tmp_path / "mask.npy", np.zeros((2, 90, 77)))
    with pytest.raises(ValueError, match="targets given as sources are read shard by shard"):
        net.train_step(xs, [open_image(tmp_path / "mask.npy", dtype="float64")], lambda o, t: ((o - t) ** 2).mean())
    with pytest.raises(ValueError, match="scale, mean or std ask for one"):
        open_image(tmp_path / "bad.npy", dtype="int64", scale=2.0)


@pytest.mark.world(4)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["torchvision/resnet18", "smp/Unet"])
def test_zoo_networks_train_on_slide_sources(world, files, name):
    """Networks nobody on the team wrote, fed straight from a pyramidal TIFF: a classifier with slide
    labels, and a segmentation net with label maps read as sources too."""
    from bigconv.compat import allow_torchvision_without_ops

    allow_torchvision_without_ops()
    import zoo

    entry = zoo.BY_NAME[name]
    xs = [open_image(p, level=1, dtype="float64", scale=1 / 255) for p in files["tiff"]]  # 128 x 256 RGB
    if entry.dense:
        rng = np.random.default_rng(5)
        folder = os.path.dirname(files["npy"][0])
        ys = []
        for i in range(2):
            np.save(os.path.join(folder, f"labels_{i}.npy"),
                    rng.integers(0, entry.num_classes, size=(1, 128, 256), dtype=np.uint8))
            ys.append(open_image(os.path.join(folder, f"labels_{i}.npy"), dtype="int64"))
    else:
        ys = torch.tensor([0, 1])
    torch.manual_seed(0)
    r = compare_training(entry.build().double(), world, xs, ys, nn.CrossEntropyLoss(), grid=(2, 2))
    assert_exact(r, TOL)


def test_ome_zarr_slide_reads_the_tiff_slide_pixels(tmp_path):
    """The same synthetic slide as OME-Zarr multiscales and as a TIFF pyramid: every level, and mpp."""
    tif = synthetic_slide(tmp_path / "s.tif", (256, 512), levels=3, tile=64, seed=4)
    ome = synthetic_slide(tmp_path / "s.zarr", (256, 512), levels=3, tile=64, seed=4, format="zarr")
    for level in range(3):
        a, b = open_image(tif, level=level), open_image(ome, level=level)
        assert a.shape == b.shape and b.axes == "cyx"
        box = ((3, a.shape[1] - 5), (7, a.shape[2] - 2))
        assert np.array_equal(a.read(box), b.read(box))
    assert open_image(ome, mpp=0.5).level == 1 and open_image(ome, mpp=1.0).level == 2


def test_jpeg_slide_boxes_match_the_whole_page_decode(tmp_path):
    """JPEG tiles (YCbCr, as scanners store them): a box across tile borders is the same slice of the
    page that tifffile decodes whole, on every level; and the lossy pixels stay near the zlib slide's."""
    import tifffile

    jpg = synthetic_slide(tmp_path / "j.tif", (256, 512), levels=2, tile=64, seed=4, compression="jpeg")
    zl = synthetic_slide(tmp_path / "z.tif", (256, 512), levels=2, tile=64, seed=4)
    with tifffile.TiffFile(jpg) as tf:
        assert tf.pages[0].compression == 7 and tf.pages[0].photometric == 6  # JPEG, YCbCr
        pages = [level.asarray() for level in tf.series[0].levels]
    for level, page in enumerate(pages):
        src = open_image(jpg, level=level)
        box = ((30, src.shape[1] - 9), (61, src.shape[2] - 3))
        got = src.read(box)
        assert np.array_equal(got, page[30:src.shape[1] - 9, 61:src.shape[2] - 3].transpose(2, 0, 1))
        diff = got.astype(np.int16) - open_image(zl, level=level).read(box)
        assert np.abs(diff).mean() < 6, np.abs(diff).mean()
