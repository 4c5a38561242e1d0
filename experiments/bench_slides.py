"""What reading slides on the workers saves: the driver's memory, and what reading costs the workers.

    python -m experiments.bench_slides                   # one 16,384^2 RGB slide, 4 workers
    python -m experiments.bench_slides --size 4096       # a quick look
    python -m experiments.bench_slides --compression jpeg --only sources,prefetch   # JPEG tiles
    python -m experiments.bench_slides --maxsize 1GiB    # the largest slide within 1 GiB per process

The same training (``bigconv.models.SlideCNN``, batch 1, SGD, grid 2x2, float32) in several ways,
each distributed one in a fresh World:

- ``single``: plain PyTorch in this process, the whole slide read into one tensor each step; the
  reference for the workers' peaks (single/(N·peak)); ``shard``: the same on one worker's box alone;
- ``sources``: the driver sends each worker a path and its box, and the worker reads it;
- ``prefetch``: sources whose next step's boxes the workers read while the current step trains
  (``net.prefetch``), with the pipeline filled by one untimed step, as a loader does;
- ``tensor``: the driver reads the whole slide into one float32 tensor and sends each worker its
  shard (the only way before ``bigconv.data``).

After one warm-up step, over ``--steps`` steps: the driver's and every worker's peak RSS above what
they held after the warm-up, the step time, and each worker's read throughput (MB/s of stored uint8)
and the share of the step it waited for its reads. The driver's first-step peak is taken from after
the libraries it runs are imported, torch's lazily imported meta kernels included
(``import_lazy_libraries``; their cost is recorded as ``driver_import_bytes``).
Targets: driver peak <= 2% of the slide's float32 size; with prefetching, reads <= 10% of a step.
Appends to ``results/bench_slides.jsonl``.
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np
import torch

import bigconv
from bigconv import memory
from bigconv.data import SourceBatch, open_image, synthetic_slide
from bigconv.engine.dry_run import dry_run, meta_copy
from bigconv.geometry.boxes import shard_box
from bigconv.harness import records
from bigconv.harness.workload import environment, reset_worker_memory, worker_memory, worker_traffic
from bigconv.memory import PeakMeter
from bigconv.models import SlideCNN
from bigconv.runtime.world import WORKER_ENV
from bigconv.harness import cli

MiB = 2**20


def import_lazy_libraries() -> int:
    """Plan the model on a 256^2 input first, and return the resident memory that took: library code.

    The dry run's meta kernels are partly Python, and torch imports them on first use: sympy,
    ``torch._refs``, ``torch._dynamo`` and ``torch.distributed.tensor`` among ~850 modules, 65-80 MiB,
    once per process and the same for a 256^2 input as for a slide. Like ``import torch``, which no
    baseline counts, that is not what the driver holds for a slide; the driver's peaks are taken from
    after it, and its cost is recorded beside them (``driver_import_bytes``)."""
    before = memory.rss_bytes() or 0
    dry_run(meta_copy(SlideCNN()), (2, 2), (1, 3, 256, 256), torch.float32, training=True)
    return (memory.rss_bytes() or 0) - before


def in_fresh_process(fn, *args):
    """``fn(*args)`` in a new process under the workers' allocator settings (``WORKER_ENV``), as
    ``plain_in_fresh_process`` runs its references: a peak above the baseline is then only the run's
    own (no freed memory left resident by an earlier run) and compares with the workers'."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    saved = dict(os.environ)
    os.environ.update(WORKER_ENV)  # a spawned process takes the environment of the moment it starts
    try:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            return pool.submit(fn, *args).result()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def run_single(source, steps: int, crop=None) -> dict:
    """The references the workers' peaks are judged against: plain PyTorch in this process, the whole
    slide (or, with ``crop``, one shard's box of it) read into one float32 tensor every step; its peak
    RSS above what it held after a warm-up step."""
    torch.manual_seed(0)
    model, y = SlideCNN(), torch.tensor([1])
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    views = [source.view(crop=crop), source.view(crop=crop, dihedral=2)]

    def step(view) -> None:
        x = SourceBatch([view]).read()
        opt.zero_grad(set_to_none=True)
        torch.nn.CrossEntropyLoss()(model(x), y).backward()
        opt.step()

    step(views[0])
    meter, times = PeakMeter(), []
    for i in range(steps):
        t0 = time.perf_counter()
        step(views[(i + 1) % 2])
        times.append(time.perf_counter() - t0)
    return {"kind": "single" if crop is None else "single_shard", "crop": crop,
            "single_peak_bytes": meter.read()["peak_rss_bytes"], "step_s": min(times),
            "step_median_s": statistics.median(times), "step_times_s": times}


