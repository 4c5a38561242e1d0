"""The recorder with its sources faked or missing (no GPU here), and with the real CPU sources.

Every published figure says which sources it came from; a failure here means a record could claim
a source it did not use, or a missing NVML/GPU would crash a run instead of being noted.
"""

from __future__ import annotations

import mmap
import time
from types import SimpleNamespace

import pytest
import torch

from bigconv.harness.recorder import Recorder, limit_memory

GiB = 2**30


class FakeCuda:
    """torch.cuda's allocator statistics, scripted."""

    def __init__(self) -> None:
        self.allocated, self.peak, self.reserved, self.resets = 100, 100, 512, 0

    def synchronize(self, device) -> None:
        pass

    def reset_peak_memory_stats(self, device) -> None:
        self.resets += 1
        self.peak = self.allocated

    def memory_allocated(self, device) -> int:
        return self.allocated

    def max_memory_allocated(self, device) -> int:
        return self.peak

    def max_memory_reserved(self, device) -> int:
        return self.reserved

    def get_device_properties(self, device):
        return SimpleNamespace(total_memory=16 * GiB)


class FakeNvml:
    """pynvml with one GPU; ``procs`` are the compute processes it reports."""

    def __init__(self, procs, util=(40.0, 60.0)) -> None:
        self.procs, self.util, self.calls = procs, list(util), 0

    def nvmlDeviceGetHandleByIndex(self, index):
        return f"gpu{index}"

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(total=16 * GiB)

    def nvmlDeviceGetName(self, handle):
        return b"Tesla V100-SXM2-16GB"

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return self.procs

    def nvmlDeviceGetUtilizationRates(self, handle):
        self.calls += 1
        return SimpleNamespace(gpu=self.util[(self.calls - 1) % len(self.util)])


def fake_rss():
    return 123, "rss_fake"


def test_cpu_process_records_rss_and_cpu_share():
    """On CPU: RSS is the only memory source, utilization is the process's CPU share."""
    rec = Recorder("cpu", interval_s=0.01).start()  # share of torch's intra-op threads
    # Fresh pages from the kernel: a torch or malloc block may reuse heap already resident from
    # earlier tests in the session (glibc's mmap threshold grows), and then RSS does not rise.
    block = mmap.mmap(-1, 32 * 2**20)
    for offset in range(0, len(block), mmap.PAGESIZE):
        block[offset] = 1
    small = torch.ones(2**16)
    end = time.process_time() + 0.05
    while time.process_time() < end:  # busy: the CPU share must be high
        small.add_(1)
    block.close()
    r = rec.stop()
    assert r["sources"] == ["rss_hwm_reset"] and r["peak_source"] == "peak_rss_bytes"
    assert r["peak_bytes"] >= 24 * 2**20
    assert set(r["missing"]) == {"cuda_allocator", "nvml"}
    assert r["util_source"] == "process_cpu" and r["util_samples"] >= 1
    assert 10 < r["util_mean_percent"] <= 130, r  # low bound: 2 shared cores


def test_gpu_with_fake_cuda_and_nvml():
    cuda = FakeCuda()
    nvml = FakeNvml([SimpleNamespace(pid=42, usedGpuMemory=3 * GiB)])
    rec = Recorder("cuda:0", nvml=nvml, cuda=cuda, pid=42, interval_s=0.01, rss=fake_rss).start()
    cuda.peak, cuda.reserved = 100 + 2 * GiB, 3 * GiB
    time.sleep(0.05)
    r = rec.stop()
    assert cuda.resets == 1
    assert r["sources"] == ["cuda_allocator", "nvml", "rss_fake"] and r["missing"] == {}
    assert r["peak_bytes"] == r["cuda_max_allocated_bytes"] == 2 * GiB  # above the start
    assert r["cuda_max_reserved_bytes"] == 3 * GiB and r["nvml_peak_used_bytes"] == 3 * GiB
    assert r["gpu_name"] == "Tesla V100-SXM2-16GB" and r["nvml_total_bytes"] == 16 * GiB
    assert r["util_source"] == "nvml_gpu" and 40 <= r["util_mean_percent"] <= 60
    assert r["util_shared_device"] is False and "util_note" not in r


