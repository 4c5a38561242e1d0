"""``predict`` of a model with several outputs (issue 37, item 6): a zarr group, an array per dense output.

nnU-Net's deep supervision (a list of maps at two scales), HoVerNet's dict of three heads, an auxiliary
classifier beside a dense map (a tuple: the vector is not written). Each worker writes its region of every
dense output from one forward (``ModelPart.predict_several``); each array against one process's output in
float64, as kept (float, or labels by argmax). Refusals before any remote work: an OME format (one image),
a model whose outputs are all vectors. A failure points at ``bigconv.prediction._predict_several`` (names,
boxes of each output's own grid shape) or at the workers' writes.
"""

from __future__ import annotations

import pytest
import torch
import zarr
from issue37_models import case

import bigconv


def _single(model, x):
    with torch.no_grad():
        out = model(x)
    if isinstance(out, dict):
        return {k: v for k, v in out.items()}
    return {str(i): v for i, v in enumerate(out)}


@pytest.mark.world(4)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name,written", [
    ("deep-supervision", ["0", "1"]),
    ("dict-heads", ["hv", "np", "tp"]),
    ("aux-classifier", ["0"]),
])
def test_predict_writes_an_array_per_dense_output(world, tmp_path, name, written):
    model, _, _, _ = case(name)
    x = torch.randn(2, 1, 64, 64, generator=torch.Generator().manual_seed(3), dtype=torch.float64)  # chunks of 16+
    want = _single(model, x)
    net = bigconv.parallelize(model, world, grid=(2, 2))
    path = net.predict(x, str(tmp_path / "pred.zarr"))
    group = zarr.open_group(path, mode="r")
    assert sorted(group.array_keys()) == written
    for key in written:
        got = torch.from_numpy(group[key][...])
        assert got.shape == want[key].shape and got.dtype == torch.float64
        assert (got - want[key]).abs().max() <= 1e-12 * want[key].abs().max(), key
    labels = zarr.open_group(net.predict(x, str(tmp_path / "labels.zarr"), keep="labels"), mode="r")
    for key in written:
        assert torch.equal(torch.from_numpy(labels[key][...]).long()[:, 0], want[key].argmax(1)), key


@pytest.mark.world(4)
@pytest.mark.timeout(120)
def test_predict_several_refusals_before_remote_work(world, monkeypatch, tmp_path):
    model, x, _, _ = case("deep-supervision")
    net = bigconv.parallelize(model, world, grid=(2, 2))
    monkeypatch.setattr(net, "_launch", lambda *_: pytest.fail("remote work started"))
    with pytest.raises(ValueError, match="OME-TIFF holds one image per output, but this batch has 2"):
        net.predict(x, str(tmp_path / "p.ome.tif"))
    model, x, _, _ = case("two-heads")
    net = bigconv.parallelize(model, world, grid=(2, 2))
    monkeypatch.setattr(net, "_launch", lambda *_: pytest.fail("remote work started"))
    with pytest.raises(ValueError, match="none of this model's 2 outputs is one"):
        net.predict(x, str(tmp_path / "q.zarr"))
    assert not (tmp_path / "q.zarr").exists()
