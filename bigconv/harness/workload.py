"""One training workload, run plainly in a fresh process or on a World, with its figures.

The plain run is what the ORNL study's blue curves were: the same model in one process, no RPC.
CPU memory comes from peak RSS, which never resets, so the plain run always gets a fresh process.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch

import bigconv
from bigconv.geometry.boxes import check_positive_int
from bigconv.memory import PeakMeter
from bigconv.provenance import ROOT, source_commit
from bigconv.runtime.world import WORKER_ENV
from bigconv.harness import recorder, registry
from bigconv.harness.recorder import Recorder


@dataclass(kw_only=True)
class Workload:
    """A model, an input size and a few training steps."""

    model: str = "cnn2d"
    """A name in ``bigconv.harness.registry.MODELS`` (cnn1d, cnn2d, cnn3d, ...)."""
    size: int = 256
    """Edge length of the (square or cubic) input."""
    batch: int = 1
    """Images per step."""
    channels: int = 1
    """Input channels."""
    width: int = 16
    """Channels of every conv layer."""
    depth: int = 3
    """Conv+ReLU blocks."""
    dtype: str = "float32"
    """float32 or float64."""
    steps: int = 3
    """Timed training steps, after one warm-up step."""
    seed: int = 0
    """Seed of the weights and the data."""

    def __post_init__(self) -> None:
        registry.spec(self.model)  # raises naming the known models
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be float32 or float64, got {self.dtype!r}")
        for name in ("size", "batch", "channels", "width", "depth", "steps"):
            check_positive_int(getattr(self, name), name)

    @property
    def spec(self) -> registry.ModelSpec:
        return registry.spec(self.model)

    @property
    def dims(self) -> int:
        return self.spec.dims

    def build(self) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
        torch.manual_seed(self.seed)
        spec = self.spec
        model = spec.build(self.channels, 2, self.width, self.depth).to(getattr(torch, self.dtype))
        x = torch.randn(self.batch, self.channels, *[self.size] * self.dims, dtype=getattr(torch, self.dtype))
        return model, x, spec.target(self.batch, self.size)


def warmup_workload(w: Workload) -> Workload:
    """The same model on a tiny input: pages in kernels and thread pools before memory is measured."""
    m = w.spec.edge_multiple(w.depth)
    size = max(4 * max(1, w.depth) + 8, 4 * m)
    return Workload(**{**asdict(w), "size": -(-size // m) * m, "batch": 1, "steps": 1})


def train_plain(w: Workload, threads: int, warm: bool = True, recorder: Recorder | None = None,
                device: str = "cpu") -> dict:
    """Train in this process; memory is the peak above the resident set before the model exists
    (after a warm-up step on a tiny input when ``warm``: the runtime's own one-off costs excluded).
    ``recorder`` (not started) adds its record under ``recorder``; it starts where the meter does.
    """
    torch.set_num_threads(threads)
    if warm:
        train_plain(warmup_workload(w), threads, warm=False, device=device)
    meter = PeakMeter(device)
    if recorder is not None:
        recorder.start()
    model, x, y = w.build()
    model, x, y = model.to(device), x.to(device), y.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    times, loss = [], None
    for step in range(w.steps + 1):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        if device != "cpu":
            torch.cuda.synchronize(device)
        if step:
            times.append(time.perf_counter() - t0)
    record = {**meter.read(), "step_s": min(times) if times else None, "step_times_s": times, "loss": loss.item(),
              "threads": threads, "warm_baseline": warm}
    if recorder is not None:
        record["recorder"] = recorder.stop()
    return record


def plain_in_fresh_process(w: Workload, threads: int = 1) -> dict:
    """The plain run in a fresh process, under the workers' allocator settings so the two compare."""
    env = {**WORKER_ENV, **os.environ}
    code = ("import json, sys; from bigconv.harness.workload import Workload, train_plain; "
            "w = Workload(**json.loads(sys.argv[1])); print(json.dumps(train_plain(w, int(sys.argv[2]))))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(asdict(w)), str(threads)], check=True, env=env,
                         capture_output=True, text=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def train_distributed(w: Workload, world: bigconv.World, grid=None, warm: bool = True, record: bool = False,
                      budget_bytes: int | None = None, transport: str = "p2p") -> dict:
    """Train on ``world``; per-worker memory is each worker's peak above its baseline (taken after a
    warm-up step on a tiny input when ``warm``, as for the plain run). ``record`` runs the recorder
    on every worker (utilization, NVML, halo wait); ``budget_bytes`` caps each worker after the warm-up
    (``bigconv.harness.recorder.limit_memory``). ``transport``: the driver mode's (``parallelize``).
    """
    if warm:
        train_distributed(warmup_workload(w), world, grid=None, warm=False, transport=transport)
    limits = (world.on_hosts(recorder.worker_limit_memory, [(budget_bytes,)] * world.workers, "capping memory")
              if budget_bytes else None)
    recording = recorder.start_recording(world) if record else None
    if warm and not record:
        world.reset_peaks()
    model, x, y = w.build()
    net = bigconv.parallelize(model, world, grid=tuple(grid) if grid else None, transport=transport)
    net.optimizer(torch.optim.SGD, lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    times, loss = [], None
    for step in range(w.steps + 1):
        t0 = time.perf_counter()
        loss = net.train_step(x, y, loss_fn)
        if step:
            times.append(time.perf_counter() - t0)
    recs = recorder.stop_recording(world, recording) if record else [{}] * world.workers
    mem = world.memory()
    traffic = world.traffic()
    return {"grid": list(net.plan(x).grid), "step_s": min(times) if times else None, "step_times_s": times,
            "loss": loss, "transport": transport,
            "workers": world.workers, "warm_baseline": warm, "budget": limits[0] if limits else None,
            "per_worker": [{**m, **t, **r} for m, t, r in zip(mem, traffic, recs)]}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict:
    """Hardware, versions and commit, for every record."""
    commit, dirty = source_commit()
    commit = commit[:7] if commit else None  # the short hash, as records written before carry
    gpu = torch.cuda.is_available()
    pages = os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    return {"torch": torch.__version__, "python": platform.python_version(), "cpu": platform.processor() or
            platform.machine(), "cpu_model": _cpu_model(), "cores": os.cpu_count(),
            "host_memory_bytes": pages * os.sysconf("SC_PAGE_SIZE") if pages else None,
            "gpu": torch.cuda.get_device_name(0) if gpu else None,
            "gpu_count": torch.cuda.device_count() if gpu else 0,
            "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory if gpu else None,
            "commit": commit, "commit_dirty": dirty}
