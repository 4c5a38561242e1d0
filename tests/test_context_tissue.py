"""The context benchmark on real tissue (issue 54): its data, its statistics and its sweep's machinery.

The backgrounds must come from the pinned wheel files (a wrong digest refused, naming the file), every tile of a
crop must hold tissue, training and test backgrounds must come from disjoint rows, the digits must be drawn as
haematoxylin (optical density added along the stain vector, nothing else changed) with labels by each task's
rule, and a colour-histogram classifier must not find the label (while it does find a label planted in the
colours). Holm's correction, the exact sign-flip test and the learning-rate grid's widening are checked on
known cases. A failure points to experiments/context_tissue*.py.
"""

from __future__ import annotations

import json
import os
import zipfile

import numpy as np
import pytest

from experiments import context_tissue as ct
from experiments import context_tissue_data as td

SMALL = td.TissueLayout(size=256, tile=32, digit=8, dial=2.5)


def test_a_wrong_digest_is_refused_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(td, "_installed", lambda src: None)
    src = td.SOURCES["target"]
    with pytest.raises(FileNotFoundError, match="pip download --no-deps tiatoolbox==2.1.3"):
        td.source_bytes("target", cache=str(tmp_path), download=False)
    with zipfile.ZipFile(tmp_path / src.wheel, "w") as z:
        z.writestr(src.member, b"not the image")
    with pytest.raises(ValueError, match=f"{src.wheel}:{src.member}: sha256 .* is not the pinned"):
        td.source_bytes("target", cache=str(tmp_path), download=False)


def test_the_pinned_files_read_at_their_sizes():
    assert td.rgb("cmu").shape == (2967, 2220, 3) and td.rgb("target").shape == (1000, 1000, 3)
    cache = td.WHEEL_CACHE
    if os.path.exists(os.path.join(cache, td.SOURCES["cmu"].wheel)):  # the same bytes from the wheel as installed
        assert len(td.source_bytes("cmu", cache=cache)) == 1938955


def _background(data: td.TissueData, where: dict, i: int) -> np.ndarray:
    y, x = where["corner"][i]
    bg = td.rgb(data.source)[y:y + data.layout.size, x:x + data.layout.size]
    return np.rot90(bg[:, ::-1] if where["flip"][i] else bg, where["turn"][i]).copy()


@pytest.mark.parametrize("task", td.TISSUE_TASKS)
def test_labels_follow_the_rule_and_digits_are_stain_on_tissue(task):
    data = td.TissueData(SMALL, task, "fit")
    x, y, where = data.batch(12, seed=4)
    assert x.dtype == np.uint8 and x.shape == (12, 256, 256, 3) and 0 < int(y.sum()) < 12
    p, d = SMALL.digit, SMALL.distance
    for i in range(12):
        pair, label = where["classes"][i], int(y[i])
        if task == "order":
            assert pair == ([6, 9] if label else [9, 6])  # label 1 iff the 6 is left
        else:
            assert pair.count(3) == label and set(pair) - {3} <= {5, 8}
        bg = _background(data, where, i)
        r, left = where["row"][i], where["x_left"][i]
        boxes = np.zeros(bg.shape[:2], bool)
        redo = bg.copy()
        for c, col, k in zip(pair, (left, left + d), where["digits"][i]):
            boxes[r:r + p, col:col + p] = True
            td.draw_stain(redo, data.digits[c][k], r, col)  # that class's digit, drawn as stain on the background
        assert np.array_equal(redo, x[i])
        assert np.array_equal(x[i][~boxes], bg[~boxes])  # nothing else changed
        assert (x[i][boxes].astype(int) <= bg[boxes].astype(int)).all()  # stain only darkens


def test_stain_adds_optical_density_along_haematoxylin():
    bg = np.full((4, 4, 3), 200, np.uint8)
    ink = np.zeros((2, 2))
    ink[0, 0] = 1.0
    td.draw_stain(bg, ink, 1, 1, strength=1.0)
    od = -np.log(bg[1, 1] / 200.0)
    assert np.allclose(od, td.STAIN_OD, atol=0.02)  # uint8 rounding
    assert (bg[1, 2] == 200).all() and (bg[0, 0] == 200).all()


def test_every_tile_of_a_crop_holds_tissue():
    data = td.TissueData(SMALL, "has3", "test")
    x, _, where = data.batch(6, seed=1)
    for i in range(6):
        mask = td.tissue_mask(_background(data, where, i))
        fr = mask.reshape(8, 32, 8, 32).mean((1, 3))
        assert fr.min() >= td.MIN_TISSUE


