"""A workload trained in the SPMD mode: what each rank runs, and the parent that launches the ranks.

Each rank builds the same model and batch, trains one warm-up step on a tiny input (kernels and
thread pools paged in, as for the plain run), then measures its own peak memory above what it held
before the model existed, and the best step time. The full batch is built before the meter starts:
in a real run a rank reads only its own region (``bigconv.data`` sources), so the benchmark counts
what training holds, not the test batch. Halo time is the time a rank waited for exchanges to land.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import torch

import bigconv
from ..memory import PeakMeter
from .workload import Workload, warmup_workload


def _steps(w: Workload, world, grid, replicas: int, x=None, y=None, model=None) -> tuple:
    if model is None:
        model, x, y = w.build()
    net = bigconv.parallelize(model, world, grid=tuple(grid) if grid else None, replicas=replicas)
    net.optimizer(torch.optim.SGD, lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    times = []
    for step in range(w.steps + 1):
        if world.device.type == "cuda":
            torch.cuda.synchronize(world.device)
        t0 = time.perf_counter()
        # The batch stays on the host: each rank moves only its own shard to its device, as a real run
        # reading its region would (copying the whole image to every GPU timed n copies of it).
        loss = net.train_step(x, y, loss_fn)
        if world.device.type == "cuda":
            torch.cuda.synchronize(world.device)
        if step:
            times.append(time.perf_counter() - t0)
    return net, times, loss


def rank_main(wd: dict, grid, replicas: int, threads: int, device: str = "cpu", memory_fraction: float | None = None,
              timeout: float = 300.0, record: bool = False, budget_bytes: int | None = None) -> dict:
    """One rank's run (called through ``bigconv.runtime.spmd_launch.run`` or under torchrun).

    ``record`` runs the recorder (utilization, NVML) over the measured steps; ``budget_bytes`` caps
    the rank after the warm-up, as the driver mode caps each worker (``recorder.limit_memory``).
    """
    from .recorder import Recorder, limit_memory

    torch.set_num_threads(threads)
    w = Workload(**wd)
    with bigconv.World.from_env(mode="spmd", device=device, timeout=timeout) as world:
        if memory_fraction and world.device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(memory_fraction, world.device)
        _steps(warmup_workload(w), world, None, replicas)
        budget = limit_memory(budget_bytes, world.device) if budget_bytes else None
        model, x, y = w.build()
        meter = PeakMeter(world.device)
        rec = Recorder(world.device, enabled=record, threads=threads).start()
        net, times, loss = _steps(w, world, grid, replicas, x, y, model)
        stats = dict(net.stats)
        return {**rec.stop(), **meter.read(), "rank": world.rank, "step_s": min(times), "step_times_s": times,
                "loss": loss, "grid": list(net.plan(x).grid), "replicas": replicas, "stats": stats,
                "halo_messages": stats.get("messages", 0), "halo_sent_bytes": stats.get("bytes", 0),
                "halo_recv_bytes": stats.get("recv_bytes", 0), "halo_wait_s": stats.get("wait_s", 0.0),
                "budget": budget, "device": str(world.device),
                **({"memory_cap": memory_cap_note(memory_fraction)} if memory_fraction and world.device.type == "cuda"
                   else {})}


def memory_cap_note(fraction: float) -> dict:
    """What an emulated card (``set_per_process_memory_fraction``) does and does not hold."""
    return {"fraction": fraction, "caps": "PyTorch's caching allocator only",
            "leaves_out": "the CUDA context, NCCL's communicator buffers and library workspaces allocated "
                          "outside the caching allocator: a real card of that size holds less; NVML's "
                          "per-process figure (nvml_max_used_bytes) counts them"}


def train_spmd(w: Workload, ranks: int, grid=None, replicas: int = 1, threads: int = 1, device: str = "cpu",
               memory_fraction: float | None = None, timeout: float = 900.0, record: bool = False,
               budget_bytes: int | None = None) -> dict:
    """Launch ``ranks`` local SPMD ranks on ``w``; per-rank records and the slowest rank's best step."""
    from ..runtime import spmd_launch as launch

    # A rank's own waits give up well before the launch does, so the error names the peer it waited for.
    rank_timeout = max(60.0, timeout / 3)
    per_rank = launch.run(rank_main, ranks, (asdict(w), grid, replicas, threads, device, memory_fraction,
                                             rank_timeout, record, budget_bytes),
                          timeout=timeout, threads=threads)
    return {"grid": per_rank[0]["grid"], "step_s": max(r["step_s"] for r in per_rank),
            "step_times_s": [max(t) for t in zip(*(r["step_times_s"] for r in per_rank))],
            "per_rank": per_rank}
