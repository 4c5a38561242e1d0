"""``capture(..., out=)`` on SPMD ranks: every rank writes its own parts of the captured maps.

One launch of 4 gloo ranks (a small CNN in float64, an uneven 2 x 2 grid) runs every case in order:
two layers captured with the gradient of a loss (a sharded map, and the head's vector whose gradient is
summed over the ranks' copies) and one without gradients, each written with ``out=`` and compared with
one process (``tests/capture_reference.py``, plain hooks) within 1e-12; the store's own layout compared with what the driver mode
writes for the same call (on the shared World); an ``out=`` the library did not write, refused on every
rank before any forward, left as it was; a write failing on rank 2, raised on every rank naming it, with
no partial store left.

A failure here points to ``capture_spmd`` / ``_write_spmd`` in ``bigconv/capture.py`` (or
``bigconv/runtime/spmd_outputs.py`` for the agreement).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn as nn
from capture_reference import capture_reference

import bigconv
from bigconv.runtime import spmd_launch as launch

SHAPE = (2, 2, 30, 22)  # uneven shards on a 2 x 2 grid; the strided map is 15 x 11
WITH_GRADS = ["1", "6"]  # a ReLU's map (sharded) and the Linear head's vector (whole on every shard)
OUTPUTS_ONLY = ["2"]  # the strided convolution
PLANTED = "planted: the disk is full on rank 2"


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 6, 3, padding=1, stride=2),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 3)).double().eval()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(SHAPE, dtype=torch.float64, generator=g), torch.tensor([0, 2])


def _rel(got, want: torch.Tensor) -> float:
    a = torch.from_numpy(np.asarray(got[...]))
    return float((a - want).abs().max() / want.abs().max()) if a.shape == want.shape else float("inf")


def _errors(got: dict, want: dict, tag: str) -> dict:
    out = {f"{tag}/keys": 0.0 if sorted(got) == sorted(want) else float("inf")}
    for key, w in want.items():
        out[f"{tag}/{key}.output"] = _rel(got[key].output, w.output)
        if w.grad is None:
            out[f"{tag}/{key}.grad"] = 0.0 if got[key].grad is None else float("inf")
        else:
            out[f"{tag}/{key}.grad"] = _rel(got[key].grad, w.grad) if got[key].grad is not None else float("inf")
    return out


def _message(call) -> str:
    try:
        call()
    except Exception as exc:  # what this rank raised, to be checked by the test
        return f"{type(exc).__name__}: {exc}"
    return "nothing raised"


def ranks(out_dir: str) -> dict:
    """What each rank runs: every case in order; the errors against one process and what each call raised."""
    from bigconv import capture as front
    from bigconv.runtime.model_part import ModelPart

    ref = model()
    x, y = data()
    with bigconv.World.from_env(mode="spmd", timeout=60) as world:
        net = bigconv.parallelize(model(), world, grid=(2, 2)).eval()
        loss = nn.CrossEntropyLoss()
        path = os.path.join(out_dir, "grads.zarr")
        result = {"errors": _errors(net.capture(WITH_GRADS, x, y, loss_fn=loss, out=path),
                                    capture_reference(ref, WITH_GRADS, x, y, loss_fn=loss), "grads")}
        flat = os.path.join(out_dir, "outputs.zarr")
        result["errors"].update(_errors(net.capture(OUTPUTS_ONLY, x, out=flat), capture_reference(ref, OUTPUTS_ONLY, x),
                                        "outputs"))
        again = net.capture(OUTPUTS_ONLY, x, out=flat, overwrite=True)  # its own store: replaced
        result["errors"]["replaced"] = _rel(again["2"].output, capture_reference(ref, OUTPUTS_ONLY, x)["2"].output)

        forwards = []
        real_run = front._run_spmd
        front._run_spmd = lambda *a: (forwards.append(a), real_run(*a))
        result["exists"] = _message(lambda: net.capture(OUTPUTS_ONLY, x, out=flat))
        result["foreign"] = _message(lambda: net.capture(OUTPUTS_ONLY, x, out=os.path.join(out_dir, "mine.zarr"),
                                                         overwrite=True))
        result["forwards_when_refused"] = len(forwards)
        front._run_spmd = real_run

        if world.rank == 2:  # this rank's writer fails after the others have begun
            def failing(*args):
                raise OSError(PLANTED)

            ModelPart.capture_write_parts = staticmethod(failing)
        result["failed"] = _message(lambda: net.capture(WITH_GRADS, x, y, loss_fn=loss,
                                                        out=os.path.join(out_dir, "failed.zarr")))
        return result


def _store(path) -> dict:
    """What a capture store holds apart from its values: group attributes, and per array its shape,
    chunks, dtype and attributes."""
    import zarr

    group = zarr.open_group(path, mode="r")
    out = {"": dict(group.attrs)}
    for key in group.group_keys():
        out[key] = dict(group[key].attrs)
        for part, array in group[key].arrays():
            out[f"{key}/{part}"] = (array.shape, array.chunks, str(array.dtype), dict(array.attrs))
    return out


@pytest.mark.world(4)
@pytest.mark.timeout(300)
def test_capture_out_on_spmd_ranks(world, tmp_path):
    mine = tmp_path / "mine.zarr"  # a folder of the user's, named like a store
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    before = os.stat(mine / "notes.txt").st_mtime_ns
    per_rank = launch.run(ranks, 4, (str(tmp_path),), timeout=240)

    for rank, got in enumerate(per_rank):
        bad = {k: v for k, v in got["errors"].items() if not v <= 1e-12}
        assert not bad, f"rank {rank}: written captures differ from one process: {bad}"
        assert len(got["errors"]) == 1 + 2 * len(WITH_GRADS) + 1 + 2 * len(OUTPUTS_ONLY) + 1
        assert "refused on rank 0" in got["exists"] and "exists" in got["exists"], got["exists"]
        assert "refused on rank 0" in got["foreign"] and "was not written by bigconv" in got["foreign"], got["foreign"]
        assert got["forwards_when_refused"] == 0, f"rank {rank} ran a forward before the refusal"
        assert got["failed"].startswith("WorkerFailure: capture (writing) failed on rank 2: OSError: " + PLANTED), \
            f"rank {rank}: {got['failed']}"
    assert sorted(os.listdir(tmp_path)) == ["grads.zarr", "mine.zarr", "outputs.zarr"]  # no partial store
    assert os.listdir(mine) == ["notes.txt"] and os.stat(mine / "notes.txt").st_mtime_ns == before
    assert (mine / "notes.txt").read_text() == "mine"

    # the driver mode's store of the same call: the same layout and attributes, the same values
    x, y = data()
    net = bigconv.parallelize(model(), world, grid=(2, 2)).eval()
    driver = net.capture(WITH_GRADS, x, y, loss_fn=nn.CrossEntropyLoss(), out=tmp_path / "driver.zarr")
    spmd = _store(tmp_path / "grads.zarr")
    assert spmd == _store(tmp_path / "driver.zarr")
    assert set(spmd) == {"", "1", "1/output", "1/grad", "6", "6/output", "6/grad"}, sorted(spmd)
    assert spmd["1"]["sharded"] is True and spmd["6"]["sharded"] is False
    import zarr

    written = zarr.open_group(tmp_path / "grads.zarr", mode="r")
    for key in WITH_GRADS:
        for part in ("output", "grad"):
            a, b = np.asarray(written[f"{key}/{part}"][...]), np.asarray(getattr(driver[key], part)[...])
            assert np.abs(a - b).max() <= 1e-12 * np.abs(b).max(), f"{key}/{part}: SPMD and driver stores differ"
