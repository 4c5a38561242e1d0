"""SlideDataset: tissue boxes, box-consistent augmentation and batches of sources, exact against one
process that transforms the whole slide."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
from verdicts import assert_exact

from bigconv.data import SlideDataset, SourceBatch, open_image, synthetic_slide, tissue_box
from bigconv.data import views
from bigconv.verify import compare_training


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("classes")
    for label in ("benign", "tumour"):
        (root / label).mkdir()
        for i in range(2):
            synthetic_slide(root / label / f"{i}.tif", (256, 512), levels=2, tile=64, seed=10 * i + len(label),
                            tissue=0.5)
        (root / label / "notes.txt").write_text("not a slide")
    return root


def test_views_are_the_whole_image_transformed(tmp_path):
    full = np.arange(3 * 9 * 7, dtype=np.uint8).reshape(3, 9, 7)
    np.save(tmp_path / "a.npy", full)
    src = open_image(tmp_path / "a.npy")
    padded = np.zeros((3, 7, 8), np.uint8)
    padded[:, :, 2:] = full[:, 1:8, 0:6]
    for k in range(8):
        v = src.view(crop=((1, 8), (-2, 6)), dihedral=k)  # reaches past the left edge: fill there
        want = views.apply(padded, k)
        assert v.shape[1:] == want.shape[1:]
        for box in (((0, want.shape[1]), (0, want.shape[2])), ((1, 4), (2, 5)), ((3, want.shape[1]), (0, 2))):
            assert np.array_equal(v.read(box), want[:, box[0][0]:box[0][1], box[1][0]:box[1][1]]), (k, box)


def test_folder_and_csv_give_the_same_items(folder, tmp_path):
    ds = SlideDataset(folder, level=1)
    assert len(ds) == 4 and [label for _, label in ds.records] == [0, 0, 1, 1]
    csv = tmp_path / "slides.csv"
    csv.write_text("path,label\n" + "".join(f"{p},{label}\n" for p, label in ds.records))
    again = SlideDataset(csv, level=1)
    assert again.records == ds.records


def test_tissue_box_holds_every_dark_pixel(folder):
    src = open_image(next(folder.glob("tumour/*.tif")), level=0)
    (r0, r1), (c0, c1) = tissue_box(src)
    whole = src.read()
    dark = whole.min(axis=0) < 220
    assert dark.any() and not dark[:r0].any() and not dark[r1:].any() and not dark[:, :c0].any()
    assert not dark[:, c1:].any()


@pytest.mark.world(4)
@pytest.mark.timeout(180)
def test_training_on_augmented_batches_equals_one_process(world, folder):
    ds = SlideDataset(folder, level=0, size=(96, 128), augment=True, seed=3, dtype="float64", scale=1 / 255)
    (xs, ys), = list(ds.batches(4, epoch=1))
    assert {s.dihedral for s in xs} - {0} and {s.dihedral for s in xs} <= {0, 2, 4, 6}  # non-square: no quarter turn
    for s in xs:  # what the workers read is the transformed crop of the whole slide
        stored = open_image(s.path, level=0, dtype="float64").view(crop=s.crop).read()
        assert np.array_equal(s.read(), views.apply(stored, s.dihedral))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, stride=2),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2)).double()
    r = compare_training(model, world, xs, ys, nn.CrossEntropyLoss(), grid=(2, 2))
    assert_exact(r)
    assert SourceBatch(xs).read().shape == (4, 3, 96, 128)


def test_augmentation_is_fixed_per_item_and_epoch(folder):
    ds = SlideDataset(folder, level=1, size=(64, 64), augment=True, seed=1)
    assert ds.item(2, epoch=5) == ds.item(2, epoch=5)
    draws = {(ds.item(i, e)[0].dihedral, ds.item(i, e)[0].crop) for i in range(4) for e in range(4)}
    assert len(draws) > 4  # it does vary over items and epochs
    assert any(d % 2 for d, _ in draws)  # a square size also draws quarter turns


def test_bad_dataset_inputs(tmp_path, folder):
    with pytest.raises(ValueError, match="no slides in class subfolders"):
        SlideDataset(tmp_path)
    bad = tmp_path / "bad.csv"
    bad.write_text("path,label\nonly_a_path\n")
    with pytest.raises(ValueError, match="needs a path and a label"):
        SlideDataset(bad)
    src = open_image(next(folder.glob("benign/*.tif")))
    with pytest.raises(ValueError, match="a view of a view"):
        src.view(dihedral=1).view(dihedral=2)


@pytest.mark.world(4)
@pytest.mark.timeout(180)
def test_prefetched_batches_train_as_read_ones(world, folder):
    """With prefetch the workers read each batch during the step before it; the weights are the same
    bit for bit as reading in the step, and the steps wait less for their reads."""
    import bigconv

    def run(prefetch: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                              nn.Linear(4, 2)).double()
        net = bigconv.parallelize(model, world, grid=(2, 2))
        net.optimizer(torch.optim.SGD, lr=0.1)
        ds = SlideDataset(folder, level=0, size=(128, 128), augment=True, dtype="float64", scale=1 / 255)
        world.reset_peaks()
        for xs, ys in ds.batches(2, prefetch=net if prefetch else None):
            net.train_step(xs, ys, nn.CrossEntropyLoss())
        stats = world.traffic()
        return net.state_dict(), stats

    plain, read_in_step = run(False)
    ahead, read_ahead = run(True)
    assert all(torch.equal(plain[k], ahead[k]) for k in plain)
    assert all(s["prefetch_read_s"] > 0 for s in read_ahead) and all(s["prefetch_read_s"] == 0 for s in read_in_step)


def test_slide_tables_as_users_keep_them(folder, tmp_path):
    """A header row (recognised by its names, or named by ``columns=``), class names mapped to indices
    with the mapping kept in ``classes``, and a bad row named by file, row and value (issue 34)."""
    ds = SlideDataset(folder, level=1)
    assert ds.classes == ["benign", "tumour"]
    names = {0: "normal", 1: "tumour"}
    table = tmp_path / "table.csv"
    table.write_text("slide_id,label\n" + "".join(f"{p},{names[label]}\n" for p, label in ds.records))
    named = SlideDataset(table, level=1)
    assert named.classes == ["normal", "tumour"] and named.records == ds.records
    other = tmp_path / "other.csv"
    other.write_text("case,scanner,diagnosis\n" + "".join(f"{p},x,{names[label]}\n" for p, label in ds.records))
    assert SlideDataset(other, level=1, columns=("case", "diagnosis")).records == ds.records
    pairs = SlideDataset([(p, names[label]) for p, label in ds.records], level=1)
    assert pairs.classes == ["normal", "tumour"] and pairs.records == ds.records
    bad = tmp_path / "bad.csv"
    bad.write_text("slide_id,label\n" + f"{ds.records[0][0]},0\n{ds.records[1][0]},\n")
    with pytest.raises(ValueError, match=r"bad\.csv' row 3: needs a path and a label"):
        SlideDataset(bad, level=1)
    mixed = tmp_path / "mixed.csv"
    mixed.write_text(f"{ds.records[0][0]},0\n{ds.records[1][0]},tumour\n")
    with pytest.raises(ValueError, match="integer label 0 among class names"):
        SlideDataset(mixed, level=1)


@pytest.mark.world(4)
@pytest.mark.timeout(120)
def test_class_names_travel_with_a_checkpoint(world, folder, tmp_path):
    import bigconv
    from bigconv import saving

    ds = SlideDataset(folder, level=1)
    net = bigconv.parallelize(nn.Sequential(nn.Conv2d(3, 2, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten()), world,
                              grid=(2, 2))
    net.save(tmp_path / "ck.pt", extra={"classes": ds.classes})
    assert saving.read(tmp_path / "ck.pt")["extra"] == {"classes": ["benign", "tumour"]}
