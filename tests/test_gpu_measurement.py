"""Honest GPU measurement, without a GPU: NVML finds the rank's own GPU under CUDA_VISIBLE_DEVICES, the
SPMD benchmark hands each rank a host batch, and ``experiments.gpu_check --dry`` plans what it would run."""

from __future__ import annotations

import os
import sys
import uuid
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_recorder import FakeCuda, fake_rss  # noqa: E402

from bigconv.harness.recorder import Recorder  # noqa: E402

GiB = 2**30
UUIDS = [uuid.UUID(int=1000 + i) for i in range(4)]


class FourGpuNvml:
    """pynvml on a node of four GPUs, NVML numbering them 0-3; this process (pid 42) runs on GPU 2."""

    def __init__(self) -> None:
        self.gpus = [SimpleNamespace(index=i, uuid=f"GPU-{UUIDS[i]}", bus=f"00000000:{0x3B + i:02X}:00.0",
                                     name=f"GPU number {i}") for i in range(4)]

    def nvmlDeviceGetHandleByIndex(self, index):
        return self.gpus[index]

    def nvmlDeviceGetHandleByUUID(self, text):
        return next(g for g in self.gpus if g.uuid == text)

    def nvmlDeviceGetHandleByPciBusId(self, text):
        return next(g for g in self.gpus if g.bus == text)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(total=16 * GiB)

    def nvmlDeviceGetName(self, handle):
        return handle.name

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return [SimpleNamespace(pid=42, usedGpuMemory=GiB)] if handle.index == 2 else []

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=50.0)


class VisibleCuda(FakeCuda):
    """torch.cuda of a rank bound to GPUs 2 and 3 (``CUDA_VISIBLE_DEVICES=2,3``): its cuda:0 is GPU 2."""

    def __init__(self, by: str) -> None:
        super().__init__()
        self.by = by

    def get_device_properties(self, device):
        props = SimpleNamespace(total_memory=16 * GiB)
        if self.by == "uuid":
            props.uuid = UUIDS[2]
        elif self.by == "pci":
            props.pci_domain_id, props.pci_bus_id, props.pci_device_id = 0, 0x3B + 2, 0
        return props


@pytest.mark.parametrize("by,found_by", [("uuid", "uuid"), ("pci", "pci_bus_id")])
def test_nvml_finds_the_visible_gpu_not_the_ordinal(monkeypatch, by, found_by):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    r = Recorder("cuda:0", nvml=FourGpuNvml(), cuda=VisibleCuda(by), pid=42, rss=fake_rss).start().stop()
    assert r["gpu_name"] == "GPU number 2" and r["nvml_found_by"] == found_by  # NVML's index 0 is another GPU
    assert r["nvml_peak_used_bytes"] == GiB


