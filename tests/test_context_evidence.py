"""The context benchmark's evidence machinery (issue 35): the second task, the validation digits, the tile
methods that see positions, the matched stem, the learning-rate selection and the report's intervals. A
failure points at experiments/context*.py or plots/context.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from experiments import context
from experiments.context_data import TASKS, ContextData, Layout, digit_ids, tiles
from experiments.context_models import ContextCNN, TileGridCNN, TileTransMIL


def test_the_same_task_labels_follow_the_rule():
    layout = Layout(size=128, tile=32, dial=1.5, digit=8)
    x, y, where = ContextData(layout, True, "same").batch(64, 3)
    assert 0.3 < y.float().mean() < 0.7
    for label, pair in zip(y.tolist(), where["classes"]):
        assert set(pair) <= set(TASKS["same"]) and (pair[0] == pair[1]) == bool(label)
    assert ContextData(layout, True, "order").batch(4, 3)[0].equal(ContextData(layout, True).batch(4, 3)[0])


def test_the_has3_task_labels_follow_the_rule_and_the_pixels_are_those_digits():
    layout = Layout(size=128, tile=32, dial=1.5, digit=8)
    data = ContextData(layout, True, "has3")
    x, y, where = data.batch(64, 5)
    assert 0.3 < y.float().mean() < 0.7
    sides = set()
    for i, (label, pair) in enumerate(zip(y.tolist(), where["classes"])):
        assert pair.count(3) == label and set(pair) - {3} <= {5, 8}  # exactly one 3 iff positive
        sides |= {pair.index(3)} if label else set()
        for c, col in zip(pair, (where["x_left"][i], where["x_left"][i] + layout.distance)):
            r = where["row"][i]
            patch = x[i, 0, r:r + 8, col:col + 8]
            assert (data.digits[c] == patch).flatten(1).all(1).any()  # one of that class's digits
    assert sides == {0, 1}  # the 3 sits left and right


@pytest.mark.parametrize("classes", list(TASKS.values()))
def test_validation_digits_are_training_digits_never_fitted_or_tested(classes):
    fit, val, test, train = (digit_ids(True, classes, "fit"), digit_ids(True, classes, "val"),
                             digit_ids(False, classes), digit_ids(True, classes))
    for c in classes:
        assert len(val[c]) > 0 and not set(val[c]) & set(fit[c]) and not set(val[c]) & set(test[c])
        assert sorted([*fit[c], *val[c]]) == sorted(train[c])  # the training half, split
    with pytest.raises(ValueError, match="part"):
        digit_ids(False, classes, "val")


class Flat(torch.nn.Module):
    """A stand-in tile CNN whose embedding is the tile itself: the heads alone are tested."""

    def embed(self, x):
        return x.flatten(1)


def test_position_aware_tile_methods_see_where_tiles_lie():
    from experiments.context_models import TileMIL

    torch.manual_seed(0)
    bags = torch.randn(2, 16, 8)
    moved = bags[:, torch.randperm(16)]  # the same tiles, other places
    abmil = TileMIL(ContextCNN(8), 8)
    abmil.cnn = Flat()
    with torch.no_grad():  # the unordered bag cannot tell: the check can see a difference only where there is one
        assert torch.allclose(abmil(bags), abmil(moved), atol=1e-5)
    for model in (TileTransMIL(ContextCNN(8), 8), TileGridCNN(ContextCNN(8), 8, 4)):
        model.cnn = Flat()
        model.eval()
        with torch.no_grad():
            assert not torch.allclose(model(bags), model(moved), atol=1e-6), type(model).__name__
    with pytest.raises(ValueError, match="grid"):
        TileGridCNN(ContextCNN(8), 8, 4)(torch.rand(1, 9, 1, 32, 32))
    assert tiles(torch.arange(16.0).reshape(1, 1, 4, 4), 2)[0, 1, 0].tolist() == [[2.0, 3.0], [6.0, 7.0]]


def test_the_matched_stem_gives_the_whole_image_map():
    s = context.Setting(size=512, tile=64, stem="matched")
    whole, small = ContextCNN(4), ContextCNN(4, stem=context._stem(s))
    assert context._stem(s) == 2
    assert whole.trunk(torch.rand(1, 1, 512, 512)).shape == small.trunk(torch.rand(1, 1, 256, 256)).shape
    with pytest.raises(ValueError, match="tune_seed"):
        context.Setting(lrs=(1e-3,), seeds=(100,))


@pytest.mark.timeout(600)
def test_learning_rates_are_chosen_on_validation_digits_and_the_report_gives_intervals(tmp_path, capsys):
    out = tmp_path / "ctx.jsonl"
    argv = ["--quick", "--tasks", "order,same", "--methods", "mil,tilegrid,downsampled", "--stem", "matched",
            "--lrs", "0.001,0.01", "--seeds", "0,1", "--dials", "2.5", "--steps", "3", "--out", str(out),
            "--figure", str(tmp_path / "fig")]
    context.main(argv)
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    trials = [r for r in recs if r.get("split") == "val"]
    assert sorted((r["task"], r["method"], r["lr"]) for r in trials) == sorted(
        (t, m, lr) for t in ("order", "same") for m in ("mil", "tilegrid", "downsampled") for lr in (0.001, 0.01))
    assert all(r["seed"] == 100 and r["seed_role"] == "tuning" for r in trials)
    sel = {(r["task"], r["method"]): r for r in recs if r.get("record") == "selection"}
    assert len(sel) == 6
    for (task, method), r in sel.items():
        best = max(r["trials"], key=lambda t: (t["val_acc_mean"], -r["lrs"].index(t["lr"])))
        assert r["chosen_lr"] == best["lr"] and r["trial_budget"] == 2
        runs = [x for x in recs if x.get("split") == "test" and x["task"] == task and x["method"] == method]
        assert sorted(x["seed"] for x in runs) == [0, 1]
        assert all(x["lr"] == r["chosen_lr"] and x["seed_role"] == "fresh" and x["selected_on"] == "val"
                   for x in runs)
    assert all(r["stem"] == 2 for r in recs if r.get("method") == "downsampled" and r["record"] == "run")
    printed = capsys.readouterr().out
    assert "task same" in printed and "task order" in printed and "selection: same mil" in printed
    trial_rows = [line for line in printed.splitlines() if line.startswith("| tilegrid | 0.01 |")]
    assert "trials, task same" in printed and len(trial_rows) == 2  # a trials row per task
    r = next(x for x in trials if x["task"] == "order" and x["method"] == "tilegrid" and x["lr"] == 0.01)
    assert f"{r['accuracy']:.3f} ({r['train_loss_tail']:.3f})" in trial_rows[0] + trial_rows[1]
    assert (tmp_path / "fig_same.png").exists() and (tmp_path / "fig_order.png").exists()
    n = len(recs)
    context.main(argv)  # all recorded: nothing trains, no second selection
    assert len(out.read_text().splitlines()) == n


def test_the_table_gives_intervals_and_paired_differences():
    recs = [{"bench": "context", "task": "order", "method": m, "dial": 1.5, "seed": k, "distance_px": 96,
             "accuracy": a + 0.01 * k, "train_loss_tail": 0.1}
            for m, a in (("whole", 0.9), ("transmil", 0.6)) for k in range(5)]
    text = "\n".join(context.table(recs))
    assert "0.920 [0.90, 0.94] (n=5)" in text and "+0.300 [+0.300, +0.300] (n=5)" in text
    recs[5]["train_loss_tail"] = 0.69
    assert "1 did not train" in "\n".join(context.table(recs))
    assert np.isclose(0.92, np.mean([r["accuracy"] for r in recs[:5]]))


def test_the_loss_curve_averages_equal_runs_of_steps():
    assert context._curve([float(i) for i in range(60)]) == [0.5 + 2 * i for i in range(30)]
    assert context._curve([3.0, 1.0]) == [3.0, 1.0]  # fewer steps than points: every step
    assert len(context._curve([0.0] * 3000)) == context.CURVE_POINTS


@pytest.mark.timeout(300)
def test_trials_only_stops_after_the_selections(tmp_path):
    out = tmp_path / "ctx.jsonl"
    argv = ["--quick", "--tasks", "order", "--methods", "downsampled", "--lrs", "0.001,0.01", "--dials", "2.5",
            "--steps", "60", "--out", str(out), "--figure", str(tmp_path / "fig")]
    context.main(argv + ["--trials-only"])
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    runs = [r for r in recs if r["record"] == "run"]
    assert len(runs) == 2 and all(r["split"] == "val" for r in runs)
    assert [r["record"] for r in recs].count("selection") == 1
    for r in runs:  # the last 3 points of the curve are the last 6 steps: the recorded tail
        assert len(r["loss_curve"]) == 30
        assert sum(r["loss_curve"][-3:]) / 3 == pytest.approx(r["train_loss_tail"], abs=1e-4)
    context.main(argv)  # the test runs go on from the recorded trials, none retrained
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["split"] for r in recs if r["record"] == "run") == ["test", "val", "val"]
    with pytest.raises(SystemExit):
        context.main(argv + ["--trials-only", "--report"])
