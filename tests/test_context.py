"""The context benchmark: its data generator, its refusals, its CNN on bigconv and its quick run's records.

The generator must put a 6 and a 9 exactly ``dial`` tiles apart on one row, label the image 1 exactly
when the 6 is on the left, and build training and test images from disjoint halves of the real MNIST
digits. A dial, size or tile that cannot be laid out is refused with a ValueError naming the limit
before anything trains. The whole-image CNN must train on 4 bigconv workers as in one process
(float64). ``python -m experiments.context --quick`` must write one record per (method, dial, seed)
with the documented fields and units (the whole-image run on 4 bigconv workers) and skip every
recorded run when rerun. A failure here points to ``experiments/context*.py`` or ``plots/context.py``.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from experiments import context
from experiments.context_data import CLASSES, ContextData, Layout, digit_ids, shrink, tiles


@pytest.mark.parametrize("dial", [0.25, 1.5, 3.5])
def test_labels_follow_the_rule_and_the_dial_sets_the_distance(dial):
    layout = Layout(size=256, tile=32, dial=dial, digit=8)
    x, y, where = ContextData(layout, train=True).batch(24, seed=3)
    assert x.shape == (24, 1, 256, 256) and y.dtype == torch.int64
    assert 0 < int(y.sum()) < 24  # both labels occur
    for i in range(24):
        x6, x9, row = where["x6"][i], where["x9"][i], where["row"][i]
        assert abs(x9 - x6) == layout.distance == round(dial * 32)
        assert int(y[i]) == int(x6 < x9)  # label 1 iff the 6 is left of the 9
        ink = x[i, 0]
        assert float(ink.sum()) == pytest.approx(float(ink[row:row + 8, x6:x6 + 8].sum() +
                                                       ink[row:row + 8, x9:x9 + 8].sum()), rel=1e-6)


def test_train_and_test_digits_are_disjoint_and_images_use_their_own_half():
    train, test = digit_ids(True), digit_ids(False)
    for c in CLASSES:
        assert len(train[c]) == len(test[c]) == 250
        assert not set(train[c]) & set(test[c])
    layout = Layout(size=64, tile=32, dial=1.0, digit=8)
    tr, te = ContextData(layout, train=True), ContextData(layout, train=False)
    x, _, where = tr.batch(6, seed=0)
    for i in range(6):
        for c in CLASSES:
            patch = x[i, 0, where["row"][i]:where["row"][i] + 8, where[f"x{c}"][i]:where[f"x{c}"][i] + 8]
            assert any(torch.equal(patch, d) for d in tr.digits[c])
            assert not any(torch.equal(patch, d) for d in te.digits[c])


def test_tiles_and_shrink():
    x = torch.arange(2 * 64 * 64, dtype=torch.float32).reshape(2, 1, 64, 64)
    bag = tiles(x, 32)
    assert bag.shape == (2, 4, 1, 32, 32)
    assert torch.equal(bag[1, 1, 0], x[1, 0, :32, 32:])  # row-major: tile 1 is the top right
    assert torch.equal(bag[1, 2, 0], x[1, 0, 32:, :32])
    assert shrink(x, 2).shape == (2, 1, 32, 32)
    assert float(shrink(x, 2)[0, 0, 0, 0]) == float(x[0, 0, :2, :2].mean())


@pytest.mark.parametrize("kw, text", [
    (dict(size=128, tile=256, dial=0.5), "larger than the image"),
    (dict(size=128, tile=48, dial=0.5), "does not divide"),
    (dict(size=128, tile=32, dial=4.0), "largest dial is 3.75"),
    (dict(size=128, tile=32, dial=0.1), "smallest dial is 0.25"),
    (dict(size=128, tile=32, dial=-1), "positive number of tiles"),
    (dict(size=128, tile=32, dial=0.5, digit=64), "larger than a tile"),
    (dict(size=0, tile=32, dial=0.5), "positive integer"),
])
def test_bad_layouts_are_refused_naming_the_limit(kw, text):
    with pytest.raises(ValueError, match=text):
        Layout(**kw)


def test_the_cli_refuses_before_training(tmp_path):
    out = tmp_path / "c.jsonl"
    with pytest.raises(ValueError, match="largest dial"):
        context.main(["--quick", "--dials", "0.5,9", "--out", str(out)])
    with pytest.raises(ValueError, match="multiples of 32"):
        context.main(["--quick", "--tile", "48", "--out", str(out)])
    with pytest.raises(ValueError, match="larger than the image"):
        context.main(["--quick", "--tile", "256", "--out", str(out)])
    assert not out.exists()  # nothing ran


def test_the_cnn_fits_tiles_and_images():
    cnn = context.ContextCNN(8)
    assert cnn(torch.zeros(2, 1, 64, 64)).shape == (2, 2)
    mil = context.TileMIL(cnn, 8)
    assert mil(torch.zeros(3, 4, 1, 32, 32)).shape == (3,)


@pytest.mark.own_world
@pytest.mark.timeout(240)
def test_quick_run_writes_records_and_a_rerun_skips_them(tmp_path, exclusive):
    out, fig = tmp_path / "context.jsonl", tmp_path / "fig"
    context.main(["--quick", "--out", str(out), "--figure", str(fig)])
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    s = context.quick_setting()
    assert len(recs) == len(s.dials) * len(s.seeds) * len(context.METHODS)
    assert {(r["method"], r["dial"], r["seed"]) for r in recs} == \
        {(m, d, k) for m in context.METHODS for d in s.dials for k in s.seeds}
    for r in recs:
        for key in ("method", "dial", "seed", "accuracy", "image_size", "tile_size", "processes", "commit",
                    "distance_px", "steps", "batch", "test_images"):
            assert key in r, key
        assert 0.0 <= r["accuracy"] <= 1.0  # a fraction
        assert r["accuracy"] * r["test_images"] == pytest.approx(round(r["accuracy"] * r["test_images"]))
        assert r["image_size"] == 128 and r["tile_size"] == 32 and r["steps"] == s.steps
        assert r["distance_px"] == round(r["dial"] * 32)
        assert r["processes"] == (4 if r["method"] == "whole" else 1)
        assert r["input_size"] == {"whole": 128, "mil": 32, "transmil": 32, "tilegrid": 32,
                                   "downsampled": 64}[r["method"]]
    assert all(r["grid"] == [2, 2] for r in recs if r["method"] == "whole")
    assert os.path.exists(f"{fig}.png") and os.path.exists(f"{fig}.pdf")
    context.main(["--quick", "--out", str(out), "--figure", str(fig)])  # everything recorded: nothing runs
    assert len(out.read_text().splitlines()) == len(recs)


def test_same_data_order_for_every_method():
    s = context.quick_setting()
    data = ContextData(s.layouts[0], train=True)
    a = [y for _, y in context._batches(data, s, seed=1)]
    b = [y for _, y in context._batches(data, s, seed=1)]
    c = [y for _, y in context._batches(data, s, seed=2)]
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert not all(torch.equal(p, q) for p, q in zip(a, c))
    assert np.isclose(s.shrink, 2)


@pytest.mark.own_world
@pytest.mark.timeout(180)
def test_the_whole_image_cnn_trains_on_bigconv_as_in_one_process(exclusive):
    """The ``whole`` method's CNN (dilated convs on maps thinner than their halos, BatchNorm, global max
    pool) on 4 workers against one process in float64: ``bigconv.verify``'s verdict on every tensor."""
    import bigconv
    from bigconv.verify import compare_training

    x, y, _ = ContextData(Layout(size=128, tile=32, dial=2.5), train=True).batch(2, seed=0)
    torch.manual_seed(0)
    model = context.ContextCNN(4).double()
    with bigconv.World(workers=4, threads_per_worker=1) as world:
        r = compare_training(model, world, x.double(), y, torch.nn.CrossEntropyLoss(), grid=(2, 2))
    # The global max pool sends the input gradient to one position of each tied maximum: rounding alone in one
    # process (channels-last, a reversed batch) moves it to another, so the input gradient is ill-conditioned;
    # every other tensor, the weights included, is within 1e-9 of its own size.
    assert not r["wrong"], list(r["wrong"])[:3]
    assert {(t["category"], t["tensor"]) for t in r["ill_conditioned"]} <= {("input_grad", "input")}, r["verdict"]
    assert all(r[k] <= 1e-9 for k in ("forward", "param_grads", "loss", "weights")), r["worst"]


def test_figures_go_beside_a_given_out(tmp_path, monkeypatch):
    """With --out DIR/x.jsonl and no --figure, the figure is written into DIR, not the checkout's figures/
    (issue 53 item 13); without --out it stays in figures/."""
    import plots.context

    stems = []
    monkeypatch.setattr(plots.context, "draw", lambda recs, stem, title: stems.append(stem) or [])
    context.main(["--quick", "--report", "--out", str(tmp_path / "x.jsonl")])
    context.main(["--quick", "--report"])
    assert stems == [str(tmp_path / "context_quick"), "figures/context_quick"]