def run(kind: str, source, steps: int, workers: int) -> dict:
    torch.manual_seed(0)
    y = torch.tensor([1])
    # Two views of the slide (as read, and turned by 180 degrees), alternating: a step never reuses the
    # reads of the one before, with or without prefetching.
    views = [[source.view()], [source.view(dihedral=2)]]
    imported = import_lazy_libraries()
    with bigconv.World(workers=workers) as world:
        net = bigconv.parallelize(SlideCNN(), world, grid=(2, 2))
        net.optimizer(torch.optim.SGD, lr=0.01, momentum=0.9)
        x = views[0] if kind != "tensor" else None
        driver = PeakMeter()
        if kind == "tensor":
            x = SourceBatch([source]).read()  # the driver holds the slide, as before bigconv.data
        net.train_step(x, y, torch.nn.CrossEntropyLoss())  # warm-up: plans, buffers, first reads
        first = driver.read()["peak_rss_bytes"]  # from before the input existed, through the first step
        reset_worker_memory(world)
        driver.reset()
        if kind == "prefetch":
            # Fill the pipeline, inside the memory peak (it holds a step's shard more) but outside the
            # timed steps: from here on every step's reads ran during the step before, as mid-epoch.
            net.prefetch(views[1])
            net.train_step(views[0], y, torch.nn.CrossEntropyLoss())
        before = worker_traffic(world)
        times = []
        for step in range(steps):
            if kind != "tensor":
                x = views[(step + 1) % 2]
            t0 = time.perf_counter()
            if kind == "prefetch":
                net.prefetch(views[step % 2])  # the next step's, read while this one trains
            net.train_step(x, y, torch.nn.CrossEntropyLoss())
            times.append(time.perf_counter() - t0)
        peaks = worker_memory(world)
        after = worker_traffic(world)
    stats = [{k: a[k] - b.get(k, 0) for k in a if isinstance(a[k], (int, float))} for a, b in zip(after, before)]
    busy = sum(times)
    return {"kind": kind, "driver_peak_bytes": max(first, driver.read()["peak_rss_bytes"]),
            "driver_import_bytes": imported,
            "driver_steady_peak_bytes": driver.read()["peak_rss_bytes"],
            "worker_peak_bytes": [p["peak_rss_bytes"] for p in peaks], "step_s": min(times),
            "step_median_s": statistics.median(times),
            "step_times_s": times,
            # a prefetched read's own duration; read_s is then only what the step still waited for it
            "read_mb_per_s": [s["read_bytes"] / 1e6 / (s["prefetch_read_s"] or s["read_s"])
                              if (s["prefetch_read_s"] or s["read_s"]) else None for s in stats],
            "read_share_of_steps": [s["read_s"] / busy for s in stats],
            "halo_bytes_per_step": [s["recv_bytes"] / steps for s in stats]}


def probe_peak(kind: str, source, workers: int) -> dict:
    """One training step after a warm-up step, ``kind`` as in ``run``; the largest peak of any process
    (the driver's, through its first step, included), which a per-process budget must hold."""
    r = run(kind, source, 1, workers)
    return {**r, "peak_bytes_max": max(r["driver_peak_bytes"], *r["worker_peak_bytes"]),
            "peak_process": "driver" if r["driver_peak_bytes"] >= max(r["worker_peak_bytes"]) else "worker"}


