"""What reading slides on the workers saves: the driver's memory, and what reading costs the workers.

    python -m experiments.bench_slides                   # one 16,384^2 RGB slide, 4 workers
    python -m experiments.bench_slides --size 4096       # a quick look

The same training (``bigconv.models.SlideCNN``, batch 1, SGD, grid 2x2, float32) in two ways, each
in a fresh World: ``sources``, where the driver sends each worker a path and its box, and
``tensor``, where the driver reads the whole slide into one float32 tensor and sends each worker its
shard (the only way before ``bigconv.data``); and ``prefetch``, sources whose next step's boxes the
workers read while the current step trains (``net.prefetch``). After one warm-up step, over ``--steps`` steps: the
driver's and every worker's peak RSS above what they held after the warm-up, the step time, and each
worker's read throughput (MB/s of stored uint8) and the share of the step it waited for its reads.
Target: driver peak <= 2% of the slide's float32 size. Appends to ``results/bench_slides.jsonl``.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

import bigconv
from bigconv import worker
from bigconv.data import SourceBatch, open_image, synthetic_slide
from bigconv.harness import records
from bigconv.harness.workload import environment
from bigconv.memory import PeakMeter
from bigconv.models import SlideCNN

MiB = 2**20


def run(kind: str, source, steps: int, workers: int) -> dict:
    torch.manual_seed(0)
    y = torch.tensor([1])
    # Two views of the slide (as read, and turned by 180 degrees), alternating: a step never reuses the
    # reads of the one before, with or without prefetching.
    views = [[source.view()], [source.view(dihedral=2)]]
    with bigconv.World(workers=workers) as world:
        net = bigconv.parallelize(SlideCNN(), world, grid=(2, 2))
        net.optimizer(torch.optim.SGD, lr=0.01, momentum=0.9)
        x = views[0] if kind != "tensor" else None
        driver = PeakMeter()
        if kind == "tensor":
            x = SourceBatch([source]).read()  # the driver holds the slide, as before bigconv.data
        net.train_step(x, y, torch.nn.CrossEntropyLoss())  # warm-up: plans, buffers, first reads
        first = driver.read()["peak_rss_bytes"]  # from before the input existed, through the first step
        world.call(worker.reset_memory, [()] * world.workers, "resetting memory peaks")
        driver.reset()
        times = []
        if kind == "prefetch":
            net.prefetch(views[1])
        for step in range(steps):
            if kind != "tensor":
                x = views[(step + 1) % 2]
            t0 = time.perf_counter()
            if kind == "prefetch":
                net.prefetch(views[step % 2])  # the next step's, read while this one trains
            net.train_step(x, y, torch.nn.CrossEntropyLoss())
            times.append(time.perf_counter() - t0)
        peaks = world.call(worker.memory, [()] * world.workers, "reading memory")
        stats = world.call(worker.transport_stats, [()] * world.workers, "reading traffic")
    busy = sum(times)
    return {"kind": kind, "driver_peak_bytes": max(first, driver.read()["peak_rss_bytes"]),
            "driver_steady_peak_bytes": driver.read()["peak_rss_bytes"],
            "worker_peak_bytes": [p["peak_rss_bytes"] for p in peaks], "step_s": min(times),
            "step_times_s": times,
            # a prefetched read's own duration; read_s is then only what the step still waited for it
            "read_mb_per_s": [s["read_bytes"] / 1e6 / (s["prefetch_read_s"] or s["read_s"])
                              if (s["prefetch_read_s"] or s["read_s"]) else None for s in stats],
            "read_share_of_steps": [s["read_s"] / busy for s in stats],
            "halo_bytes_per_step": [s["recv_bytes"] / steps for s in stats]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--folder", default=os.path.join(os.path.expanduser("~"), ".cache", "bigconv_slides"))
    parser.add_argument("--out", default="results/bench_slides.jsonl")
    parser.add_argument("--only", default="sources,prefetch,tensor",
                        help="which inputs: the tensor path needs the slide ~3x over on the driver (16,384^2: ~9 GiB)")
    args = parser.parse_args(argv)
    os.makedirs(args.folder, exist_ok=True)
    path = os.path.join(args.folder, f"bench_{args.size}.tif")
    if not os.path.exists(path):
        synthetic_slide(path + ".partial", args.size, levels=3, seed=1, tissue=0.5)
        os.replace(path + ".partial", path)
    source = open_image(path, scale=1 / 255)
    slide = 4 * int(np.prod(source.shape))
    env = environment()
    print(f"one {args.size}x{args.size} RGB slide ({slide / MiB:.0f} MiB as float32), {args.workers} workers, "
          f"grid (2, 2), {args.steps} steps after a warm-up\n")
    print("| input | driver peak (MiB) | share of the slide | driver after warm-up (MiB) | worker peak (MiB, max) | step (s) | read MB/s per "
          "worker | read share of step |\n|---|---|---|---|---|---|---|---|")
    for kind in args.only.split(","):
        r = {**run(kind, source, args.steps, args.workers), "size": args.size, "slide_float32_bytes": slide,
             "workers": args.workers, "env": env, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        records.append(args.out, {"bench": "slides", **r})
        rates = [v for v in r["read_mb_per_s"] if v]
        rate = f"{min(rates):.0f}-{max(rates):.0f}" if rates else "-"
        share = f"{max(r['read_share_of_steps']):.2f}" if rates else "-"
        print(f"| {kind} | {r['driver_peak_bytes'] / MiB:.1f} | {100 * r['driver_peak_bytes'] / slide:.2f}% | "
              f"{r['driver_steady_peak_bytes'] / MiB:.1f} | {max(r['worker_peak_bytes']) / MiB:.0f} | "
              f"{r['step_s']:.2f} | {rate} | {share} |", flush=True)


if __name__ == "__main__":
    main()
