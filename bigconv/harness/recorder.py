"""A recorder that runs inside every process of a run (worker or plain baseline): memory peaks,
utilization, halo traffic, and the sources each figure came from.

Memory, from every source that exists here:

- ``cuda_allocator``: ``torch.cuda.max_memory_allocated`` (tensors, above the start) and
  ``max_memory_reserved`` (the caching allocator's pool), reset when the recorder starts.
- ``nvml``: this process's used device memory from ``nvmlDeviceGetComputeRunningProcesses``, what
  nvidia-smi showed in the ORNL study (it includes the CUDA context); its peak is the largest sample.
- ``rss``: the resident-set high-water mark above the resident set at start (``bigconv.memory``);
  the only source on CPU.

Utilization, sampled by a background thread every ``interval_s``:

- ``nvml_gpu``: NVML's device utilization (busy time over the driver's 1/6-1 s window). It is
  device-wide: when several processes share the GPU it cannot be attributed to one of them, and
  the record says so (``util_shared_device``).
- ``process_cpu``: this process's CPU seconds over wall seconds, divided by its intra-op threads.

Where a source is missing (no GPU, no nvidia-ml-py, no NVML driver, a driver that hides per-process
memory) the record lists it under ``missing`` with the reason; nothing fails. A recorder made with
``enabled=False`` starts no thread and records nothing.

Worker side: ``WorkerRecording`` is a part of each worker's host (``start_recording``/``stop_recording``
from the driver); ``worker_limit_memory`` runs there through ``World.on_hosts``.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from typing import Any, Callable

import torch

from bigconv import memory

_UNSET: Any = object()


def _load_nvml():
    """The pynvml module, initialised, or (None, reason)."""
    try:
        import pynvml
    except ImportError:
        return None, "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return None, f"NVML did not initialise: {exc}"
    return pynvml, None


def nvml_handle(nvml, cuda, device: torch.device) -> tuple[Any, str]:
    """NVML's handle for the GPU that is ``device`` to CUDA, and how it was found.

    A CUDA ordinal counts only the GPUs this process sees (``CUDA_VISIBLE_DEVICES``, which SLURM and
    jsrun set per rank), while NVML numbers every GPU of the node: ordinal 0 of a rank bound to GPU 3 is
    NVML's GPU 3. The GPU's UUID, else its PCI bus id, names it alike on both sides; the ordinal is used
    only when no GPU is hidden.
    """
    index = device.index or 0
    props = cuda.get_device_properties(device) if cuda is not None else None
    uuid = getattr(props, "uuid", None)
    if uuid is not None and hasattr(nvml, "nvmlDeviceGetHandleByUUID"):
        text = str(uuid)
        return nvml.nvmlDeviceGetHandleByUUID(text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"), "uuid"
    bus = getattr(props, "pci_bus_id", None)
    if bus is not None and hasattr(nvml, "nvmlDeviceGetHandleByPciBusId"):
        bus_id = f"{getattr(props, 'pci_domain_id', 0):08X}:{bus:02X}:{getattr(props, 'pci_device_id', 0):02X}.0"
        return nvml.nvmlDeviceGetHandleByPciBusId(bus_id), "pci_bus_id"
    if os.environ.get("CUDA_VISIBLE_DEVICES") not in (None, ""):
        raise RuntimeError(f"cannot tell which GPU cuda:{index} is under CUDA_VISIBLE_DEVICES="
                           f"{os.environ['CUDA_VISIBLE_DEVICES']} (torch reports neither its UUID nor its PCI bus id)")
    return nvml.nvmlDeviceGetHandleByIndex(index), "index"


class NvmlSource:
    """Per-process used memory and device utilization of one GPU through NVML (``handle``: see
    ``nvml_handle``)."""

    def __init__(self, nvml, handle, pid: int, found_by: str = "index") -> None:
        self.nvml = nvml
        self.pid = pid
        self.handle, self.found_by = handle, found_by
        self.total_bytes = int(nvml.nvmlDeviceGetMemoryInfo(self.handle).total)
        self.name = nvml.nvmlDeviceGetName(self.handle)
        self.name = self.name.decode() if isinstance(self.name, bytes) else str(self.name)

    def processes(self) -> list:
        return list(self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle))

    def used_bytes(self) -> tuple[int | None, int]:
        """(this process's used memory or None if the driver does not report it, processes on the device)."""
        procs = self.processes()
        for p in procs:
            if p.pid == self.pid and p.usedGpuMemory is not None:
                return int(p.usedGpuMemory), len(procs)
        return None, len(procs)

    def utilization_percent(self) -> float:
        return float(self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)


class CudaSource:
    """The CUDA caching allocator's peaks on one device; ``cuda`` is ``torch.cuda`` or a fake."""

    def __init__(self, cuda, device: torch.device) -> None:
        self.cuda, self.device = cuda, device
        self.baseline = 0

    def reset(self) -> None:
        self.cuda.synchronize(self.device)
        self.cuda.reset_peak_memory_stats(self.device)
        self.baseline = self.cuda.memory_allocated(self.device)

    def read(self) -> dict:
        self.cuda.synchronize(self.device)
        return {"cuda_max_allocated_bytes": self.cuda.max_memory_allocated(self.device) - self.baseline,
                "cuda_max_reserved_bytes": self.cuda.max_memory_reserved(self.device),
                "cuda_total_bytes": self.cuda.get_device_properties(self.device).total_memory}


class Recorder:
    """Memory peaks and average utilization of this process between ``start`` and ``stop``.

    ``nvml`` and ``cuda`` default to the real ``pynvml`` and ``torch.cuda``; tests pass fakes, or
    None to make a source missing. ``threads`` is the process's intra-op thread count (for the CPU
    share); ``cpu_time`` and ``rss`` are injectable clocks for tests.
    """

    def __init__(self, device: torch.device | str = "cpu", *, enabled: bool = True, interval_s: float = 0.2,
                 nvml: Any = _UNSET, cuda: Any = _UNSET, threads: int | None = None,
                 cpu_time: Callable[[], float] = time.process_time,
                 rss: Callable[[], tuple[int, str]] | None = None, pid: int | None = None) -> None:
        self.device = torch.device(device)
        self.enabled = enabled
        self.interval_s = interval_s
        self.threads = threads or torch.get_num_threads()
        self._cpu_time = cpu_time
        self._rss = rss
        self.missing: dict[str, str] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.cuda = self.nvml = None
        if not enabled:
            return
        pid = os.getpid() if pid is None else pid
        if self.device.type == "cuda":
            self.cuda = CudaSource(torch.cuda if cuda is _UNSET else cuda, self.device) if cuda is not None else None
            if self.cuda is None:
                self.missing["cuda_allocator"] = "disabled"
            module, reason = _load_nvml() if nvml is _UNSET else ((nvml, None) if nvml else (None, "disabled"))
            if module is not None:
                try:
                    props_from = torch.cuda if cuda is _UNSET else cuda
                    handle, found_by = nvml_handle(module, props_from, self.device)
                    self.nvml = NvmlSource(module, handle, pid, found_by)
                except Exception as exc:
                    reason = f"NVML has no handle for GPU {self.device}: {exc}"
            if self.nvml is None:
                self.missing["nvml"] = reason
        else:
            self.missing["cuda_allocator"] = self.missing["nvml"] = "not a GPU process"

    # -- the measured region ----------------------------------------------------------------------
    def start(self) -> "Recorder":
        if not self.enabled:
            return self
        if self._rss is None:
            self._rss_source = "rss_hwm_reset" if memory.reset_rss_peak() else "ru_maxrss"
            current = memory.rss_bytes() if self._rss_source == "rss_hwm_reset" else None
            self._rss_base = current if current is not None else memory.peak_rss_bytes()
        if self.cuda is not None:
            self.cuda.reset()
        self._samples: list[float] = []
        self._nvml_peak: int | None = None
        self._nvml_procs = 0
        self._nvml_note: str | None = None
        self._t0, self._c0 = time.monotonic(), self._cpu_time()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample_loop, daemon=True, name="recorder-sampler")
        self._thread.start()
        return self

    def _sample_once(self, last: list[float]) -> None:
        if self.nvml is not None:
            try:
                self._samples.append(self.nvml.utilization_percent())
                used, procs = self.nvml.used_bytes()
                self._nvml_procs = max(self._nvml_procs, procs)
                if used is None:
                    self._nvml_note = "the driver does not report this process's memory (container PID namespace?)"
                else:
                    self._nvml_peak = max(self._nvml_peak or 0, used)
            except Exception as exc:
                self._nvml_note = f"NVML sampling failed: {exc}"
            return
        now, cpu = time.monotonic(), self._cpu_time()
        if now > last[0]:
            self._samples.append(100.0 * (cpu - last[1]) / (now - last[0]) / self.threads)
        last[:] = [now, cpu]

    def _sample_loop(self) -> None:
        last = [self._t0, self._c0]
        while not self._stop.wait(self.interval_s):
            self._sample_once(last)

    def stop(self, extra: dict | None = None) -> dict:
        """Stop sampling; the record of the measured region (empty when disabled)."""
        if not self.enabled:
            return {}
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        wall, cpu = time.monotonic() - self._t0, self._cpu_time() - self._c0
        if self.nvml is not None:
            self._sample_once([self._t0, self._c0])  # at least one sample, even for a short region
        rec: dict[str, Any] = {"device": str(self.device), "sources": [], "missing": dict(self.missing),
                               "wall_s": wall, "cpu_s": cpu, "threads": self.threads,
                               "cpu_busy_percent": 100.0 * cpu / wall / self.threads if wall > 0 else None}
        if self.cuda is not None:
            rec.update(self.cuda.read())
            rec["sources"].append("cuda_allocator")
        if self.nvml is not None:
            rec["gpu_name"] = self.nvml.name
            rec["nvml_found_by"] = self.nvml.found_by
            rec["nvml_total_bytes"] = self.nvml.total_bytes
            if self._nvml_peak is not None:
                rec["nvml_peak_used_bytes"] = self._nvml_peak
                rec["sources"].append("nvml")
            else:
                rec["missing"]["nvml"] = self._nvml_note or "no sample"
        if self._rss is None:
            rec["peak_rss_bytes"] = memory.peak_rss_bytes() - self._rss_base
            rss_source = self._rss_source
        else:
            rec["peak_rss_bytes"], rss_source = self._rss()
        rec["sources"].append(rss_source)
        primary = "cuda_max_allocated_bytes" if "cuda_allocator" in rec["sources"] else "peak_rss_bytes"
        rec["peak_bytes"], rec["peak_source"] = rec[primary], primary
        self._add_utilization(rec)
        if extra:
            rec.update(extra)
        return rec

    def _add_utilization(self, rec: dict) -> None:
        if self.nvml is not None:
            rec["util_source"] = "nvml_gpu"
            rec["util_shared_device"] = self._nvml_procs > 1
            if rec["util_shared_device"]:
                rec["util_note"] = (f"{self._nvml_procs} processes share this GPU: NVML utilization is device-wide "
                                    "and cannot be attributed to one of them")
        else:
            rec["util_source"] = "process_cpu"
            if self.device.type == "cuda":
                rec["util_note"] = "no NVML: CPU share of the process instead of GPU utilization"
        samples = self._samples
        if not samples and self.nvml is None:  # shorter than one interval: the whole region is the sample
            samples = [rec["cpu_busy_percent"]] if rec["cpu_busy_percent"] is not None else []
        rec["util_mean_percent"] = sum(samples) / len(samples) if samples else None
        rec["util_samples"] = len(samples)


