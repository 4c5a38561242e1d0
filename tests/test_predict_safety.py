"""``predict`` never destroys what the user had (issue 34).

- an ``out=`` that is, contains or lies inside one of the inputs is refused before any remote work;
- ``overwrite=True`` replaces only an output bigconv wrote (marked in its zarr attributes), never a
  user's folder or array;
- a prediction is written under a temporary sibling and moved into place when every worker is done,
  so a failed run leaves the old output as it was and no partial array behind;
- a read error that every worker raised cleanly leaves the World usable.

A failure here points to ``bigconv/data/outputs.py`` or the ``predict`` of ``parallel.py``.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch
import torch.nn as nn

import bigconv
from bigconv.data import open_image


def dense() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3, padding=1)).double()


def tree(folder) -> dict:
    """Every file under ``folder`` with its bytes."""
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, folder)] = fh.read()
    return out


@pytest.fixture
def slide_zarr(tmp_path):
    import zarr

    rng = np.random.default_rng(0)
    z = zarr.create_array(str(tmp_path / "in" / "slide.zarr"), shape=(3, 64, 64), chunks=(3, 32, 32), dtype="uint8")
    z[:] = rng.integers(0, 256, size=(3, 64, 64), dtype=np.uint8)
    return str(tmp_path / "in" / "slide.zarr")


@pytest.mark.world(4)
@pytest.mark.timeout(120)
def test_predict_refuses_an_out_that_is_or_holds_an_input(world, slide_zarr, tmp_path, rpc_calls):
    net = bigconv.parallelize(dense(), world, grid=(2, 2))
    src = [open_image(slide_zarr, dtype="float64", scale=1 / 255)]
    before = tree(tmp_path / "in")
    rpc_calls.clear()
    for out, words in ((slide_zarr, "is one of the inputs"), (os.path.join(slide_zarr, "pred.zarr"), "inside"),
                       (str(tmp_path / "in"), "holds")):
        with pytest.raises(ValueError, match=words):
            net.predict(src, out=out, overwrite=True)
    assert rpc_calls == []
    assert tree(tmp_path / "in") == before  # not one byte of the input changed


@pytest.mark.world(4)
@pytest.mark.timeout(120)
def test_overwrite_replaces_only_outputs_bigconv_wrote(world, slide_zarr, tmp_path, rpc_calls):
    import zarr

    net = bigconv.parallelize(dense(), world, grid=(2, 2))
    src = [open_image(slide_zarr, dtype="float64", scale=1 / 255)]
    mine = tmp_path / "results"
    (mine / "run1").mkdir(parents=True)
    (mine / "notes.txt").write_text("my notes")
    (mine / "run1" / "metrics.json").write_text("{}")
    user_array = zarr.create_array(str(tmp_path / "theirs.zarr"), shape=(4,), chunks=(4,), dtype="uint8")
    user_array[:] = 7
    before = tree(tmp_path)
    rpc_calls.clear()
    for out in (mine, tmp_path / "theirs.zarr"):
        with pytest.raises(ValueError, match="was not written by bigconv"):
            net.predict(src, out=out, overwrite=True)
    assert rpc_calls == [] and tree(tmp_path) == before
    path = net.predict(src, out=tmp_path / "pred.zarr")
    assert zarr.open_array(path, mode="r").attrs["bigconv"]["kind"] == "prediction"
    net.predict(src, out=path, overwrite=True)  # its own output: replaced
    assert sorted(os.listdir(tmp_path)) == ["in", "pred.zarr", "results", "theirs.zarr"]  # no temporary left


@pytest.mark.world(4)
@pytest.mark.timeout(120)
def test_a_failed_predict_leaves_the_old_output_and_a_usable_world(world, slide_zarr, tmp_path):
    import zarr

    net = bigconv.parallelize(dense(), world, grid=(2, 2))
    src = [open_image(slide_zarr, dtype="float64", scale=1 / 255)]
    path = net.predict(src, out=tmp_path / "pred.zarr")
    old = zarr.open_array(path, mode="r")[:]
    np.save(tmp_path / "gone.npy", np.zeros((3, 64, 64), np.uint8))
    gone = [open_image(tmp_path / "gone.npy", dtype="float64", scale=1 / 255)]
    os.unlink(tmp_path / "gone.npy")  # deleted between planning and the step
    with pytest.raises(bigconv.WorkerFailure, match="gone.npy"):
        net.predict(gone, out=path, overwrite=True)
    assert np.array_equal(zarr.open_array(path, mode="r")[:], old)
    assert sorted(os.listdir(tmp_path)) == ["in", "pred.zarr"]  # the partial array is gone too
    assert not world.broken, world.broken  # every worker failed the same clean way
    assert net(src).shape == (1, 2, 64, 64)


@pytest.mark.world(4)
@pytest.mark.timeout(120)
def test_a_read_error_on_every_worker_leaves_the_world_usable(world, slide_zarr, tmp_path, transport):
    """Whether a World is broken comes from structured facts (a worker died, stalled or raised
    WorkerFailure; the others still inside an exchange), never from words such as "timeout" in the
    remote traceback (every read's traceback holds ``take_or_read(read, self.rt.timeout, ...)``)."""
    net = bigconv.parallelize(dense(), world, grid=(2, 2), transport=transport)
    np.save(tmp_path / "gone.npy", np.zeros((3, 64, 64), np.uint8))
    gone = [open_image(tmp_path / "gone.npy", dtype="float64", scale=1 / 255)]
    os.unlink(tmp_path / "gone.npy")
    with pytest.raises(bigconv.WorkerFailure, match="gone.npy") as info:
        net(gone)
    assert "timeout" in str(info.value.__cause__)  # the words that once broke the World are there
    assert not world.broken, world.broken
    src = [open_image(slide_zarr, dtype="float64", scale=1 / 255)]
    assert net(src).shape == (1, 2, 64, 64)


@pytest.mark.world(4)
@pytest.mark.timeout(180)
def test_a_read_error_on_one_worker_releases_the_others_promptly(world, slide_zarr, tmp_path, transport):
    """One worker's box holds a corrupt chunk: the others must not wait out the World's timeout in their
    halo exchanges with it. Every worker learns of the failed read before the forward starts (one small
    agreement per call that reads sources), so all raise together, the failing worker's own message
    reaches the user, and the World stays usable."""
    net = bigconv.parallelize(dense(), world, grid=(2, 2), transport=transport)
    expected = net([open_image(slide_zarr, dtype="float64", scale=1 / 255)])
    chunk = os.path.join(slide_zarr, "c", "0", "1", "1")  # rows and columns 32-63: the last worker's box only
    with open(chunk, "rb") as fh:
        good = fh.read()
    with open(chunk, "r+b") as fh:
        fh.seek(4)
        fh.write(b"\xff" * 16)
    start = time.perf_counter()
    with pytest.raises(bigconv.WorkerFailure, match=r"slide\.zarr.*level 0.*box") as info:
        net([open_image(slide_zarr, dtype="float64", scale=1 / 255)])
    took = time.perf_counter() - start
    assert took < world.timeout / 4, f"the other workers waited {took:.1f}s for the failed one"
    assert "did not complete exchange" not in str(info.value), info.value
    assert not world.broken, world.broken
    with open(chunk, "wb") as fh:
        fh.write(good)
    assert torch.equal(net([open_image(slide_zarr, dtype="float64", scale=1 / 255)]), expected)


@pytest.mark.world(4)
@pytest.mark.timeout(120)
def test_overwrite_through_a_symlink_writes_the_links_target(world, slide_zarr, tmp_path):
    """Issue 52 item 7: ``out=`` a symlink to an output of ours, ``overwrite=True``: the new output goes
    to the link's target, the link stays a link, no debris is left and the call reports its success."""
    import zarr

    net = bigconv.parallelize(dense(), world, grid=(2, 2))
    src = [open_image(slide_zarr, dtype="float64", scale=1 / 255)]
    (tmp_path / "runs").mkdir()
    target = net.predict(src, out=tmp_path / "runs" / "pred.zarr")
    zarr.open_array(target, mode="r+")[:] = 0  # the next prediction must replace these values
    link = tmp_path / "latest.zarr"
    os.symlink(target, link)
    path = net.predict(src, out=link, overwrite=True)
    assert os.path.realpath(path) == os.path.realpath(target)
    assert os.path.islink(link) and os.path.realpath(link) == os.path.realpath(target)
    assert zarr.open_array(str(link), mode="r")[:].any()  # the new values, read through the link
    assert sorted(os.listdir(tmp_path)) == ["in", "latest.zarr", "runs"]
    assert sorted(os.listdir(tmp_path / "runs")) == ["pred.zarr"]  # no temporary or old copy left


@pytest.mark.world(4)
@pytest.mark.timeout(120)
def test_a_destination_another_run_is_writing_is_refused_before_remote_work(world, slide_zarr, tmp_path, rpc_calls):
    """Issue 52 item 6: two predictions to one ``out=`` never both succeed. Another process's run holds the
    claim beside ``out``: this one is refused before any remote work, naming that run; once the claim is
    gone it runs, and leaves no claim behind, whether it succeeds or fails."""
    import json
    import socket

    from bigconv.data import outputs

    net = bigconv.parallelize(dense(), world, grid=(2, 2))
    src = [open_image(slide_zarr, dtype="float64", scale=1 / 255)]
    out = str(tmp_path / "pred.zarr")
    claim = outputs.claim_path(out)
    with open(claim, "w") as fh:  # the run of a live process (pytest's parent) on this host
        json.dump({"host": socket.gethostname(), "pid": os.getppid(), "token": "t", "since": "now"}, fh)
    rpc_calls.clear()
    for overwrite in (False, True):
        with pytest.raises(ValueError, match=rf"being written by another prediction \(pid {os.getppid()}"):
            net.predict(src, out=out, overwrite=overwrite)
    assert rpc_calls == [] and os.path.exists(claim) and not os.path.exists(out)
    os.unlink(claim)  # that run ended
    assert net.predict(src, out=out) == out
    np.save(tmp_path / "gone.npy", np.zeros((3, 64, 64), np.uint8))
    gone = [open_image(tmp_path / "gone.npy", dtype="float64", scale=1 / 255)]
    os.unlink(tmp_path / "gone.npy")
    with pytest.raises(bigconv.WorkerFailure, match="gone.npy"):
        net.predict(gone, out=out, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["in", "pred.zarr"]  # no claim left by either run


@pytest.mark.world(4)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("keep, out", [("probabilities", "pred.zarr"), ("labels", "pred.ome.zarr")])
def test_nan_outputs_kept_as_uint8_are_refused_naming_where(world, tmp_path, keep, out):
    """Issue 52 item 10: uint8 probabilities or labels have no value for NaN (they came out as 0: background,
    class 0, without a word). A NaN input pixel at (40, 41) spreads to the 3x3 around it through the first
    convolution (5x5 through both): predict refuses, naming how many positions and the first one in the
    output's own coordinates, and writes nothing."""
    net = bigconv.parallelize(dense(), world, grid=(2, 2))
    x = torch.rand(1, 3, 64, 64, dtype=torch.float64)
    x[0, :, 40, 41] = float("nan")
    with pytest.raises(bigconv.WorkerFailure, match=r"NaN.* 25 .*\(38, 39\).*keep='float'") as info:
        net.predict(x, out=tmp_path / out, keep=keep)
    assert keep in str(info.value) and str(tmp_path / out) in str(info.value)  # the output, as the user named it
    assert sorted(os.listdir(tmp_path)) == []  # nothing written, no claim or partial left
    assert not world.broken
