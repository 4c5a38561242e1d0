"""Sweeps: one record per configuration, resumable, going on after an out-of-memory error.

The fake-runner tests pin the bookkeeping (resume, torn lines, oom skipping, retries) in
milliseconds; one tiny real sweep runs fresh processes end to end, with a real allocator OOM under
an enforced budget. A failure here means a sweep could lose, double or misfile a measurement.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bigconv.harness import records
from bigconv.harness.runner import RunConfig, describe
from experiments.sweep import parse_amount, plan, run_sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fake_runner(oom_above: int, calls: list):
    def run(cfg: RunConfig) -> dict:
        calls.append((cfg.size, cfg.workers))
        rec = {**describe(cfg), "run_s": 0.0}
        if cfg.size > oom_above:
            return {**rec, "status": "oom", "message": "CUDA out of memory"}
        return {**rec, "status": "ok", "message": None, "peak_bytes_max": cfg.size * 1000 // max(1, cfg.workers),
                "step_s": 0.1, "util_mean_percent": 50.0}
    return run


def test_parse_amount():
    assert parse_amount("16GiB") == 16 * 2**30 and parse_amount("4M") == 4 * 2**20 and parse_amount("512") == 512
    with pytest.raises(Exception, match="cannot read"):
        parse_amount("lots")


def test_plan_always_includes_plain_first():
    cfgs = plan("cnn2d", [128, 64], [2, 1])
    assert [(c.size, c.workers) for c in cfgs] == [(64, 0), (64, 1), (64, 2), (128, 0), (128, 1), (128, 2)]


def test_resume_oom_and_torn_line(tmp_path):
    out = str(tmp_path / "s.jsonl")
    cfgs = plan("cnn2d", [64, 128, 256], [2], steps=1)
    calls: list = []
    first = run_sweep(cfgs, out, runner=fake_runner(100, calls), echo=lambda s: None)
    # 64 fits; 128 ooms on both; 256 is skipped after the oom, not recorded.
    assert calls == [(64, 0), (64, 2), (128, 0), (128, 2)]
    assert [r["status"] for r in first] == ["ok", "ok", "oom", "oom"]
    assert len(records.load(out)) == 4

    calls.clear()
    assert run_sweep(cfgs, out, runner=fake_runner(100, calls), echo=lambda s: None) == [] and calls == []

    # An interrupted sweep: the last record lost, a torn half line in its place.
    lines = open(out).read().splitlines(keepends=True)
    with open(out, "w") as fh:
        fh.writelines(lines[:2])
        fh.write(lines[2][:30])
    assert len(records.load(out)) == 2
    run_sweep(cfgs, out, runner=fake_runner(100, calls), echo=lambda s: None)
    assert calls == [(128, 0), (128, 2)]
    recs = records.load(out)
    keys = [records.config_key(r["config"]) for r in recs]
    assert len(recs) == 4 and len(set(keys)) == 4  # none lost, none doubled
    assert open(out).read().endswith("\n")


def test_keep_going_and_retry_errors(tmp_path):
    out = str(tmp_path / "s.jsonl")
    cfgs = plan("cnn1d", [64, 128], [1], plain=False)
    calls: list = []
    run_sweep(cfgs, out, runner=fake_runner(0, calls), keep_going=True, echo=lambda s: None)
    assert calls == [(64, 1), (128, 1)]

    def failing(cfg):
        return {**describe(cfg), "status": "error", "message": "boom", "run_s": 0.0}

    out2 = str(tmp_path / "e.jsonl")
    run_sweep(cfgs, out2, runner=failing, echo=lambda s: None)
    calls.clear()
    run_sweep(cfgs, out2, runner=fake_runner(1000, calls), echo=lambda s: None)
    assert calls == []  # errors are recorded configurations too
    run_sweep(cfgs, out2, runner=fake_runner(1000, calls), retry_errors=True, echo=lambda s: None)
    assert calls == [(64, 1), (128, 1)]


@pytest.mark.own_world
@pytest.mark.timeout(240)
def test_tiny_real_sweep_with_budget_oom(exclusive, tmp_path):
    """Fresh processes end to end: 64^2 fits a 128 MiB budget, 1024^2 runs out of it (plain and
    1 worker), and the sweep records both and exits 0; a rerun adds nothing."""
    out = str(tmp_path / "tiny.jsonl")
    cmd = [sys.executable, "-m", "experiments.sweep", "--model", "cnn2d", "--sizes", "64,1024", "--workers", "1",
           "--budget", "128MiB", "--device", "cpu", "--out", out, "--timeout", "150"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=220)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    recs = records.load(out)
    assert [(r["size"], r["workers"], r["status"]) for r in recs] == \
        [(64, 0, "ok"), (64, 1, "ok"), (1024, 0, "oom"), (1024, 1, "oom")], [r.get("message") for r in recs]
    ok = recs[1]
    assert ok["grid"] == [1, 1] and ok["peak_bytes_max"] > 0 and ok["sources"] == ["rss_hwm_reset"]
    assert ok["budget"]["budget_enforced_by"] == "rlimit_data" and ok["util_source"] == "process_cpu"
    assert ok["torch"] and "commit" in ok and ok["env"]["cores"] and ok["images_per_s"] > 0
    assert "can't allocate memory" in recs[3]["message"]
    assert all("_bytes" in k or "bytes" not in k for r in recs for k in r)  # units in names
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    # Not a terminal: no bar, one log line per configuration on stderr instead.
    assert again.returncode == 0 and again.stderr.count("already recorded") == 4 and "%|" not in again.stderr
    assert again.stdout.startswith("done: 0 new records")
    assert len(records.load(out)) == 4
    json.dumps(recs)  # plain JSON all the way down


@pytest.mark.own_world
@pytest.mark.timeout(300)
def test_tiny_real_spmd_sweep(exclusive, tmp_path):
    """``--mode spmd``: each worker count runs as SPMD ranks in fresh processes; 64^2 fits a 128 MiB
    budget per rank, 1024^2 runs out of it and is recorded as oom; the plain baseline is the one the
    driver mode's sweep records (same key), and a rerun adds nothing."""
    out = str(tmp_path / "spmd.jsonl")
    cmd = [sys.executable, "-m", "experiments.sweep", "--model", "cnn2d", "--sizes", "64,1024", "--workers", "2",
           "--mode", "spmd", "--budget", "128MiB", "--device", "cpu", "--out", out, "--timeout", "200"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    recs = records.load(out)
    assert [(r["size"], r["workers"], r["mode"], r["status"]) for r in recs] == [
        (64, 0, "plain", "ok"), (64, 2, "spmd", "ok"), (1024, 0, "plain", "oom"), (1024, 2, "spmd", "oom")], \
        [r.get("message") for r in recs]
    ok = recs[1]
    assert ok["config"]["mode"] == "spmd" and sorted(ok["grid"]) == [1, 2] and len(ok["per_worker"]) == 2
    assert ok["peak_bytes_max"] > 0 and ok["util_source"] == "process_cpu" and ok["halo_messages_total"] > 0
    assert ok["budget"]["budget_enforced_by"] == "rlimit_data" and ok["images_per_s"] > 0
    assert "allocate memory" in recs[3]["message"]
    assert recs[0]["config"]["mode"] is None and recs[0]["config"]["replicas"] is None  # the driver sweep's key
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and again.stderr.count("already recorded") == 4


def test_spmd_configs_are_checked():
    with pytest.raises(ValueError, match="mode must be"):
        RunConfig(model="cnn2d", size=64, workers=2, mode="rpc")
    with pytest.raises(ValueError, match="replicas is for mode 'spmd' and must divide"):
        RunConfig(model="cnn2d", size=64, workers=3, mode="spmd", replicas=2)
    with pytest.raises(ValueError, match="for workers > 0"):
        RunConfig(model="cnn2d", size=64, workers=0, mode="spmd")
    assert [(c.workers, c.mode) for c in plan("cnn2d", [64], [2], mode="spmd")] == [(0, None), (2, "spmd")]


def test_registry_and_dsn_plan():
    """fcn2d/unet are one registry entry each; dsn sweeps targets, with the workers its placement needs."""
    from multidsn.placement import workers_needed

    from bigconv.harness.registry import MODELS

    assert {"cnn1d", "cnn2d", "cnn3d", "fcn2d", "unet", "dsn"} <= set(MODELS)
    assert MODELS["fcn2d"].round_size(100, 3) == 96 and MODELS["fcn2d"].task == "segment"
    cfgs = plan("dsn", [64], [], targets=[1, 4])
    assert [(c.workers, c.targets) for c in cfgs] == [(0, 1), (workers_needed(1, "domain"), 1),
                                                      (workers_needed(4, "domain"), 4)]
    with pytest.raises(ValueError, match="targets"):
        RunConfig(model="cnn2d", targets=2)
    # An optional field left unset keeps the keys of records written before it existed.
    assert records.config_key({"model": "cnn2d", "targets": None}) == records.config_key({"model": "cnn2d"})
