"""Peak memory of this process, from the sources that exist here.

CPU: the kernel's resident-set high-water mark. On Linux it can be reset (``/proc/self/clear_refs``),
so a meter measures the peak since it started above the resident set at that moment; elsewhere it
falls back to ``ru_maxrss``, which never resets, so only fresh processes give clean figures there.
GPU: the CUDA allocator's peaks. Every record names the sources it used.
"""

from __future__ import annotations

import re
import resource
import sys

import torch

_STATUS = "/proc/self/status"


def _status_kib(field: str) -> int | None:
    try:
        with open(_STATUS) as fh:
            match = re.search(rf"^{field}:\s+(\d+) kB", fh.read(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def reset_rss_peak() -> bool:
    """Reset the resident-set high-water mark (Linux >= 4.0); False where that is impossible."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """High-water mark of this process's resident memory."""
    hwm = _status_kib("VmHWM")
    if hwm is not None:
        return hwm * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


def rss_bytes() -> int | None:
    rss = _status_kib("VmRSS")
    return None if rss is None else rss * 1024


class PeakMeter:
    """Peak memory since construction, above what the process held at that moment."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.reset()

    def reset(self) -> None:
        self.rss_source = "rss_hwm_reset" if reset_rss_peak() else "ru_maxrss"
        current = rss_bytes() if self.rss_source == "rss_hwm_reset" else None
        self.baseline_rss = current if current is not None else peak_rss_bytes()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline_cuda = torch.cuda.memory_allocated(self.device)

    def read(self) -> dict:
        record = {"peak_rss_bytes": peak_rss_bytes() - self.baseline_rss, "sources": [self.rss_source]}
        if self.device.type == "cuda":
            record["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device) - self.baseline_cuda
            record["cuda_max_reserved_bytes"] = torch.cuda.max_memory_reserved(self.device)
            record["sources"].append("cuda_allocator")
        record["peak_bytes"] = record.get("cuda_max_allocated_bytes", record["peak_rss_bytes"])
        return record
