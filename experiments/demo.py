"""The demo: CNN2D trained on a local 4-worker World on CPU, against the plain single process.

    python -m experiments.demo [--size 512] [--steps 4] [--out ./bigconv-demo]

Prints the final loss of both runs, each worker's peak memory and halo traffic, and the plain run's
peak for comparison; writes the same as one JSON record into OUT/demo.json. About 30 s and well under
1 GiB of memory across its processes on 2 cores at the defaults.
"""

from __future__ import annotations

import json
import os

import bigconv
from bigconv.harness.workload import Workload, plain_in_fresh_process, train_distributed
from bigconv.harness import cli

MiB = 2**20


def main(argv=None) -> None:
    parser = cli.parser("experiments.demo", __doc__)
    parser.add_argument("--size", type=int, default=512, help="image edge in pixels")
    parser.add_argument("--steps", type=int, default=4, help="training steps after one warm-up step")
    parser.add_argument("--out", default="bigconv-demo", help="folder the demo's record (demo.json) is written into")
    args = parser.parse_args(argv)
    w = Workload(model="cnn2d", size=args.size, steps=args.steps)
    print(f"CNN2D, one {w.size}x{w.size} image, float32, {w.steps + 1} SGD steps on 4 CPU workers, grid (2, 2), "
          f"then the same in one plain process; about {max(30, round(30 * (w.size / 512) ** 2))} s on 2 cores")
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
    above = [m["peak_rss_bytes"] / MiB - single / 4 for m in r["per_worker"]]
    print(f"  each worker above the ideal: {min(above):.1f} to {max(above):.1f} MiB (its fixed cost: its own "
          "interpreter and torch, transport buffers)")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "demo.json")
    with open(path, "w") as fh:
        # steps: every SGD step each run took, the warm-up one included (the printed count)
        json.dump({"size": w.size, "steps": w.steps + 1, "warmup_steps": 1, "distributed": {k: v for k, v in r.items() if k != "net"},
                   "plain": plain}, fh, indent=1, default=str)
    print(f"wrote {os.path.abspath(path)}")


if __name__ == "__main__":
    main()
