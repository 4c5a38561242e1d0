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
from bigconv import models, worker
from bigconv.memory import PeakMeter
from bigconv.world import WORKER_ENV


@dataclass(kw_only=True)
class Workload:
    """A model, an input size and a few training steps."""

    model: str = "cnn2d"
    """One of cnn1d, cnn2d, cnn3d."""
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
        if self.model not in ("cnn1d", "cnn2d", "cnn3d"):
            raise ValueError(f"model must be cnn1d, cnn2d or cnn3d, got {self.model!r}")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be float32 or float64, got {self.dtype!r}")
        for name in ("size", "batch", "channels", "width", "depth", "steps"):
            bigconv.geometry.check_positive_int(getattr(self, name), name)

    @property
    def dims(self) -> int:
        return int(self.model[3])

    def build(self) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
        torch.manual_seed(self.seed)
        cls = {1: models.CNN1D, 2: models.CNN2D, 3: models.CNN3D}[self.dims]
        model = cls(self.channels, 2, width=self.width, depth=self.depth).to(getattr(torch, self.dtype))
        x = torch.randn(self.batch, self.channels, *[self.size] * self.dims, dtype=getattr(torch, self.dtype))
        y = torch.randint(0, 2, (self.batch,))
        return model, x, y


def warmup_workload(w: Workload) -> Workload:
    """The same model on a tiny input: pages in kernels and thread pools before memory is measured."""
    return Workload(**{**asdict(w), "size": 4 * max(1, w.depth) + 8, "batch": 1, "steps": 1})


def train_plain(w: Workload, threads: int, warm: bool = True) -> dict:
    """Train in this process; memory is the peak above the resident set before the model exists
    (after a warm-up step on a tiny input when ``warm``: the runtime's own one-off costs excluded).
    """
    torch.set_num_threads(threads)
    if warm:
        train_plain(warmup_workload(w), threads, warm=False)
    meter = PeakMeter("cpu")
    model, x, y = w.build()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    times, loss = [], None
    for step in range(w.steps + 1):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        if step:
            times.append(time.perf_counter() - t0)
    return {**meter.read(), "step_s": min(times) if times else None, "step_times_s": times, "loss": loss.item(),
            "threads": threads,
            "warm_baseline": warm}


def plain_in_fresh_process(w: Workload, threads: int = 1) -> dict:
    """The plain run in a fresh process, under the workers' allocator settings so the two compare."""
    env = {**WORKER_ENV, **os.environ}
    code = ("import json, sys; from experiments.workload import Workload, train_plain; "
            "w = Workload(**json.loads(sys.argv[1])); print(json.dumps(train_plain(w, int(sys.argv[2]))))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(asdict(w)), str(threads)], check=True, env=env,
                         capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    return json.loads(out.stdout.strip().splitlines()[-1])


def train_distributed(w: Workload, world: bigconv.World, grid=None, warm: bool = True) -> dict:
    """Train on ``world``; per-worker memory is each worker's peak above its baseline (taken after a
    warm-up step on a tiny input when ``warm``, as for the plain run).
    """
    if warm:
        train_distributed(warmup_workload(w), world, grid=None, warm=False)
        world.call(worker.reset_memory, [()] * world.workers, "resetting memory peaks")
    model, x, y = w.build()
    net = bigconv.parallelize(model, world, grid=grid)
    net.optimizer(torch.optim.SGD, lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    times, loss = [], None
    for step in range(w.steps + 1):
        t0 = time.perf_counter()
        loss = net.train_step(x, y, loss_fn)
        if step:
            times.append(time.perf_counter() - t0)
    mem = world.call(worker.memory, [()] * world.workers, "reading memory")
    traffic = world.call(worker.transport_stats, [()] * world.workers, "reading transport stats")
    return {"grid": list(net.plan(x).grid), "step_s": min(times) if times else None, "step_times_s": times,
            "loss": loss,
            "workers": world.workers, "warm_baseline": warm,
            "per_worker": [{**m, **t} for m, t in zip(mem, traffic)]}


def environment() -> dict:
    """Hardware, versions and commit, for every record."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(__file__)).stdout.strip() or None
    except OSError:
        commit = None
    return {"torch": torch.__version__, "python": platform.python_version(), "cpu": platform.processor() or
            platform.machine(), "cores": os.cpu_count(), "gpu": torch.cuda.get_device_name(0) if
            torch.cuda.is_available() else None, "commit": commit}
