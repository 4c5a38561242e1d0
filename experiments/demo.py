"""The demo: CNN2D trained on a local 4-worker World on CPU, against the plain single process.

    python -m experiments.demo [--size 512] [--steps 4]

Prints the loss of each step, each worker's peak memory, and the plain run's peak for comparison.
"""

from __future__ import annotations

import argparse

import bigconv
from bigconv.harness.workload import Workload, plain_in_fresh_process, train_distributed

MiB = 2**20


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=512, help="image edge in pixels")
    parser.add_argument("--steps", type=int, default=4, help="training steps")
    args = parser.parse_args(argv)
    w = Workload(model="cnn2d", size=args.size, steps=args.steps)
    print(f"CNN2D, one {w.size}x{w.size} image, float32, {w.steps + 1} SGD steps on 4 CPU workers, grid (2, 2)")
    with bigconv.World(workers=4) as world:
        r = train_distributed(w, world, grid=(2, 2))
    plain = plain_in_fresh_process(w, threads=1)
    diff = abs(r["loss"] - plain["loss"]) / max(abs(plain["loss"]), 1e-30)
    print(f"final loss: distributed {r['loss']:.8g}, single process {plain['loss']:.8g} "
          f"(relative difference {diff:.1e})")
    for i, m in enumerate(r["per_worker"]):
        print(f"  worker{i}: peak {m['peak_rss_bytes'] / MiB:7.1f} MiB ({', '.join(m['sources'])}), "
              f"halo traffic {m['bytes'] / MiB:.1f} MiB in {m['messages']} messages")
    single = plain["peak_rss_bytes"] / MiB
    print(f"  single process: peak {single:7.1f} MiB; ideal per worker (single / 4): {single / 4:.1f} MiB")


if __name__ == "__main__":
    main()
