"""A DSN workload for benchmark sweeps (the harness's ``sweep --model dsn``).

``run_steps`` builds a DSN of a given image size, K and width, a synthetic batch, and runs training steps
in this process or on a World. Memory is the caller's to measure (around the call in this process for
``placement="single"``; with ``World.reset_peaks``/``World.memory`` on ``result["workers"]``
otherwise), so the harness keeps one method for every model.
"""

from __future__ import annotations

import os
import time

import torch

from .batch import Batch
from .config import DSNConfig
from .model import DSN
from .trainer import make_trainer


def bench_config(image_size: int, num_targets: int, width: int = 8, similarity: str = "dann",
                 depth: int = 3) -> DSNConfig:
    """A DSN for ``image_size`` x ``image_size`` RGB images: ``depth`` encoder and decoder blocks whose widths
    start at ``width`` (private encoders and decoder at half), code 64, 10 classes. ``image_size`` must be
    divisible by 2**depth."""
    half = max(1, width // 2)
    return DSNConfig(image_size=image_size, channels=3, num_classes=10, num_targets=num_targets, code_size=64,
                     shared_widths=tuple(width * 2**i for i in range(depth)),
                     private_widths=tuple(half * 2**i for i in range(depth)),
                     decoder_widths=tuple(half * 2 ** (depth - 1 - i) for i in range(depth)),
                     classifier_hidden=100, similarity=similarity, warmup_steps=0)


def synthetic_batch(cfg: DSNConfig, batch_size: int = 2, dtype: torch.dtype = torch.float32, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    shape = (batch_size, cfg.channels, cfg.image_size, cfg.image_size)
    return Batch(source=(torch.rand(shape, generator=g, dtype=dtype),
                         torch.randint(0, cfg.num_classes, (batch_size,), generator=g)),
                 targets=[torch.rand(shape, generator=g, dtype=dtype) for _ in range(cfg.num_targets)])


def run_steps(image_size: int, num_targets: int, *, steps: int = 3, width: int = 8, batch_size: int = 2,
              placement: str = "single", world=None, decoder: str = "domain", head: str = "separate",
              similarity: str = "dann", depth: int = 3, dtype: torch.dtype = torch.float32, seed: int = 0) -> dict:
    """Train a ``bench_config`` DSN for ``steps`` SGD steps on one synthetic batch (all losses on: no warm-up).

    placement: ``"single"`` (this process; ``world`` unused) or ``"domain"`` / ``"encoder"`` on ``world``
    (a ``bigconv.World`` with at least ``multidsn.placement.workers_needed(num_targets, placement, head)``
    workers; ``decoder`` and ``head`` as in ``multidsn.parallelize``).

    Returns {"step_s": [seconds per step], "loss": last loss, "workers": [indices of the workers used, []
    for single], "params": parameter count, "config": the DSNConfig as a dict}. Its parts are removed from
    the workers before it returns, so one World can serve a whole sweep.
    """
    cfg = bench_config(image_size, num_targets, width, similarity, depth)
    torch.manual_seed(seed)
    dsn = DSN(cfg).to(dtype)
    batch = synthetic_batch(cfg, batch_size, dtype, seed)
    model = make_trainer(dsn, world, placement, decoder, head)
    try:
        model.optimizer(torch.optim.SGD, lr=0.01, momentum=0.9)
        times, loss = [], None
        for _ in range(steps):
            start = time.perf_counter()
            loss = float(model.train_step_terms(batch).total)
            times.append(time.perf_counter() - start)
        used = [] if placement == "single" else list(model.workers)
    finally:
        model.close()
    return {"step_s": times, "loss": loss, "workers": used, "params": sum(p.numel() for p in dsn.parameters()),
            "config": dict(cfg.__dict__)}


def run_config(cfg, world=None) -> dict:
    """The harness's DSN configuration (a ``bigconv.harness.runner.RunConfig`` of model ``dsn``): 1 source and
    ``cfg.targets`` targets, single process or distributed with ``cfg.placement``; the part of the record
    the runner fills in."""
    import bigconv

    from bigconv.harness import recorder
    from bigconv.harness.recorder import Recorder

    dtype = getattr(torch, cfg.dtype)
    kwargs = dict(steps=cfg.steps + 1, width=cfg.width, batch_size=cfg.batch, depth=cfg.depth, dtype=dtype)
    warm = dict(kwargs, steps=1)
    placement = cfg.placement or "domain"
    if cfg.workers == 0:
        run_steps(8 * 2**cfg.depth, cfg.targets, **warm)
        rec = Recorder(cfg.device, enabled=cfg.record)
        rec.start()
        r = run_steps(cfg.size, cfg.targets, **kwargs)
        per = [rec.stop() if cfg.record else {}]
        grid = None
    else:
        own = world is None
        world = world or bigconv.World(workers=cfg.workers, device=cfg.device,
                                       threads_per_worker=max(1, (os.cpu_count() or 1) // cfg.workers),
                                       timeout=max(60.0, cfg.timeout_s / 3))
        try:
            run_steps(8 * 2**cfg.depth, cfg.targets, placement=placement, world=world, **warm)
            recording = recorder.start_recording(world, cfg.record)
            r = run_steps(cfg.size, cfg.targets, placement=placement, world=world, **kwargs)
            per = recorder.stop_recording(world, recording)
        finally:
            if own:
                world.close()
        grid = None
        for i, p in enumerate(per):
            p["used"] = i in r["workers"]
    return {"grid": grid, "step_s": min(r["step_s"][1:]), "step_times_s": r["step_s"][1:], "loss": r["loss"],
            "budget": None, "per_worker": per}