def test_nvml_without_uuid_or_bus_id_under_binding_is_missing_not_wrong(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    r = Recorder("cuda:0", nvml=FourGpuNvml(), cuda=VisibleCuda("none"), pid=42, rss=fake_rss).start().stop()
    assert "gpu_name" not in r and "cannot tell which GPU cuda:0 is" in r["missing"]["nvml"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    r = Recorder("cuda:0", nvml=FourGpuNvml(), cuda=VisibleCuda("none"), pid=42, rss=fake_rss).start().stop()
    assert r["gpu_name"] == "GPU number 0" and r["nvml_found_by"] == "index"  # no binding: ordinal = index


# -- experiments.gpu_check on 1, 2, 4 or 8 GPUs ------------------------------------------------------------
@pytest.mark.timeout(120)
def test_gpu_check_dry_plans_every_gpu_count():
    """``--dry`` runs on this CPU host as a user would run it, and its plan is sound for each node size."""
    import json
    import subprocess

    from experiments import gpu_check

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-m", "experiments.gpu_check", "--dry"], cwd=root, capture_output=True,
                          text=True, timeout=100, env={**os.environ, "PYTHONPATH": root})
    assert done.returncode == 0, done.stdout + done.stderr
    plans = [json.loads(line) for line in done.stdout.splitlines()]
    names = {c.name: c.gpus for c in gpu_check.plan()}
    assert [p["gpus"] for p in plans] == [1, 2, 4, 8]
    for p in plans:
        assert set(p["run"]) | set(p["skipped"]) == set(names) and not set(p["run"]) & set(p["skipped"])
        assert all(names[n] <= p["gpus"] for n in p["run"]) and all(names[n] > p["gpus"] for n in p["skipped"])
        assert any(n.startswith("spmd/") for n in p["run"]), p  # every node size checks equivalence
    assert not plans[-1]["skipped"]  # 8 GPUs run everything


def test_gpu_check_plan_check_catches_a_wrong_layout():
    from experiments import gpu_check

    assert gpu_check.check_plan(gpu_check.plan()) == []
    bad = gpu_check.Case("spmd/4/cnn2d/2x1/R1", 4, "spmd", {"ranks": 4, "model": "cnn2d", "grid": (2, 1),
                                                          "replicas": 1})
    assert gpu_check.check_plan([bad, bad]) == [
        "duplicate case spmd/4/cnn2d/2x1/R1", *["spmd/4/cnn2d/2x1/R1: grid (2, 1) × replicas 1 is not 4 ranks"] * 2]


def test_gpu_check_names_a_missing_package_before_running(monkeypatch):
    """The first GPU run found this: without MONAI every unet probe failed alike, and the largest-edge search
    read each failure as out-of-memory, bisecting down to 8 px and reporting edge 0 with exit status 0."""
    import builtins

    from experiments import gpu_check

    real_import = builtins.__import__

    def no_monai(name, *args, **kwargs):
        if name.split(".")[0] == "monai":
            raise ImportError("No module named 'monai'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_monai)
    cases = gpu_check.select(gpu_check.plan(), ["bench/*/largest/1"])
    assert [c.name for c in cases] == ["bench/cnn2d/largest/1", "bench/unet/largest/1"]
    (problem,) = gpu_check.check_plan(cases)
    assert problem.startswith("bench/unet/largest/1: its model needs a package") and "monai" in problem


def test_gpu_check_search_stops_at_an_error_that_is_not_memory(monkeypatch, tmp_path):
    from experiments import gpu_check

    probes = []

    def probe(model, size, ranks, fraction, **kwargs):
        probes.append(size)
        if size > 4096:
            return {"error": "rank 0 failed: OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB"}
        return {"step_s": 1.0} if size <= 2048 else {"error": "rank 0 failed: TimeoutError: no answer in 300 s"}

    monkeypatch.setattr(gpu_check, "_probe", probe)
    out = str(tmp_path / "bench.jsonl")
    edge, rec, error = gpu_check.largest("cnn2d", 1, 0.2, 1024, 8, out, {}, max_probes=9)
    assert (edge, rec, probes) == (2048, {"step_s": 1.0}, [1024, 2048, 4096]) and "TimeoutError" in error
    assert gpu_check.is_out_of_memory("CUDA out of memory.") and not gpu_check.is_out_of_memory(error)


def test_device_session_scripts_report_their_committed_records(capsys):
    """The tables of benchmarks/gpu_h200_planner.md come from the committed records by these commands; the
    device call's script parses (bash -n), so a broken edit shows here, not on the next lent GPU."""
    import subprocess
    from pathlib import Path

    from experiments import gpu_loop, gpu_planner

    root = Path(__file__).resolve().parents[1]
    gpu_planner.main(["--report", "--out", str(root / "results/gpu_planner.jsonl")])
    gpu_loop.main(["--report", "--out", str(root / "results/gpu_loop.jsonl")])
    out = capsys.readouterr().out
    page = (root / "benchmarks/gpu_h200_planner.md").read_text()
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 2 + 14 + 4
    assert all(row in page for row in rows), [row for row in rows if row not in page]
    assert subprocess.run(["bash", "-n", str(root / "experiments/gpu_session.sh")]).returncode == 0
