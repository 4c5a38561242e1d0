"""One configuration, measured in fresh processes: the unit every sweep and size search is made of.

    python -m bigconv.harness.runner '{"model": "cnn2d", "size": 512, "workers": 2}'   # prints RECORD {...}

The DSN (model ``dsn``) is multidsn's, a layer above: its run comes in through ``tasks`` (``run_here``,
``main``) and its fresh process through ``entry`` (``run_fresh``); ``experiments.runs`` passes both, and
runs every model.

``run_fresh`` starts this module in a new process (peak RSS never resets across configurations;
a World's workers are new processes too) and turns whatever happens into one record: ``ok``, ``oom``
(an allocator's out-of-memory error anywhere, a process killed by SIGKILL, presumably by the
kernel's OOM killer) or ``error`` with a message. ``workers == 0`` is the plain single process with
no RPC: the study's blue curves.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable, Mapping

import torch

from bigconv.runtime.world import WORKER_ENV
from bigconv.harness import registry
from bigconv.provenance import ROOT

MARK = "RECORD "
_OOM_TEXT = ("out of memory", "can't allocate memory", "cannot allocate memory", "outofmemoryerror")


@dataclass(kw_only=True)
class RunConfig:
    """One measured configuration."""

    model: str = "cnn2d"
    """A name in ``bigconv.harness.registry.MODELS``."""
    size: int = 256
    """Edge of the square/cubic input (its length for 1D)."""
    workers: int = 0
    """Worker processes; 0 is the plain single process without RPC."""
    batch: int = 1
    """Images per step."""
    grid: list[int] | None = None
    """Shard grid; None lets bigconv pick the one with the least cut surface."""
    width: int = 16
    """Channels of every conv layer."""
    depth: int = 3
    """Conv blocks (or levels, for encoder-decoder nets)."""
    dtype: str = "float32"
    """float32 or float64."""
    steps: int = 1
    """Measured steps after one step on the same input (and a warm-up on a tiny one)."""
    device: str = "cpu"
    """cpu or cuda."""
    budget_bytes: int | None = None
    """Per-process memory cap, enforced (GPU: memory fraction; CPU: RLIMIT_DATA); None: no cap."""
    record: bool = True
    """Run the recorder (utilization sampling, NVML) in every process."""
    targets: int | None = None
    """DSN only: target domains (1 source + ``targets``); ``workers`` is then what the domain placement
    needs (``multidsn.placement.workers_needed``), and 0 is the single-process DSN."""
    placement: str | None = None
    """DSN only: ``"domain"`` (None means this too) or ``"encoder"`` (the ORNL layout: every encoder on a
    worker of its own)."""
    mode: str | None = None
    """How ``workers`` > 0 run: None (the driver mode: a driver and RPC workers) or ``"spmd"`` (that many
    ranks, no driver, halos by point-to-point; ``bigconv.spmd``)."""
    replicas: int | None = None
    """SPMD only: data-parallel replicas (``workers`` = replicas x shards); None means 1."""
    timeout_s: float = 900.0
    """Wall-clock limit of the whole configuration; not part of its identity."""

    def __post_init__(self) -> None:
        spec = registry.spec(self.model)
        if self.size != spec.round_size(self.size, self.depth):
            raise ValueError(f"{self.model} needs edges that are multiples of {spec.edge_multiple(self.depth)}, "
                             f"got {self.size}")
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0 (0 = plain single process), got {self.workers}")
        if (spec.task == "dsn") != (self.targets is not None):
            raise ValueError("targets is for --model dsn (and dsn needs it)")
        if self.placement is not None and (spec.task != "dsn" or self.placement not in ("domain", "encoder")):
            raise ValueError(f"placement is for --model dsn, one of 'domain' or 'encoder'; got {self.placement!r}")
        if self.mode not in (None, "spmd"):
            raise ValueError(f"mode must be None (the driver mode) or 'spmd', got {self.mode!r}")
        if self.mode == "spmd" and (self.workers == 0 or spec.task == "dsn"):
            raise ValueError("mode 'spmd' is for workers > 0 and a bigconv model (not the plain run or dsn)")
        if self.replicas is not None and (self.mode != "spmd" or self.replicas < 1 or self.workers % self.replicas):
            raise ValueError(f"replicas is for mode 'spmd' and must divide workers ({self.workers}), "
                             f"got {self.replicas}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def classify(text: str) -> str:
    return "oom" if any(t in text.lower() for t in _OOM_TEXT) else "error"


def _summary(per_worker: list[dict]) -> dict:
    peaks = [p.get("peak_bytes") for p in per_worker if p.get("peak_bytes") is not None]
    utils = [p["util_mean_percent"] for p in per_worker if p.get("util_mean_percent") is not None]
    out = {"peak_bytes_max": max(peaks) if peaks else None, "peak_bytes_per_worker": peaks,
           "util_mean_percent": sum(utils) / len(utils) if utils else None,
           "sources": sorted({s for p in per_worker for s in p.get("sources", [])}),
           "missing": {k: v for p in per_worker for k, v in p.get("missing", {}).items()},
           "util_source": per_worker[0].get("util_source") if per_worker else None}
    for key in ("halo_messages", "halo_sent_bytes", "halo_recv_bytes", "halo_wait_s"):
        if any(key in p for p in per_worker):
            out[key + "_total"] = sum(p.get(key, 0) for p in per_worker)
    nvml = [p["nvml_peak_used_bytes"] for p in per_worker if "nvml_peak_used_bytes" in p]
    if nvml:
        out["nvml_peak_used_bytes_max"] = max(nvml)
    return out


def _workload(cfg: RunConfig):
    from bigconv.harness.workload import Workload

    return Workload(model=cfg.model, size=cfg.size, batch=cfg.batch, width=cfg.width, depth=cfg.depth,
                    dtype=cfg.dtype, steps=cfg.steps)


def run_plain(cfg: RunConfig) -> dict:
    from bigconv.harness.recorder import Recorder, limit_memory
    from bigconv.harness.workload import train_plain, warmup_workload

    w = _workload(cfg)
    threads = max(1, os.cpu_count() or 1)
    device = "cuda:0" if cfg.device == "cuda" else "cpu"
    train_plain(warmup_workload(w), threads, warm=False, device=device)
    budget = limit_memory(cfg.budget_bytes, device) if cfg.budget_bytes else None
    rec = Recorder(device, enabled=cfg.record, threads=threads)
    r = train_plain(w, threads, warm=False, recorder=rec, device=device)
    per = r.pop("recorder") or {k: r[k] for k in ("peak_bytes", "peak_rss_bytes", "sources") if k in r}
    return {"grid": None, "step_s": r["step_s"], "step_times_s": r["step_times_s"], "loss": r["loss"],
            "budget": budget, "per_worker": [per]}


def run_world(cfg: RunConfig, world=None) -> dict:
    """On ``world`` (one launched by a cluster launcher), or on a fresh local World of ``cfg.workers``."""
    import bigconv
    from bigconv.harness.workload import train_distributed

    w = _workload(cfg)
    if world is not None:
        return train_distributed(w, world, grid=cfg.grid, record=cfg.record, budget_bytes=cfg.budget_bytes)
    threads = max(1, (os.cpu_count() or 1) // cfg.workers)
    with bigconv.World(workers=cfg.workers, device=cfg.device, threads_per_worker=threads,
                       timeout=max(60.0, cfg.timeout_s / 3)) as world:
        return train_distributed(w, world, grid=cfg.grid, record=cfg.record, budget_bytes=cfg.budget_bytes)


def run_spmd(cfg: RunConfig) -> dict:
    """``cfg.workers`` local SPMD ranks (``bigconv.runtime.spmd_launch``), each with its share of the cores."""
    from bigconv.harness.spmd_workload import train_spmd

    threads = max(1, (os.cpu_count() or 1) // cfg.workers)
    r = train_spmd(_workload(cfg), cfg.workers, grid=cfg.grid, replicas=cfg.replicas or 1, threads=threads,
                   device=cfg.device, timeout=0.95 * cfg.timeout_s, record=cfg.record,
                   budget_bytes=cfg.budget_bytes)
    per = r["per_rank"]
    return {"grid": r["grid"], "step_s": r["step_s"], "step_times_s": r["step_times_s"], "loss": per[0]["loss"],
            "budget": per[0].get("budget"), "per_worker": per}


def describe(cfg: RunConfig) -> dict:
    """The record's leading fields: what was run, where."""
    from bigconv.harness.workload import environment

    env = environment()
    spec = registry.spec(cfg.model)
    return {"kind": "run", "config": asdict(cfg), "model": cfg.model, "dims": spec.dims, "task": spec.task,
            "size": cfg.size, "input_elements": cfg.size ** spec.dims, "batch": cfg.batch, "workers": cfg.workers,
            "mode": "plain" if cfg.workers == 0 else (cfg.mode or "world"), "device": cfg.device,
            "budget_bytes": cfg.budget_bytes, "torch": env["torch"], "commit": env["commit"], "env": env,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


TaskRun = Callable[[RunConfig, Any], dict]
"""A run of one configuration whose model task this module does not run itself (``cfg``, a World or None)
-> the part of the record that ``run_plain`` returns."""


def run_here(cfg: RunConfig, world=None, tasks: Mapping[str, TaskRun] | None = None) -> dict:
    """Run ``cfg`` in this process (and its workers, or on ``world``); the full record, whatever happens.
    ``tasks``: the runs of the registry's tasks that live above the harness (``"dsn"``), by task."""
    record = describe(cfg)
    t0 = time.perf_counter()
    task = registry.spec(cfg.model).task
    try:
        if task in (tasks or {}):
            r = tasks[task](cfg, world)
        elif task == "dsn":
            raise ValueError("the DSN's run is multidsn's: run a dsn configuration through experiments.runs")
        else:
            r = run_plain(cfg) if cfg.workers == 0 else run_spmd(cfg) if cfg.mode == "spmd" else run_world(cfg, world)
    except Exception as exc:
        text = f"{type(exc).__name__}: {exc}"
        record.update(status=classify(text + repr(exc.__cause__)), message=text[-2000:],
                      traceback=traceback.format_exc()[-4000:])
    else:
        record.update(status="ok", message=None, grid=r["grid"], step_s=r["step_s"], step_times_s=r["step_times_s"],
                      loss=float(r["loss"]), budget=r.get("budget"), per_worker=r["per_worker"],
                      **_summary(r["per_worker"]))
        times = r["step_times_s"]
        record["images_per_s"] = cfg.batch * len(times) / sum(times) if times else None
    record["run_s"] = time.perf_counter() - t0
    return record


def run_fresh(cfg: RunConfig, extra_env: dict | None = None, entry: str = "bigconv.harness.runner") -> dict:
    """Run ``cfg`` in a new process (``python -m entry CONFIG``: this module's ``main``, or one that calls it
    with its ``tasks``); a record even if that process dies or runs out of time."""
    return fresh_process([entry, json.dumps(asdict(cfg))], cfg.timeout_s, describe(cfg), extra_env)


def fresh_process(module_args: list[str], timeout_s: float, base: dict, extra_env: dict | None = None) -> dict:
    """``python -m *module_args`` from the checkout, in a session of its own: the record it prints after
    ``MARK``, or an error record built on ``base`` if it dies or runs out of time (then the whole
    session, a driver and its workers, is killed)."""
    env = {**WORKER_ENV, **os.environ, **(extra_env or {})}
    cmd = [sys.executable, "-m", *module_args]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return {**base, "status": "error", "message": f"timed out after {timeout_s:g}s",
                "stderr_tail": err[-2000:], "run_s": time.perf_counter() - t0}
    for line in reversed(out.splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    if proc.returncode == -signal.SIGKILL:
        status, message = "oom", "the process was killed by SIGKILL (presumably the kernel's OOM killer)"
    else:
        status, message = classify(err), f"exit code {proc.returncode}: {err.strip()[-1000:]}"
    return {**base, "status": status, "message": message, "stderr_tail": err[-2000:],
            "run_s": time.perf_counter() - t0}


def main(tasks: Mapping[str, TaskRun] | None = None) -> None:
    cfg = RunConfig.from_dict(json.loads(sys.argv[1]))
    if cfg.device == "cpu":
        torch.set_num_threads(max(1, os.cpu_count() or 1))
    print(MARK + json.dumps(run_here(cfg, tasks=tasks)), flush=True)


if __name__ == "__main__":
    main()