def test_training_and_test_backgrounds_are_disjoint():
    td.check_regions()
    for split, (source, rows) in td.REGIONS.items():
        if rows is None:
            continue
        corners = td.crop_corners(source, rows, SMALL.size, SMALL.tile)
        assert corners[:, 0].min() >= rows[0] and corners[:, 0].max() + SMALL.size <= rows[1]
    assert td.TEST_ROWS[1] <= td.FIT_ROWS[0]
    planted = {**td.REGIONS, "test": ("cmu", (1700, 2967))}
    with pytest.raises(ValueError, match="may overlap"):
        td.check_regions(planted)
    planted = {**td.REGIONS, "val": ("target", None)}
    with pytest.raises(ValueError, match="may overlap"):
        td.check_regions(planted)


def test_validation_and_test_images_use_their_own_digits():
    fit, val, test = (td.TissueData(SMALL, "order", s) for s in ("fit", "val", "test"))
    for c in (6, 9):
        a, b, t = fit.digits[c], val.digits[c], test.digits[c]
        assert not any((t == d).all((1, 2)).any() for d in a) and not any((b == d).all((1, 2)).any() for d in a)


def test_the_colour_histogram_control_is_at_chance_and_finds_a_planted_colour_label(monkeypatch):
    tiny = td.TissueLayout(size=128, tile=32, digit=8, dial=2.5)
    r = td.colour_control(tiny, "has3", n_train=120, n_test=120)
    assert 0.5 - 0.12 < r["accuracy"] < 0.5 + 0.12, r
    real = td.TissueData.batch

    def tinted(self, n, seed):  # planted: positive images a little redder
        x, y, w = real(self, n, seed)
        x[y.numpy() == 1, ..., 0] = np.minimum(x[y.numpy() == 1, ..., 0].astype(int) + 12, 255)
        return x, y, w

    monkeypatch.setattr(td.TissueData, "batch", tinted)
    assert td.colour_control(tiny, "has3", n_train=120, n_test=120)["accuracy"] > 0.8


def test_holm_and_the_sign_flip_test_on_known_cases():
    assert ct.holm([0.01, 0.04, 0.03, 0.5]) == pytest.approx([0.04, 0.09, 0.09, 0.5])
    assert ct.sign_flip_p([0.1] * 8) == pytest.approx(2 / 256)  # the smallest two-sided p with 8 seeds
    assert ct.sign_flip_p([0.1, -0.1]) == 1.0
    from scipy import stats

    a = {k: 0.8 + 0.01 * k for k in range(8)}
    b = {k: 0.7 + 0.02 * (k % 3) for k in range(8)}
    got = ct.paired_test(a, b)
    d = [a[k] - b[k] for k in range(8)]
    assert got["p_t"] == pytest.approx(stats.ttest_1samp(d, 0).pvalue)
    assert got["low"] < got["mean"] < got["high"] and got["n"] == 8


def _run(task, method, seed, lr, loss, role="tuning", s=None):
    s = s or ct.TissueSetting()
    return {"bench": ct.BENCH, "record": "run", "task": task, "method": method, "role": role, "seed": seed, "lr": lr,
            "image_size": s.size, "tile_size": s.tile, "digit_size": s.digit, "dial": s.dial, "batch": s.batch,
            "max_steps": s.max_steps, "min_steps": s.min_steps, "eval_every": s.eval_every, "patience": s.patience,
            "val_images": s.val_images, "test_images": s.test_images if role == "fresh" else None,
            "width": s.width, "processes": s.processes if method == "whole" else 1, "arch": ct._arch(s, method),
            "best_val_loss": loss, "best_val_acc": 1 - loss, "stopped": "patience", "train_s": 1.0}


def test_a_choice_on_the_grid_edge_widens_the_grid_until_inside():
    s = ct.TissueSetting()
    loss = {3e-4: 0.6, 1e-3: 0.5, 3e-3: 0.4}
    recs = [_run("has3", "mil", k, lr, v) for lr, v in loss.items() for k in s.tune_seeds]
    sel = ct.selection(s, "has3", "mil", recs)
    assert not sel["final"] and sel["grid"] == [3e-4, 1e-3, 3e-3, 9e-3]
    assert sorted(sel["missing"]) == [(9e-3, 100), (9e-3, 101)]  # the new rate, on both tuning seeds
    recs += [_run("has3", "mil", k, 9e-3, 0.45) for k in s.tune_seeds]
    sel = ct.selection(s, "has3", "mil", recs)
    assert sel["final"] and sel["chosen_lr"] == 3e-3 and sel["edge"] is None and sel["widened"] == [9e-3]
    # still on the edge after `widen` widenings: final, and said so
    recs = [_run("order", "mil", k, lr, v) for lr, v in {3e-4: .3, 1e-3: .5, 3e-3: .6, 9e-5: .2, 2.7e-5: .1}.items()
            for k in s.tune_seeds]
    sel = ct.selection(s, "order", "mil", recs)
    assert sel["final"] and sel["edge"] == "low" and sel["widened"] == [9e-5, 2.7e-5]
    # a run of another protocol (another step cap) is not counted
    other = ct.TissueSetting(max_steps=100, min_steps=50)
    assert ct.selection(s, "has3", "whole", [_run("has3", "whole", 100, 1e-3, .1, s=other)])["missing"]


