"""Corrupt or odd sources are refused, converted or named, never read silently (issue 34).

- structure is checked at ``open_image`` on the driver from headers and chunk listings (no pixels):
  a TIFF cut inside its IFD or whose tiles lie past the end of the file, a zarr store with missing
  chunks (named in a warning, refused with ``missing_chunks="error"``);
- a chunk or tile that fails to decode raises an error naming the slide, the level, the box and the
  codec's error (on a worker too);
- complex data is refused at open; big-endian and bool data are converted (the driver probes a pixel);
- ``check_finite=True`` covers sources (each worker checks its boxes and names slide and box) and
  targets.

A failure points to ``bigconv/data/readers.py`` (structure), ``bigconv/data/sources.py`` (reads and
conversions) or ``bigconv/input_checks.py`` (targets).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

import bigconv
from bigconv.data import open_image, synthetic_slide


def dense(channels: int = 1) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(channels, 2, 3, padding=1)).double()


@pytest.fixture
def tiff(tmp_path):
    return synthetic_slide(tmp_path / "s.tif", 256, levels=2, tile=64, tissue=0.8)


def test_truncated_tiff_is_refused_at_open(tiff, tmp_path):
    data = Path(tiff).read_bytes()
    for cut, words in ((288, "truncated"), (len(data) // 2, "past the end of the file")):
        bad = tmp_path / f"cut{cut}.tif"
        bad.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=words) as info:
            open_image(bad)
        assert str(bad) in str(info.value)
    assert open_image(tiff).shape == (3, 256, 256)  # the intact file still opens


@pytest.fixture
def zarr_slide(tmp_path):
    import zarr

    z = zarr.create_array(str(tmp_path / "z.zarr"), shape=(1, 64, 64), chunks=(1, 32, 32), dtype="float32")
    z[:] = np.random.default_rng(0).random((1, 64, 64)).astype(np.float32) + 1
    return str(tmp_path / "z.zarr")


def test_missing_zarr_chunks_are_named(zarr_slide):
    os.unlink(os.path.join(zarr_slide, "c", "0", "1", "0"))
    with pytest.warns(UserWarning, match=r"1 of its 4 chunks.*c/0/1/0.*fill value 0"):
        open_image(zarr_slide)
    with pytest.raises(ValueError, match=r"1 of its 4 chunks.*c/0/1/0"):
        open_image(zarr_slide, missing_chunks="error")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        open_image(zarr_slide, missing_chunks="fill")  # a sparse store by design: silent


def test_a_corrupt_chunk_names_slide_level_box_and_codec(zarr_slide, tiff, tmp_path):
    with open(os.path.join(zarr_slide, "c", "0", "0", "1"), "r+b") as fh:
        fh.seek(4)
        fh.write(b"\xff" * 16)
    src = open_image(zarr_slide)
    with pytest.raises(ValueError, match=r"z\.zarr.*level 0.*box \(\(0, 40\), \(20, 64\)\).*Error"):
        src.read(((0, 40), (20, 64)))
    data = bytearray(Path(tiff).read_bytes())
    data[len(data) // 3:len(data) // 3 + 64] = b"\x00" * 64  # inside the tiles' compressed bytes
    (tmp_path / "bad.tif").write_bytes(bytes(data))
    src = open_image(tmp_path / "bad.tif")
    with pytest.raises(ValueError, match=r"bad\.tif.*level 0.*box"):
        src.read()


def test_complex_is_refused_and_odd_dtypes_are_converted(tmp_path):
    np.save(tmp_path / "c.npy", np.ones((1, 8, 8), np.complex64))
    with pytest.raises(ValueError, match="complex"):
        open_image(tmp_path / "c.npy")
    values = np.arange(64, dtype=np.float32).reshape(1, 8, 8)
    np.save(tmp_path / "be.npy", values.astype(">f4"))
    assert torch.equal(open_image(tmp_path / "be.npy").tensor(), torch.from_numpy(values))
    np.save(tmp_path / "b.npy", values > 10)
    assert torch.equal(open_image(tmp_path / "b.npy").tensor(), torch.from_numpy(values > 10).float())


@pytest.mark.world(4)
@pytest.mark.timeout(120)
def test_odd_dtypes_run_on_the_workers(world, tmp_path):
    values = np.random.default_rng(1).random((1, 32, 32))
    np.save(tmp_path / "be.npy", values.astype(">f8"))
    np.save(tmp_path / "b.npy", values > 0.5)
    model = dense()
    net = bigconv.parallelize(model, world, grid=(2, 2))
    for name, want in (("be.npy", values), ("b.npy", (values > 0.5).astype(np.float64))):
        got = net([open_image(tmp_path / name, dtype="float64")])
        with torch.no_grad():
            assert torch.allclose(got, model(torch.from_numpy(want)[None]), atol=1e-12), name


@pytest.mark.world(4)
@pytest.mark.timeout(120)
def test_check_finite_covers_sources_and_targets(world, tmp_path, rpc_calls):
    values = np.random.default_rng(2).random((1, 32, 32)).astype(np.float32)
    values[0, 20, 5] = np.nan  # in the shard of worker 2 on a (2, 2) grid: rows 16-32, columns 0-16
    np.save(tmp_path / "nan.npy", values)
    src = [open_image(tmp_path / "nan.npy", dtype="float64")]
    plain = bigconv.parallelize(dense(), world, grid=(2, 2))  # off by default: no reading twice
    assert plain(src).isnan().any()
    net = bigconv.parallelize(dense(), world, grid=(2, 2), check_finite=True)
    net.optimizer(torch.optim.SGD, lr=0.1)
    x = torch.rand(1, 1, 32, 32, dtype=torch.float64)
    y = torch.rand(1, 2, 32, 32, dtype=torch.float64)
    y[0, 1, 3, 4] = float("inf")
    rpc_calls.clear()
    with pytest.raises(ValueError, match="y holds 1 NaN or infinite"):
        net.train_step(x, y, nn.MSELoss())
    assert rpc_calls == []
    # Last: the other workers are inside their halo waits when worker 2 refuses its box, so on the
    # p2p transport the World is broken afterwards (see docs/limitations.md).
    with pytest.raises(bigconv.WorkerFailure, match=r"nan\.npy.*box \(\(16, 32\), \(0, 16\)\).*1 NaN or inf"):
        net(src)
