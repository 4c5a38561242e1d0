"""The Figure 7 driver's bookkeeping and figures, with fake runs (no processes are started).

It must plan the single-process 1S1T run and every (placement, K) case at each size, keep the domain
placement's records compatible with ``sweep --preset fig7_dsn``, search each case's largest image, judge
the 2x-area and 10%-spread targets from the records, and draw its figures from saved records only.
"""

from __future__ import annotations

import os

import pytest

from bigconv.harness import records
from experiments import fig7
from bigconv.harness.runner import RunConfig
from experiments.sweep import plan
from plots import dsn as dsn_plots

MiB = 2**20
ENV = {"torch": "2.13.0+cpu", "cpu": "x86_64", "cpu_model": "Test CPU", "cores": 2, "host_memory_bytes": 24 * 2**30,
       "gpu": None, "gpu_count": 0, "gpu_memory_bytes": None, "commit": "abc1234", "commit_dirty": False}


def fake_peak(cfg: RunConfig) -> int:
    """Bytes per pixel: 1S1T single 200, domain placement 120, encoder placement 90 (+3% at K=7)."""
    per = 200 if cfg.workers == 0 else (120 if (cfg.placement or "domain") == "domain" else 90)
    return int(per * cfg.size**2 * (1.03 if cfg.targets == 7 else 1.0))


def fake_runner(cfg: RunConfig) -> dict:
    return {"kind": "run", "config": cfg.__dict__, "model": "dsn", "dims": 2, "task": "dsn", "size": cfg.size,
            "batch": cfg.batch, "workers": cfg.workers, "device": "cpu", "budget_bytes": None, "env": ENV,
            "torch": ENV["torch"], "commit": "abc1234", "status": "ok", "peak_bytes_max": fake_peak(cfg),
            "util_mean_percent": 50.0, "step_s": 0.1}


def test_sweep_plans_every_case_and_keeps_domain_keys():
    configs = fig7.sweep_configs([128, 256], [1, 4, 7], ["domain", "encoder"], batch=2, width=8)
    assert len(configs) == 2 * 7
    at128 = [(c.workers, c.targets, c.placement) for c in configs if c.size == 128]
    assert at128 == [(0, 1, None), (3, 1, None), (6, 4, None), (9, 7, None), (5, 1, "encoder"), (11, 4, "encoder"),
                     (17, 7, "encoder")]
    # Same identities as the generic sweep's DSN runs, so neither driver reruns the other's records.
    generic = {records.config_key(c.__dict__) for c in plan("dsn", [128, 256], [], targets=[1, 4, 7], batch=2,
                                                            width=8)}
    mine = {records.config_key(c.__dict__) for c in configs if c.placement is None}
    assert mine == generic


def test_placement_is_validated_before_any_run():
    with pytest.raises(ValueError, match="placement is for --model dsn"):
        RunConfig(model="dsn", size=128, workers=5, targets=1, placement="ring")
    with pytest.raises(ValueError, match="placement is for --model dsn"):
        RunConfig(model="cnn2d", size=128, workers=2, placement="encoder")
    with pytest.raises(SystemExit):
        fig7.main(["--quick", "--placements", "domain,ring", "--no-maxsize"])


def test_tables_judge_both_targets(tmp_path):
    out = str(tmp_path / "fig7.jsonl")
    for cfg in fig7.sweep_configs([256, 512], [1, 4, 7], ["domain", "encoder"], batch=2, width=8):
        records.append(out, fake_runner(cfg))
    rows = fig7.spread_table(records.load(out))
    domain512 = next(r for r in rows if r.startswith("| 512² | domain"))
    assert domain512.endswith("| 3.0% |")  # K=7 is 3% above K=1
    budget = 64 * MiB
    base = RunConfig(model="dsn", size=128, workers=0, targets=1, batch=2, width=8)
    results = [fig7.search(c, budget, 256, out=str(tmp_path / "max.jsonl"), runner=fake_runner, echo=lambda s: None)
               for c in [base] + fig7.distributed(base, [1, 7], ["domain", "encoder"])]
    table = fig7.maxsize_table(results)
    by_case = {row.split(" | ")[0].lstrip("| "): row for row in table[2:]}
    # Area ratios follow the bytes per pixel: 200/120 = 1.67 (misses 2x), 200/90 = 2.22 (meets it).
    assert by_case["1S1T domain placement, 3 workers"].endswith("| no |")
    assert by_case["1S1T encoder placement, 5 workers"].endswith("| yes |")
    ratio = float(by_case["1S1T encoder placement, 5 workers"].split(" | ")[2])
    assert 2.0 <= ratio <= 2.25


def test_figures_come_from_records(tmp_path):
    out = str(tmp_path / "fig7.jsonl")
    for cfg in fig7.sweep_configs([256, 512], [1, 7], ["domain", "encoder"], batch=2, width=8):
        records.append(out, fake_runner(cfg))
    base = RunConfig(model="dsn", size=128, workers=0, targets=1, batch=2, width=8)
    for c in [base] + fig7.distributed(base, [1], ["encoder"]):
        fig7.search(c, 64 * MiB, 256, out=out, runner=fake_runner, echo=lambda s: None)
    paths = dsn_plots.draw_file(out, records.load(out), str(tmp_path / "figs"))
    names = sorted(os.path.basename(p) for p in paths)
    assert names == sorted(f"fig7_{k}.{e}" for k in ("cases_memory", "cases") for e in ("png", "pdf"))
    assert all(os.path.getsize(p) > 1000 for p in paths)


def test_plots_command_draws_dsn_records_as_cases(tmp_path, capsys):
    from plots.__main__ import main as plots_main

    out = str(tmp_path / "fig7.jsonl")
    for cfg in fig7.sweep_configs([256, 512], [1], ["domain", "encoder"], batch=2, width=8):
        records.append(out, fake_runner(cfg))
    plots_main([out, "--out", str(tmp_path / "figs")])
    # Not the per-worker-count figures: 3 and 5 workers are placements here, not a scaling series.
    assert sorted(os.listdir(tmp_path / "figs")) == ["fig7_cases_memory.pdf", "fig7_cases_memory.png"]
