"""An example of *your* training script for the SPMD templates: every rank runs it, and no rank drives.

    python experiments/cluster/train_spmd.py --grid 2x1 --local 2            # 2 local ranks, no launcher
    srun python experiments/cluster/train_spmd.py --grid 4x4                 # under spmd_slurm.sbatch (likewise
                                                                             # spmd_lsf.sh, spmd_torchrun.sh)

The two lines that matter are ``bigconv.World.from_env(mode="spmd")`` (it reads torchrun's, SLURM's or
jsrun's variables) and ``bigconv.parallelize(model, world, grid=..., replicas=...)``; ``prod(grid) x
replicas`` must be the number of ranks the launcher started. ``--slide`` trains on a whole slide that
every rank opens at the same path (each reads only its own region): on a cluster that path must be on a
filesystem every node mounts at the same place. Rank 0 appends one JSON line to ``--out``: the launcher,
the ranks, the grid and each step's loss and time.
"""

from __future__ import annotations

import json
import os
import time

import torch

import bigconv
from bigconv.harness import cli
from bigconv.models import CNN2D


def parse_grid(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.lower().split("x"))


def train(args) -> dict | None:
    from bigconv.runtime import launch_env

    torch.manual_seed(0)
    if args.slide:
        from bigconv.data import open_image

        source = open_image(args.slide, scale=1 / 255)
        x, channels = [source] * args.batch, source.shape[0]
    else:
        channels = 1
        x = torch.randn(args.batch, channels, args.size, args.size)  # every rank cuts its own shard
    y = torch.randint(0, 2, (args.batch,))
    launcher = launch_env.detect(min_size=1).launcher
    with bigconv.World.from_env(mode="spmd", device=args.device) as world:
        net = bigconv.parallelize(CNN2D(in_channels=channels, num_classes=2), world, grid=args.grid,
                                  replicas=args.replicas)
        net.optimizer(torch.optim.SGD, lr=0.01, momentum=0.9)
        steps = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            loss = net.train_step(x, y, torch.nn.CrossEntropyLoss())
            steps.append({"loss": float(loss), "step_s": time.perf_counter() - t0})
        record = {"launcher": launcher, "ranks": world.size, "grid": list(args.grid), "replicas": args.replicas,
                  "device": str(world.device), "steps": steps, "slide": args.slide}
        if world.rank == 0 and args.out:
            with open(args.out, "a") as fh:
                fh.write(json.dumps(record) + "\n")
        return record


def main(argv=None) -> None:
    p = cli.parser("experiments.cluster.train_spmd", __doc__)
    p.add_argument("--grid", type=parse_grid, required=True, help="shards per spatial dim, e.g. 4x4")
    p.add_argument("--replicas", type=int, default=1, help="data-parallel copies of the grid")
    p.add_argument("--size", type=int, default=256, help="edge of the random image (without --slide)")
    p.add_argument("--slide", default=None, help="a whole-slide file every rank opens at this same path")
    p.add_argument("--batch", type=int, default=None, help="images per step (default: as many as --replicas)")
    p.add_argument("--steps", type=int, default=2, help="training steps")
    p.add_argument("--device", default="auto", help="auto (a GPU per rank when there are enough), cuda or cpu")
    p.add_argument("--out", default=None, help="rank 0 appends a JSON line here")
    p.add_argument("--local", type=int, default=0, help="start this many local ranks (no launcher)")
    args = p.parse_args(argv)
    args.batch = args.batch or args.replicas
    launched = any(v in os.environ for v in ("RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"))
    if not (launched or args.local):
        p.error("run it under a launcher (the templates in experiments/cluster/) or with --local N")
    if args.local:
        from bigconv.runtime.spmd_launch import run

        print(run(train, args.local, (args,), timeout=600)[0])
    else:
        train(args)


if __name__ == "__main__":
    main()
