"""``python -m plots`` draws every results file it is given, or names why it cannot: the context, the DSN
paper recipe, the alternatives and the core benchmark's files included. A failure points at plots/__main__.py
or the module that draws the file's records."""

from __future__ import annotations

import os

import pytest

from plots.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(300)
def test_every_committed_kind_is_drawn_or_named(tmp_path, capsys):
    files = {name: os.path.join(ROOT, "results", f"{name}.jsonl")
             for name in ("context", "context_scaled", "multidsn_paper", "alternatives", "bench_core", "faults")}
    main([*files.values(), str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "figs")])
    printed = capsys.readouterr().out
    drawn = sorted(os.listdir(tmp_path / "figs"))
    for stem in ("context", "context_scaled_order", "context_scaled_has3", "context_scaled_curves", "multidsn_paper",
                 "alternatives", "bench_core_memory"):
        assert f"{stem}.png" in drawn and f"{stem}.pdf" in drawn, (stem, drawn)
    assert f"{files['faults']}: skipped: no figure is made for its records (faults x" in printed
    assert "missing.jsonl: no such file; skipped" in printed
    assert "skipped" not in "".join(line for line in printed.splitlines() if "faults" not in line
                                    and "missing" not in line)


def test_context_loss_curves_are_drawn_per_task_dial_and_split(tmp_path):
    from plots import context_curves

    def rec(method, lr, split, dial, seed=100):
        return {"bench": "context", "record": "run", "task": "order", "split": split, "method": method, "lr": lr,
                "dial": dial, "seed": seed, "steps": 60, "image_size": 256, "tile_size": 32,
                "loss_curve": [0.7 - 0.01 * i for i in range(30)], "commit": "x", "torch": "y"}

    recs = [rec(m, lr, "val", d) for m in ("whole", "mil") for lr in (1e-3, 3e-3) for d in (0.25, 3.5)]
    recs += [rec("whole", 1e-3, "test", 0.25, seed) for seed in range(3)]
    recs.append({**rec("mil", 1e-3, "val", 6.5), "loss_curve": None})  # an older record: not drawn
    assert context_curves._panels([r for r in recs if r["loss_curve"]]).keys() == {
        ("order", "val", 0.25, 60), ("order", "val", 3.5, 60), ("order", "test", 0.25, 60)}
    paths = context_curves.draw(recs, str(tmp_path / "curves"))
    assert sorted(os.path.basename(p) for p in paths) == ["curves.pdf", "curves.png"]
    assert context_curves.draw([{**r, "loss_curve": None} for r in recs], str(tmp_path / "none")) == []


def test_downsampled_runs_with_a_matched_stem_are_a_line_of_their_own(tmp_path, monkeypatch):
    from plots import context as plot

    def rec(method, dial, seed, accuracy, **extra):
        return {"bench": "context", "record": "run", "method": method, "dial": dial, "seed": seed,
                "accuracy": accuracy, "processes": 4 if method == "whole" else 1, "image_size": 1024,
                "tile_size": 128, "commit": "x", "torch": "y", **extra}

    recs = [rec("whole", d, k, 0.9) for d in (1.5, 3.5) for k in range(2)]
    recs += [rec("downsampled", d, k, 0.6, shrink=2) for d in (1.5, 3.5) for k in range(2)]  # older: stride 4
    recs += [rec("downsampled", d, k, 0.95, shrink=2, stem=2) for d in (1.5, 3.5) for k in range(2)]
    drawn = {}
    monkeypatch.setattr(plot, "save", lambda fig, stem: drawn.setdefault("fig", fig) and [stem])
    plot.draw(recs, str(tmp_path / "ctx"))
    ax = drawn["fig"].axes[0]
    lines = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines() if "chance" not in line.get_label()
             and not line.get_label().startswith("_")}
    assert lines == {"whole image (bigconv, 4 workers) (2 seeds)": [0.9, 0.9],
                     "downsampled 2x per side (2 seeds)": [0.6, 0.6],
                     "downsampled 2x, stem stride 2 (2 seeds)": [0.95, 0.95]}


def test_the_loss_curves_keep_the_two_shrink_stems_apart_in_the_accuracy_figures_colours(tmp_path, monkeypatch):
    from plots import context, context_curves

    def rec(seed, **extra):
        return {"bench": "context", "record": "run", "task": "order", "split": "test", "method": "downsampled",
                "lr": 3e-3, "dial": 1.5, "seed": seed, "steps": 30, "image_size": 1024, "tile_size": 128,
                "loss_curve": [0.7] * 30, "commit": "x", "torch": "y", **extra}

    drawn = {}
    monkeypatch.setattr(context_curves, "save", lambda fig, stem: drawn.setdefault("fig", fig) and [stem])
    context_curves.draw([rec(0), rec(1, stem=2)], str(tmp_path / "curves"))
    got = {line.get_label(): line.get_color() for line in drawn["fig"].axes[0].get_lines()
           if not line.get_label().startswith("_")}
    assert got == {"downsampled": context.COLORS["downsampled"],
                   "downsampled-matched": context.COLORS["downsampled-matched"]}
