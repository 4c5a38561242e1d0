"""Writing a prediction as a pyramid: time and per-worker peak memory against the full-resolution level alone.

    python -m experiments.pyramid_write --size 4096 --workers 4 --out bigconv-pyramid

A synthetic slide of SIZE² (level 0), a dense 3-class model at full resolution, four writes of its
prediction on WORKERS workers (each after ``reset_peaks``): one float32 ``.zarr`` (the full-resolution
level alone, as ``predict`` wrote before issue 39), one uint8-probability ``.zarr``, an OME-Zarr pyramid of
uint8 probabilities with its label image (every level), and a pyramidal OME-TIFF of the probabilities.
Prints a markdown table: seconds, the largest worker peak above idle, the driver's peak, bytes on disk.
"""

from __future__ import annotations

import os
import shutil
import time

import torch
import torch.nn as nn

import bigconv
from bigconv.data import open_image, synthetic_slide
from bigconv.harness import cli
from bigconv.memory import PeakMeter

MiB = 2**20


def disk(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def main(argv=None) -> None:
    parser = cli.parser("experiments.pyramid_write", __doc__)
    parser.add_argument("--size", type=int, default=4096, help="slide edge (a multiple of 1024)")
    parser.add_argument("--workers", type=int, default=4, help="worker processes")
    parser.add_argument("--out", default="bigconv-pyramid", help="folder for the slide and the outputs")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    slide = os.path.join(args.out, "slide.tif")
    if not os.path.exists(slide):
        synthetic_slide(slide, args.size, levels=2)
    src = [open_image(slide, scale=1 / 255, fill=255)]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 3, 1))
    writes = [("full resolution, float32 .zarr", "float.zarr", {}),
              ("full resolution, uint8 probabilities .zarr", "prob.zarr", {"keep": "probabilities"}),
              ("OME-Zarr pyramid, uint8 probabilities + label image", "pred.ome.zarr",
               {"keep": ("probabilities", "labels")}),
              ("OME-TIFF pyramid, uint8 probabilities", "pred.ome.tif", {"keep": "probabilities"})]
    rows = []
    with bigconv.World(workers=args.workers) as world:
        net = bigconv.parallelize(model, world).eval()
        net.plan(src)
        for what, name, kw in writes:
            out = os.path.join(args.out, name)
            if os.path.exists(out):
                shutil.rmtree(out) if os.path.isdir(out) else os.unlink(out)
            world.reset_peaks()
            driver = PeakMeter()
            t0 = time.perf_counter()
            net.predict(src, out=out, **kw)
            seconds = time.perf_counter() - t0
            peak = max(m["peak_rss_bytes"] for m in world.memory())
            rows.append((what, seconds, peak, driver.read()["peak_rss_bytes"], disk(out)))
    print(f"slide {args.size}² RGB, {args.workers} workers, output 3 x {args.size}²\n")
    print("| write | s | largest worker peak (MiB) | driver peak (MiB) | on disk (MiB) |")
    print("|---|---|---|---|---|")
    for what, s, peak, drv, size in rows:
        print(f"| {what} | {s:.1f} | {peak / MiB:.0f} | {drv / MiB:.0f} | {size / MiB:.1f} |")


if __name__ == "__main__":
    main()
