"""``--tune``: settings chosen on a labelled target validation split, measured on fresh seeds.

- The validation split (multidsn/mnist.py) is disjoint from the test digits and from both training splits,
  and leaves the test images as they were.
- The tuning run (multidsn/paper_tuning.py) gives every row the same trial budget, scores trials on the
  validation split only, records one selection per row, trains the chosen settings on fresh seeds scored on
  the test split, resumes without retraining, and its report prints intervals and what they support.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from multidsn import mnist, paper_tuning, recipes, train
from multidsn.data import Domain


@pytest.mark.timeout(300)
def test_the_validation_split_is_disjoint_from_test_and_training():
    digits, labels = mnist.mnist_digits()
    test = mnist.split(labels)
    val = mnist.validation_mask(labels, test, 100)
    assert not (val & test).any() and np.bincount(labels[val]).tolist() == [100] * 10
    source, (target,), v = mnist.validation_domain(val_per_class=100)
    _, (plain,) = mnist.paper_domains()
    assert len(source.train_x) == len(target.train_x) == 3000 and len(v.test_x) == 1000 and len(v.train_x) == 0
    assert torch.equal(target.test_x, plain.test_x)  # the test images do not change
    seen = {x.numpy().tobytes() for x in torch.cat([target.train_x, target.test_x])}
    assert not any(x.numpy().tobytes() in seen for x in v.test_x)  # no validation image is trained or tested on
    assert v.test_light is not None and len(v.test_light) == 1000


def test_every_row_gets_the_same_budget_and_its_own_setting_first():
    r = recipes.PaperRecipe()
    trials = {m: paper_tuning.trial_params(r, m, 4) for m in paper_tuning.TUNED}
    assert {len(t) for t in trials.values()} == {4}
    assert trials["dsn_mmd"][0]["lr"] == 0.01 and trials["dann"][0] == {"lr": 0.02, "gamma": 1.0}
    assert trials == {m: paper_tuning.trial_params(r, m, 4) for m in paper_tuning.TUNED}  # a fixed draw
    with pytest.raises(ValueError, match="tuning seeds"):
        paper_tuning.Protocol(tune_seeds=(1,), seeds=(1, 2))


def small(n: int = 40, size: int = 32):
    g = torch.Generator().manual_seed(0)
    x = torch.rand(n, 3, size, size, generator=g) * 2 - 1
    y = torch.arange(n) % 10
    val = Domain("mnistm", x[:0], y[:0], -x[:20], y[:20], test_light=torch.arange(20) % 2 == 0)
    return Domain("s", x, y, x, y), [Domain("mnistm", -x, y, -x[20:], y[20:])], val


@pytest.mark.timeout(300)
def test_tuning_records_trials_on_val_a_selection_and_fresh_seeds_on_test(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(mnist, "validation_domain", lambda size=32, val_per_class=100: small())
    monkeypatch.setattr(paper_tuning, "_DATA", {})
    out = tmp_path / "tune.jsonl"
    argv = ["--tune", "--trials", "2", "--tune-seeds", "100", "--seeds", "1,2", "--steps", "3", "--warmup", "1",
            "--batch-size", "4", "--out", str(out), "-q"]
    train.main(argv)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    runs = [r for r in lines if r["record"] == "run"]
    val = [r for r in runs if r["split"] == "val"]
    assert sorted((r["method"], r["seed_role"]) for r in val) == sorted(
        (m, "tuning") for m in paper_tuning.TUNED for _ in range(2))
    assert all(r["seed"] == 100 and r["selected_on"] is None for r in val)
    sel = [r for r in lines if r["record"] == "selection"]
    assert sorted(r["method"] for r in sel) == sorted(paper_tuning.TUNED)
    for r in sel:
        assert r["trial_budget"] == 2 and len(r["trials"]) == 2 and r["selected_on"] == "val"
        assert r["chosen"] == max(r["trials"], key=lambda t: (t["val_acc"], -t["trial"]))["params"]
    fresh = [r for r in runs if r["split"] == "test"]
    assert sorted((r["method"], r["seed"]) for r in fresh) == sorted((m, s) for m in paper_tuning.TUNED for s in (1, 2))
    assert all(r["seed_role"] == "fresh" and r["selected_on"] == "val" for r in fresh)
    printed = capsys.readouterr().out
    assert "dsn_dann - dann, paired over seeds" in printed and "MET" not in printed
    for r in sel:  # every trial is printed with its validation accuracy, the chosen one marked
        listed = next(x for x in printed.splitlines() if x.startswith(f"- {r['method']}: "))
        assert listed.count(": lr ") == 2 and f"*{r['chosen_trial']}: " in listed
        assert f"{100 * r['trials'][0]['val_acc']:.1f}" in listed
    train.main(argv)  # all recorded: nothing trains, no second selection
    assert len(out.read_text().splitlines()) == len(lines)


def test_the_tuning_report_reads_the_committed_records_and_training_never_writes_them():
    assert train.parse_args(["--tune", "--report"]).out == train.COMMITTED["paper"]
    assert train.parse_args(["--tune"]).out == "runs/multidsn_tuning.jsonl"
    assert train.parse_args(["--tune", "--quick", "--report"]).out == "runs/multidsn_tuning_quick.jsonl"