def test_shared_gpu_is_flagged():
    """Two processes on one GPU: NVML utilization is device-wide, and the record says so."""
    nvml = FakeNvml([SimpleNamespace(pid=42, usedGpuMemory=GiB), SimpleNamespace(pid=43, usedGpuMemory=GiB)])
    r = Recorder("cuda:0", nvml=nvml, cuda=FakeCuda(), pid=42, rss=fake_rss).start().stop()
    assert r["util_shared_device"] is True and "cannot be attributed" in r["util_note"]


def test_nvml_hiding_per_process_memory():
    """Drivers in containers report usedGpuMemory None: NVML memory is missing, utilization kept."""
    nvml = FakeNvml([SimpleNamespace(pid=42, usedGpuMemory=None)])
    r = Recorder("cuda:0", nvml=nvml, cuda=FakeCuda(), pid=42, rss=fake_rss).start().stop()
    assert "nvml" not in r["sources"] and "does not report" in r["missing"]["nvml"]
    assert r["util_source"] == "nvml_gpu"


def test_gpu_without_nvml_falls_back_to_cpu_share():
    r = Recorder("cuda:0", nvml=None, cuda=FakeCuda(), rss=fake_rss).start().stop()
    assert r["sources"] == ["cuda_allocator", "rss_fake"] and r["missing"] == {"nvml": "disabled"}
    assert r["util_source"] == "process_cpu" and "no NVML" in r["util_note"]


def test_broken_nvml_is_noted_not_raised():
    class Broken(FakeNvml):
        def nvmlDeviceGetHandleByIndex(self, index):
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")

    r = Recorder("cuda:0", nvml=Broken([]), cuda=FakeCuda(), rss=fake_rss).start().stop()
    assert "GPU_IS_LOST" in r["missing"]["nvml"] and r["util_source"] == "process_cpu"


def test_real_nvml_without_driver_is_missing():
    """This machine has nvidia-ml-py but no driver: the reason is recorded."""
    rec = Recorder("cuda:0", cuda=FakeCuda(), rss=fake_rss)
    assert rec.nvml is None and rec.missing["nvml"]


def test_disabled_recorder_is_free():
    rec = Recorder("cpu", enabled=False)
    assert rec.start() is rec and rec.stop() == {} and rec._thread is None


def test_sampler_overhead_is_small():
    """On costs little: a 0.2 s interval sampler takes well under 1% of a core."""
    rec = Recorder("cpu", interval_s=0.2, threads=1).start()
    t0, c0 = time.monotonic(), time.process_time()
    time.sleep(1.0)
    used = time.process_time() - c0
    rec.stop()
    assert used / (time.monotonic() - t0) < 0.02


def test_limit_memory_cpu_turns_excess_into_allocator_oom():
    """The CPU budget cap (RLIMIT_DATA) makes a larger allocation fail cleanly, in a child process."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    q = ctx.Queue()

    def child():
        how = limit_memory(64 * 2**20, "cpu")
        try:
            torch.ones(256 * 2**20 // 4)
            q.put((how, "allocated"))
        except RuntimeError as exc:
            q.put((how, str(exc)))

    p = ctx.Process(target=child)
    p.start()
    how, outcome = q.get(timeout=30)
    p.join(10)
    assert how["budget_enforced_by"] == "rlimit_data"
    assert "can't allocate memory" in outcome


@pytest.mark.parametrize("text,status", [
    ("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB", "oom"),
    ("torch.OutOfMemoryError: ...", "oom"),
    ("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes", "oom"),
    ("ValueError: grid (3, 3) does not fit", "error"),
])
def test_classify(text, status):
    from bigconv.harness.runner import classify

    assert classify(text) == status
