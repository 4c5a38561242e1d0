"""The memory meter and the README's demo command.

The meter's figures back every memory claim we publish; the demo is the first thing a newcomer runs.
"""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys

import psutil
import pytest
import torch
import torch.nn as nn

import bigconv
from bigconv.engine.executor import own_padding
from bigconv.geometry.boxes import Window, halo_plan, shard_box
from bigconv.memory import PeakMeter

TOL32 = 1e-4  # float32, as in test_equivalence: the two runs differ by summation order only

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_peak_meter_sees_a_freed_allocation():
    meter = PeakMeter("cpu")
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    del block
    record = meter.read()
    assert record["peak_rss_bytes"] >= 48 * 2**20, record
    meter.reset()
    assert meter.read()["peak_rss_bytes"] < 48 * 2**20 or record["sources"] == ["ru_maxrss"]


@pytest.mark.world(2)
@pytest.mark.timeout(180)
def test_a_model_gone_on_the_driver_frees_its_replicas(world):
    """A long-lived world (a notebook, a search over models, this test session) must not keep every
    model it ever ran: each replica here holds 72 MiB of float64 weights and as much momentum."""
    def rss_mib() -> list[float]:
        return [psutil.Process(p.pid).memory_info().rss / 2**20 for p in world._procs]

    def train_one() -> int:
        model = nn.Sequential(nn.Conv2d(1024, 1024, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                              nn.Linear(1024, 2)).double()
        net = bigconv.parallelize(model, world, grid=(2, 1))
        net.optimizer(torch.optim.SGD, lr=0.01, momentum=0.9)
        net.train_step(torch.randn(1, 1024, 8, 8, dtype=torch.float64), torch.tensor([1]), nn.CrossEntropyLoss())
        return net.id

    ids, rss = [], []
    for _ in range(6):
        ids.append(train_one())  # the net is gone when train_one returns
        gc.collect()
        rss.append(rss_mib())
    installed = world.installed_parts()
    for models in installed:
        assert ids[-1] in models and not set(ids[:-1]) & set(models), (ids, installed)
    grown = [after - before for before, after in zip(rss[1], rss[-1])]
    assert max(grown) < 150, (grown, rss)  # four more models kept would be ~580 MiB


def test_own_padding_falls_back_when_a_shard_skips_rows():
    """Kernel 1, stride 3 over two shards of 5: shard 1's outputs read rows 6 and 9, not its first
    row 5, so convolution by linearity cannot start at its own data and the slab path takes over."""
    def paddings(w):
        return [own_padding([w], shard_box((10,), (2,), (c,)), halo_plan((10,), (2,), (c,), [w]).out_box)
                for c in range(2)]

    assert paddings(Window(1, 3))[1] is None
    assert paddings(Window(3, 1, 1, 1, 1)) == [[(1, 0)], [(1, 0)]]  # 'same' 3x3: pad 1, no crop


@pytest.mark.own_world
@pytest.mark.timeout(240)
def test_demo_runs(exclusive, tmp_path):
    out = subprocess.run([sys.executable, "-m", "experiments.demo", "--size", "64", "--steps", "1",
                          "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"wrote {tmp_path / 'demo.json'}" in out.stdout and (tmp_path / "demo.json").stat().st_size > 0
    assert "worker3: peak" in out.stdout and "single process: peak" in out.stdout
    # The record counts the steps the demo says it runs: the warm-up one and --steps more (issue 53 item 14).
    said = int(re.search(r"(\d+) SGD steps", out.stdout)[1])
    assert said == 2 and json.loads((tmp_path / "demo.json").read_text())["steps"] == said, out.stdout
    # The two runs train the same model on the same image: their final losses agree to float32 rounding.
    found = re.search(r"final loss: distributed (\S+), single process (\S+) ", out.stdout)
    assert found, out.stdout
    distributed, single = float(found[1]), float(found[2])
    assert abs(distributed - single) <= TOL32 * abs(single), out.stdout
    # Each worker's fixed cost, printed as its peak less the ideal quarter (the README quotes no figure of it).
    peaks = [float(v) for v in re.findall(r"worker\d: peak +([\d.]+) MiB", out.stdout)]
    quarter = float(re.search(r"single / 4\): ([\d.]+) MiB", out.stdout)[1])
    lo, hi = map(float, re.search(r"each worker above the ideal: (\S+) to (\S+) MiB", out.stdout).groups())
    assert len(peaks) == 4 and abs(lo - (min(peaks) - quarter)) <= 0.15 and abs(hi - (max(peaks) - quarter)) <= 0.15


def test_core_memory_plot_from_saved_results(tmp_path):
    """Figures come from saved records only: PNG and PDF, naming their source."""
    from plots.core import draw

    env = {"cores": 2, "cpu": "x86_64", "gpu": None, "torch": torch.__version__}
    workload = {"model": "cnn2d", "size": 64, "batch": 1, "dtype": "float32"}
    records = [{"kind": "memory", "workers": 0, "peak_bytes": 400 * 2**20}] + [
        {"kind": "memory", "workers": n, "peak_bytes_max": 410 * 2**20 / n, "workload": workload, "env": env}
        for n in (1, 2, 4)]
    paths = draw(records, "fixture.jsonl", str(tmp_path))
    assert [os.path.basename(p) for p in paths] == ["core_memory.png", "core_memory.pdf"]
    assert all(os.path.getsize(p) > 1000 for p in paths)
    with pytest.raises(ValueError, match="no distributed memory records"):
        draw(records[:1], "empty.jsonl", str(tmp_path))
