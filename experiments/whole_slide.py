"""Whole-slide demo: train on slides no worker reads whole, then predict a dense map into zarr.

    python -m experiments.whole_slide                       # 8 slides of 16,384^2, 4 workers
    python -m experiments.whole_slide --size 4096 --slides 4 --steps 2     # a quick look

Writes synthetic RGB slides (level 0 plus 2 reduced levels, tiled pyramidal TIFF) into OUT/slides
(kept for the next run; about 2.7 GB for the 8 default slides), labels each by whether its tissue
fraction is above the median, and trains
``bigconv.models.SlideCNN`` with slide-level labels on a local World of 4 CPU workers (grid 2x2),
a batch of 2 slides per step. Each worker reads only its quarter of each slide; the driver sends
paths and boxes. Then the trained stem predicts a dense feature map of one slide into a zarr array,
each worker writing its region, into OUT/prediction.zarr. Prints per-worker and driver peak memory
against the slide's size. At the defaults: about 5 minutes and about 10 GiB of memory across the
processes on 2 cores; both scale with the slide's area (``--size 4096``: about a sixteenth).
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch

import bigconv
from bigconv import progress
from bigconv.data import open_image, synthetic_slide
from bigconv.harness.workload import reset_worker_memory, worker_memory, worker_traffic
from bigconv.memory import PeakMeter
from bigconv.models import SlideCNN
from bigconv.harness import cli

log = logging.getLogger(__name__)
MiB = 2**20


def slides(folder: str, count: int, size: int) -> list[str]:
    os.makedirs(folder, exist_ok=True)
    paths = []
    for i in range(count):
        path = os.path.join(folder, f"synthetic_{size}_{i}.tif")
        if not os.path.exists(path):
            t0 = time.perf_counter()
            tmp = path + ".partial"
            synthetic_slide(tmp, size, levels=3, seed=i, tissue=0.2 + 0.4 * (i % 4) / 3)
            os.replace(tmp, path)
            log.info("wrote %s in %.1f s (%.0f MiB)", path, time.perf_counter() - t0, os.path.getsize(path) / MiB)
        paths.append(path)
    return paths


def tissue_fraction(path: str) -> float:
    """From the smallest level: the share of pixels darker than white glass."""
    low = open_image(path, level=2).read()
    return float((low.min(axis=0) < 220).mean())


def main(argv=None) -> None:
    parser = cli.parser("experiments.whole_slide", __doc__)
    parser.add_argument("--size", type=int, default=16384, help="slide edge at level 0 (a multiple of 2048)")
    parser.add_argument("--slides", type=int, default=8, help="synthetic slides to write and train on")
    parser.add_argument("--steps", type=int, default=3, help="training steps")
    parser.add_argument("--batch", type=int, default=2, help="slides per step")
    parser.add_argument("--workers", type=int, default=4, help="worker processes")
    parser.add_argument("--out", default="bigconv-demo",
                        help="folder for the slides (OUT/slides, reused by the next run) and the prediction")
    progress.add_arguments(parser)
    args = parser.parse_args(argv)
    progress.setup(args)
    area = (args.size / 16384) ** 2
    print(f"Writes {args.slides} synthetic slides of {args.size}^2 into {os.path.abspath(args.out)}/slides (about "
          f"{2.7 * area * args.slides / 8:.2g} GB, kept for the next run), trains {args.steps} steps on "
          f"{args.workers} workers and predicts one slide: about {max(1, round(5 * area))} min and "
          f"{max(1, round(10 * area))} GiB of memory across the processes on 2 cores", flush=True)
    paths = slides(os.path.join(args.out, "slides"), args.slides, args.size)
    fractions = [tissue_fraction(p) for p in paths]
    labels = torch.tensor([int(f > float(np.median(fractions))) for f in fractions])
    sources = [open_image(p, scale=1 / 255, fill=255) for p in paths]
    slide_bytes = 4 * int(np.prod(sources[0].shape))
    print(f"{len(paths)} slides of {args.size}x{args.size} RGB ({slide_bytes / MiB:.0f} MiB each as float32), "
          f"{args.workers} workers, batch {args.batch}")
    torch.manual_seed(0)
    model = SlideCNN()
    with bigconv.World(workers=args.workers) as world:
        net = bigconv.parallelize(model, world)
        net.optimizer(torch.optim.SGD, lr=0.05, momentum=0.9)
        reset_worker_memory(world)
        driver = PeakMeter()
        rng = np.random.default_rng(0)
        with progress.bars_and_logs(), progress.bar(args.steps, "training", args, unit="step") as pb:
            for step in range(args.steps):
                pick = rng.choice(len(sources), size=args.batch, replace=False)
                t0 = time.perf_counter()
                loss = net.train_step([sources[i] for i in pick], labels[pick], torch.nn.CrossEntropyLoss())
                pb.update(1)
                pb.set_postfix(loss=f"{loss:.4f}")
                log.info("step %d: loss %.4f (%.1f s)", step, loss, time.perf_counter() - t0)
        stem = SlideCNN()
        stem.load_state_dict(net.state_dict())
        # the convolutions alone: a dense feature map at 1/16 of the edge
        features = bigconv.parallelize(torch.nn.Sequential(*list(stem)[:6]), world)
        out = os.path.join(args.out, "prediction.zarr")
        t0 = time.perf_counter()
        features.predict([sources[0]], out=out, overwrite=True)
        print(f"prediction of {os.path.basename(paths[0])} -> {out} ({time.perf_counter() - t0:.1f} s)")
        peaks = worker_memory(world)
        stats = worker_traffic(world)
        mine = driver.read()["peak_rss_bytes"]
    for i, (m, s) in enumerate(zip(peaks, stats)):
        print(f"  worker{i}: peak {m['peak_rss_bytes'] / MiB:7.1f} MiB above idle; read {s['read_bytes'] / MiB:.0f} MiB "
              f"from the files in {s['read_s']:.1f} s")
    print(f"  driver:  peak {mine / MiB:7.1f} MiB above idle ({100 * mine / slide_bytes:.2f}% of one slide as "
          "float32)")


if __name__ == "__main__":
    main()