# -- on the workers: a part of each worker's host (bigconv.runtime.host) -----------------------------
class WorkerRecording:
    """A ``Recorder`` running on one worker, from its install (peaks and traffic counts reset) to ``stop``."""

    def __init__(self, host, enabled: bool = True, interval_s: float = 0.2) -> None:
        host.reset_peaks()
        self.stats = host.rt.stats
        self.recorder = Recorder(host.rt.device, enabled=enabled, interval_s=interval_s).start()

    def stop(self) -> dict:
        """Stop recording; this worker's record, with its halo traffic since the start."""
        stats = self.stats
        halo = {"halo_messages": stats["messages"], "halo_sent_bytes": stats["bytes"],
                "halo_recv_bytes": stats["recv_bytes"], "halo_wait_s": stats["wait_s"]}
        return self.recorder.stop(halo)


def start_recording(world, enabled: bool = True) -> int:
    """Start a ``WorkerRecording`` on every worker of ``world``; the part's id, for ``stop_recording``."""
    return world.install(WorkerRecording, [(enabled,)] * world.workers, "starting the recorders")


def stop_recording(world, part_id: int) -> list[dict]:
    """Every worker's record since ``start_recording``; the recorders are removed."""
    try:
        return world.call_part(part_id, "stop", [()] * world.workers, "stopping the recorders")
    finally:
        world.retire(part_id)


def limit_memory(budget_bytes: int, device: torch.device | str = "cpu") -> dict:
    """Cap this process at ``budget_bytes`` more memory than it holds now; how it was enforced.

    GPU: ``torch.cuda.set_per_process_memory_fraction`` (one large GPU stands in for smaller ones).
    CPU: ``RLIMIT_DATA`` at the current data segment plus the budget, so a larger allocation fails
    with the allocator's out-of-memory error instead of swapping or waking the OOM killer. It
    bounds virtual, not resident, memory, so it is looser than the measured peaks (a cap, not a
    measurement).
    """
    device = torch.device(device)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total), device)
        return {"budget_enforced_by": "cuda_memory_fraction", "budget_fraction": min(1.0, budget_bytes / total)}
    data = memory._status_kib("VmData")
    if data is None:
        return {"budget_enforced_by": None}
    limit = data * 1024 + int(budget_bytes)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.getrlimit(resource.RLIMIT_DATA)[1]))
    return {"budget_enforced_by": "rlimit_data", "rlimit_data_bytes": limit}


def worker_limit_memory(host, budget_bytes: int) -> dict:
    """``limit_memory`` on a worker (``World.on_hosts``)."""
    return limit_memory(budget_bytes, host.rt.device)