def largest_slide(kind: str, budget: int, workers: int, folder: str, out: str, *, start: int = 4096,
                  quantum: int = 256, tolerance: float = 0.03, max_probes: int = 8) -> dict:
    """The largest square RGB slide edge (a multiple of ``quantum``) whose training step keeps every
    process (driver and workers) within ``budget`` bytes of peak RSS above its warm baseline.

    As ``experiments.maxsize`` does on CPU: each probe measures the peaks, the next edge is predicted
    from them (peak ~ a + b * pixels), then bracketed and bisected to ``tolerance``. Probes are appended
    to ``out`` (``purpose: maxsize``) as they finish."""
    from experiments.maxsize import predict

    probes: dict[int, dict] = {}
    size = start
    for _ in range(max_probes):
        path = os.path.join(folder, f"maxsize_{size}.tif")
        if not os.path.exists(path):  # level 0 only, 256-pixel tiles: any multiple of 256 is a slide
            synthetic_slide(path + ".partial", size, levels=1, tile=quantum, seed=1, tissue=0.5)
            os.replace(path + ".partial", path)
        r = probe_peak(kind, open_image(path, scale=1 / 255), workers)
        r.update(status="ok", size=size, fits=r["peak_bytes_max"] <= budget)
        probes[size] = r
        records.append(out, {"bench": "slides", "purpose": "maxsize", "kind": kind, "size": size,
                             "budget_bytes": budget, "workers": workers, "fits": r["fits"],
                             "peak_bytes_max": r["peak_bytes_max"], "peak_process": r["peak_process"],
                             "driver_peak_bytes": r["driver_peak_bytes"], "worker_peak_bytes": r["worker_peak_bytes"],
                             "step_s": r["step_s"], "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
        print(f"  {kind} {size}^2: peak {r['peak_bytes_max'] / MiB:.0f} MiB ({r['peak_process']}) -> "
              f"{'fits' if r['fits'] else 'does not fit'}", flush=True)
        lo = max((s for s, p in probes.items() if p["fits"]), default=None)
        hi = min((s for s, p in probes.items() if not p["fits"]), default=None)
        step = max(quantum, int(tolerance * (lo or size)))
        if lo is not None and hi is not None and hi - lo <= step:
            break
        guess = predict(probes, budget, 2)
        if lo is not None and hi is not None:
            nxt = guess if guess is not None and lo + step <= guess <= hi - step else (lo + hi) / 2
        elif lo is not None:
            nxt = max(guess or 2 * lo, lo + step)
        else:
            nxt = min(guess or hi / 2, hi * 0.7)
        size = max(quantum, int(nxt) // quantum * quantum)
        if size in probes:
            break
    lo = max((s for s, p in probes.items() if p["fits"]), default=None)
    hi = min((s for s, p in probes.items() if not p["fits"]), default=None)
    return {"bench": "slides", "kind": "slide_maxsize", "input": kind, "budget_bytes": budget, "workers": workers,
            "max_size": lo, "first_failing_size": hi, "judged_by": "measured_peak_rss",
            "peak_bytes_at_max": probes[lo]["peak_bytes_max"] if lo else None,
            "probes": [{"size": s, "peak_bytes_max": p["peak_bytes_max"], "peak_process": p["peak_process"],
                        "fits": p["fits"]} for s, p in sorted(probes.items())],
            "env": environment(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def main_maxsize(args) -> None:
    from experiments.sweep import parse_amount

    budget = parse_amount(args.maxsize)
    print(f"largest RGB slide that trains (SlideCNN, grid (2, 2), {args.workers} workers) with every process "
          f"within {budget / MiB:.0f} MiB\n")
    found = {}
    for kind in args.only.split(","):
        if kind == "prefetch":
            continue  # the same memory as sources, one read ahead
        found[kind] = largest_slide(kind, budget, args.workers, args.folder, args.out)
        records.append(args.out, found[kind])
    print("\n| input | largest edge | pixels | limited by |\n|---|---|---|---|")
    for kind, r in found.items():
        at = next((p for p in r["probes"] if p["size"] == r["max_size"]), None)
        print(f"| {kind} | {r['max_size']} | {(r['max_size'] or 0) ** 2 / 1e6:.0f} M | "
              f"{at['peak_process'] if at else '-'} |")


def main(argv=None) -> None:
    parser = cli.parser("experiments.bench_slides", __doc__)
    parser.add_argument("--size", type=int, default=16384, help="slide edge at level 0")
    parser.add_argument("--steps", type=int, default=2, help="measured steps after the warm-up")
    parser.add_argument("--compression", default="zlib", choices=("zlib", "jpeg"),
                        help="how the slide's tiles are stored (jpeg: tifffile's default quality, YCbCr)")
    parser.add_argument("--workers", type=int, default=4, help="worker processes")
    parser.add_argument("--folder", default=os.path.join(os.path.expanduser("~"), ".cache", "bigconv_slides"),
                        help="where the synthetic slides are written (reused when present; about 2.7 GB at 16,384 px)")
    parser.add_argument("--out", default="results/bench_slides.jsonl", help="results file the records are appended to")
    parser.add_argument("--only", default="single,shard,sources,prefetch,tensor",
                        help="which runs: single is plain PyTorch in one process (the reference for the "
                             "workers' peaks); the tensor path needs the slide ~3x over on the driver "
                             "(16,384^2: ~9 GiB)")
    parser.add_argument("--maxsize", metavar="BUDGET", default=None,
                        help="instead: the largest slide each input trains with every process within BUDGET "
                             "(e.g. 1GiB), sources against the tensor held by the driver")
    args = parser.parse_args(argv)
    os.makedirs(args.folder, exist_ok=True)
    if args.maxsize:
        return main_maxsize(args)
    suffix = "" if args.compression == "zlib" else f"_{args.compression}"
    path = os.path.join(args.folder, f"bench_{args.size}{suffix}.tif")
    if not os.path.exists(path):
        synthetic_slide(path + ".partial", args.size, levels=3, seed=1, tissue=0.5, compression=args.compression)
        os.replace(path + ".partial", path)
    source = open_image(path, scale=1 / 255)
    slide = 4 * int(np.prod(source.shape))
    env = environment()
    print(f"one {args.size}x{args.size} RGB slide of {args.compression} tiles ({slide / MiB:.0f} MiB as float32), "
          f"{args.workers} workers, "
          f"grid (2, 2), {args.steps} steps after a warm-up\n")
    print("| input | driver peak (MiB) | share of the slide | driver after warm-up (MiB) | lazy imports (MiB) | "
          "worker peak (MiB, max) | step (s, median) | read MB/s per worker | read share of step |\n"
          "|---|---|---|---|---|---|---|---|---|")
    single = shard = None
    for kind in args.only.split(","):
        if kind == "single":
            measured = in_fresh_process(run_single, source, args.steps)
        elif kind == "shard":  # one worker's box of the 2x2 grid, alone: what plain PyTorch needs for it
            measured = in_fresh_process(run_single, source, args.steps, shard_box(source.spatial, (2, 2), (0, 0)))
        else:
            measured = run(kind, source, args.steps, args.workers)
        r = {**measured, "size": args.size, "compression": args.compression, "slide_float32_bytes": slide,
             "workers": args.workers, "env": env, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        records.append(args.out, {"bench": "slides", **r})
        if kind in ("single", "shard"):
            if kind == "single":
                single = r["single_peak_bytes"]
            else:
                shard = r["single_peak_bytes"]
            print(f"| plain PyTorch, {'whole slide' if kind == 'single' else 'one shard alone'} | - | - | - | - | "
                  f"{r['single_peak_bytes'] / MiB:.0f} (the process) | {r['step_median_s']:.2f} | - | - |", flush=True)
            continue
        rates = [v for v in r["read_mb_per_s"] if v]
        rate = f"{min(rates):.0f}-{max(rates):.0f}" if rates else "-"
        share = f"{max(r['read_share_of_steps']):.2f}" if rates else "-"
        peak = max(r["worker_peak_bytes"])
        per_single = f" (single/(N·peak) {single / args.workers / peak:.2f})" if single else ""
        per_single += f" (shard alone/peak {shard / peak:.2f})" if shard else ""
        print(f"| {kind} | {r['driver_peak_bytes'] / MiB:.1f} | {100 * r['driver_peak_bytes'] / slide:.2f}% | "
              f"{r['driver_steady_peak_bytes'] / MiB:.1f} | {r['driver_import_bytes'] / MiB:.1f} | "
              f"{max(r['worker_peak_bytes']) / MiB:.0f}{per_single} | "
              f"{r['step_median_s']:.2f} | {rate} | {share} |", flush=True)

if __name__ == "__main__":
    main()
