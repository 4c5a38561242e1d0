"""Figures drawn from a fixture results file, and the size search's bookkeeping with a fake runner.

Plots must come from saved records alone, name their source and hardware, and embed their fonts;
the size search must bracket the budget with few probes and reuse probes on a rerun.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bigconv.harness import records
from experiments.maxsize import search
from plots.tables import maxsize_table
from bigconv.harness.runner import RunConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2**20
ENV = {"torch": "2.13.0+cpu", "cpu": "x86_64", "cpu_model": "Test CPU", "cores": 2, "host_memory_bytes": 24 * 2**30,
       "gpu": None, "gpu_count": 0, "gpu_memory_bytes": None, "commit": "abc1234", "commit_dirty": False}


def run_record(size: int, workers: int, status: str = "ok", peak: float | None = None) -> dict:
    cfg = RunConfig(model="cnn2d", size=size, workers=workers)
    rec = {"kind": "run", "config": cfg.__dict__, "model": "cnn2d", "dims": 2, "task": "classify", "size": size,
           "batch": 1, "workers": workers, "mode": "plain" if workers == 0 else "world", "device": "cpu",
           "budget_bytes": None, "torch": ENV["torch"], "commit": "abc1234", "env": ENV, "status": status}
    if status == "ok":
        rec.update(peak_bytes_max=int(peak), util_mean_percent=80.0 / (1 + workers), util_source="process_cpu",
                   step_s=0.1)
    else:
        rec["message"] = "can't allocate memory"
    return rec


@pytest.fixture
def results_file(tmp_path):
    recs = [run_record(s, n, peak=(2 * MiB + 100 * s * s / max(1, n)) * (1.03 if n else 1.0))
            for s in (256, 512, 1024) for n in (0, 1, 2, 4)]
    recs.append(run_record(2048, 0, status="oom"))
    recs += [{"kind": "maxsize", "model": "cnn2d", "dims": 2, "batch": 1, "workers": n, "device": "cpu",
              "budget_bytes": 256 * MiB, "max_size": int(1600 * n ** 0.5 * 0.97), "max_elements": 1, "env": ENV}
             for n in (0, 1, 2, 4)]
    path = tmp_path / "fixture.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


def test_plots_command_draws_every_figure(results_file, tmp_path):
    out = tmp_path / "figs"
    core = os.path.join(ROOT, "results", "bench_core.jsonl")
    run = subprocess.run([sys.executable, "-m", "plots", results_file, core, "--out", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    names = sorted(os.listdir(out))
    assert names == sorted([f"fixture_{k}.{e}" for k in ("memory", "util", "scaling", "maxsize") for e in ("png", "pdf")]
                           + [f"bench_core_memory.{e}" for e in ("png", "pdf")])  # the core benchmark: plots.core
    for name in names:
        assert os.path.getsize(out / name) > 5000
    pdf = (out / "fixture_memory.pdf").read_bytes()
    assert b"/FontFile2" in pdf and b"/Subtype /Type3" not in pdf  # TrueType embedded (fonttype 42)


def test_footer_names_source_and_hardware(results_file, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from plots import study

    seen = []
    real = study._footer

    def spy(fig, sources, rec):
        real(fig, sources, rec)
        seen.append(fig.texts[-1].get_text())

    study._footer = spy
    try:
        study.draw_file(results_file, records.load(results_file), str(tmp_path))
    finally:
        study._footer = real
    assert len(seen) == 4 and all("fixture.jsonl" in t and "Test CPU, 2 cores" in t and "abc1234" in t for t in seen)


def test_a_file_with_both_modes_gets_figures_per_mode(results_file, tmp_path):
    """SPMD runs of the same worker counts are drawn apart from the driver's, each against the one
    plain baseline, with their own labels."""
    import matplotlib

    matplotlib.use("Agg")
    from plots import study

    recs = records.load(results_file)
    spmd = []
    for s in (256, 512, 1024):
        for n in (2, 4):
            r = run_record(s, n, peak=(2 * MiB + 100 * s * s / n) * 1.01)
            r["config"] = {**r["config"], "mode": "spmd"}
            r["mode"] = "spmd"
            spmd.append(r)
    labels = []
    real = study._who
    study._who = lambda n, mode="driver": labels.append((n, mode)) or real(n, mode)
    try:
        paths = study.draw_file(results_file, recs + spmd, str(tmp_path))
    finally:
        study._who = real
    names = sorted(os.path.basename(p) for p in paths if p.endswith(".png"))
    assert names == sorted(["fixture_memory.png", "fixture_util.png", "fixture_scaling.png", "fixture_maxsize.png",
                            "fixture_spmd_memory.png", "fixture_spmd_util.png", "fixture_spmd_scaling.png"])
    assert (2, "spmd") in labels and (2, "driver") in labels and (1, "spmd") not in labels
    spmd_only = [r for r in recs + spmd if r["kind"] == "run" and (r["workers"] == 0 or study.run_mode(r) == "spmd")]
    assert set(study.memory_ratios(spmd_only, 1024)) == {2, 4}


def test_memory_ratio_at_largest_common_size(results_file):
    from plots.study import memory_ratios, scaling_size

    recs = [r for r in records.load(results_file) if r["kind"] == "run"]
    assert scaling_size(recs) == 1024  # 2048 only has the plain run, which ran out of memory
    ratios = memory_ratios(recs, 1024)
    assert set(ratios) == {1, 2, 4} and all(0.9 < v < 1.0 for v in ratios.values())


def test_a_rerun_search_counts_once():
    """A rerun of a search appends its answer again; tables and figures use the last one per case."""
    from plots.study import latest_maxsize

    def found(n, size, budget=128 * MiB):
        return {"kind": "maxsize", "model": "cnn2d", "workers": n, "budget_bytes": budget, "device": "cpu",
                "batch": 1, "max_size": size}

    recs = [found(1, 500), found(2, 700), found(1, 563), found(1, 400, budget=64 * MiB), run_record(256, 1, peak=1)]
    assert sorted((r["workers"], r["budget_bytes"] // MiB, r["max_size"]) for r in latest_maxsize(recs)) == \
        [(1, 64, 400), (1, 128, 563), (2, 128, 700)]


def fake_run(cfg: RunConfig) -> dict:
    """Peak = 1 MiB + 100 B per pixel per worker: the largest fitting edge is known exactly."""
    peak = MiB + 100 * cfg.size ** 2 // max(1, cfg.workers)
    return {"kind": "run", "config": cfg.__dict__, "model": cfg.model, "size": cfg.size, "workers": cfg.workers,
            "batch": 1, "device": "cpu", "env": ENV, "torch": "t", "commit": "c", "status": "ok",
            "peak_bytes_max": peak, "step_s": 0.1, "run_s": 0.0, "message": None}


def test_size_search_brackets_the_budget_and_resumes(tmp_path):
    out = str(tmp_path / "ms.jsonl")
    budget = 256 * MiB
    calls = []

    def runner(cfg):
        calls.append(cfg.size)
        return fake_run(cfg)

    results = []
    for n in (1, 4):
        r = search(RunConfig(model="cnn2d", workers=n), budget, 64, out=out, tolerance=0.02, runner=runner,
                   echo=lambda s: None)
        exact = int(((budget - MiB) * n / 100) ** 0.5)
        assert r["max_size"] <= exact < r["first_failing_size"]
        assert exact - r["max_size"] <= 0.02 * exact + 1
        results.append(r)
    assert len(calls) <= 12
    calls.clear()
    again = search(RunConfig(model="cnn2d", workers=1), budget, 64, out=out, runner=runner, echo=lambda s: None)
    assert calls == [] and again["max_size"] == results[0]["max_size"]  # probes reused from the file
    table = maxsize_table(results)
    assert table[-1].endswith("| yes |")  # 4 workers: 4x the area of one


def test_size_search_when_nothing_fits(tmp_path):
    def oom(cfg):
        return {**fake_run(cfg), "status": "oom", "peak_bytes_max": None}

    r = search(RunConfig(model="cnn2d", workers=2, size=64), MiB, 64, out=str(tmp_path / "m.jsonl"), runner=oom,
               echo=lambda s: None, max_probes=4)
    assert r["max_size"] is None and len(r["probes"]) == 4


def test_largest_slide_search_brackets_the_budget(tmp_path, monkeypatch):
    """``bench_slides --maxsize``'s search with a fake probe whose peak grows with the pixels: it
    finds the largest 256-multiple within the budget, records every probe, and keeps its answer
    out of the size-search plots (``kind: slide_maxsize``)."""
    from experiments import bench_slides

    budget = 1024 * MiB
    peak = lambda edge: 40 * MiB + 5 * edge * edge  # noqa: E731  (the true edge at the budget: 14,365)
    monkeypatch.setattr(bench_slides, "synthetic_slide", lambda path, size, **kw: open(path, "w").close())
    monkeypatch.setattr(bench_slides, "open_image", lambda path, **kw: int(path.split("_")[-1].split(".")[0]))
    monkeypatch.setattr(bench_slides, "probe_peak", lambda kind, edge, workers: {
        "peak_bytes_max": peak(edge), "peak_process": "worker", "driver_peak_bytes": 0,
        "worker_peak_bytes": [peak(edge)], "step_s": 1.0})
    out = str(tmp_path / "slides.jsonl")
    r = bench_slides.largest_slide("sources", budget, 4, str(tmp_path), out)
    assert r["max_size"] == 14336 and r["first_failing_size"] - r["max_size"] <= 0.03 * r["max_size"]
    assert peak(r["max_size"]) <= budget < peak(r["first_failing_size"])
    assert len(r["probes"]) <= 8 and r["kind"] == "slide_maxsize"
    assert [p["size"] for p in r["probes"]] == [rec["size"] for rec in records.load(out)]