def test_the_named_comparisons_are_corrected_together():
    s = ct.TissueSetting()
    recs = [_run(t, m, k, lr, 0.5) for t in s.tasks for m in s.methods for lr in s.lrs for k in s.tune_seeds]
    for r in recs:
        r["best_val_loss"] = {3e-4: .6, 1e-3: .4, 3e-3: .5}[r["lr"]]
    for t in s.tasks:
        for m in s.methods:
            for k in s.seeds:
                r = _run(t, m, k, 1e-3, 0.4, role="fresh")
                acc = 0.9 + 0.001 * k if m == "whole" else 0.6 + 0.01 * (k % 3)
                r["scores"] = {d: {"accuracy": acc} for d in ct.DOMAINS}
                recs.append(r)
    rows = ct.comparisons(s, recs, "test")
    assert len(rows) == 10 and all(r["n"] == 8 for r in rows)
    assert all(r["p_holm"] == pytest.approx(min(1.0, r["p_t"] * 10)) for r in rows)  # equal p's: x 10 each
    text = "\n".join(ct.report(s, recs))
    assert "| has3 | shrink8 | 8 |" in text and "p (Holm)" in text


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_pause_gap_moves_running_runs_forward(tmp_path):
    """A sweep stopped (SIGSTOP to its process group) for longer than a run's timeout resumes without stopping the
    run; with the pause counted (planted: ``PAUSE_GAP`` never reached) the same run is stopped as too slow."""
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "s.py"
    script.write_text(
        "import sys\nfrom experiments import context_jobs as cj\n"
        "if sys.argv[1] == 'planted': cj.PAUSE_GAP = 1e9\n"
        "child = \"import sys, time\\nsys.stdin.read()\\nfor _ in range(20): time.sleep(0.1)\\n"
        "print('context-run-result: {}')\"\n"
        "cj.run_jobs([cj.Job({}, 1, 'sleeper')], 1, lambda *a: print('ok:' + str(len(a))), timeout=8, child=child)\n")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    for mode, ok in (("real", True), ("planted", False)):
        p = subprocess.Popen([sys.executable, str(script), mode], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             env=env, start_new_session=True, text=True)
        time.sleep(1.5)
        os.killpg(p.pid, signal.SIGSTOP)  # the parent, its child: the whole group, as the lead pauses a sweep
        time.sleep(12.0)
        os.killpg(p.pid, signal.SIGCONT)
        out, _ = p.communicate(timeout=120)
        assert ("ok:3" in out) == ok and (p.returncode == 0) == ok, (mode, out[-500:])


@pytest.mark.slow
@pytest.mark.own_world
@pytest.mark.timeout(900)
def test_quick_run_records_every_cell_and_a_rerun_trains_nothing(tmp_path, exclusive):
    out = tmp_path / "t.jsonl"
    argv = ["--quick", "--figure", str(tmp_path / "fig"), "--out", str(out), "--methods", "whole,shrink8,tilegrid",
            "--tasks", "has3"]
    ct.main(argv)
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    fresh = [r for r in recs if r["record"] == "run" and r["role"] == "fresh"]
    assert {r["method"] for r in fresh} == {"whole", "shrink8", "tilegrid"}
    for r in fresh:
        assert set(r["scores"]) == {"test", "domain2"} and r["scores"]["test"]["images"] == 8
        assert r["best_step"] <= r["steps_run"] <= 6 and r["val_curve"] and r["commit"] and r["host"]
        assert r["processes"] == (2 if r["method"] == "whole" else 1)
    assert sum(r["record"] == "selection" for r in recs) == 3
    n = len(recs)
    ct.main(argv)
    assert len(out.read_text().splitlines()) == n
    assert (tmp_path / "fig.png").exists() and (tmp_path / "fig_curves.png").exists()
