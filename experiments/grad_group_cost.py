"""Which costs less for one order of communication on every rank: the gradient sums on a process group
of their own (overlapping backward), or on the halos' group but started only after backward (its halo
traffic) ends? Two local SPMD ranks on gloo, CNN2D on a (2, 1) grid, median step time over a few steps,
and the time ``new_group`` takes at startup.

    python -m experiments.grad_group_cost [--size 256] [--steps 6]
"""

from __future__ import annotations

from bigconv.harness import cli
import statistics
import time

import torch
import torch.nn as nn


def _rank(variant: str, size: int, steps: int) -> dict:
    import torch.distributed as dist

    import bigconv
    from bigconv.engine import buckets
    from bigconv.models import CNN2D

    torch.set_num_threads(1)
    buckets.BUCKET_BYTES = 64 * 1024  # several buckets, as a real model has
    start = time.perf_counter()
    world = bigconv.World.from_env(mode="spmd", device="cpu", timeout=120)
    made = time.perf_counter()
    with world:
        group_s = 0.0
        if variant == "deferred":
            world.grad_group = None  # the halos' (default) group ...
            buckets.GradBuckets._ready = lambda self, p: None  # ... and every bucket started in finish()
        else:
            t = time.perf_counter()
            world.grad_group = dist.new_group(list(range(world.size)))
            dist.all_reduce(torch.zeros(1), group=world.grad_group)
            group_s = time.perf_counter() - t
        torch.manual_seed(0)
        net = bigconv.parallelize(CNN2D(in_channels=1, num_classes=3, width=32), world, grid=(2, 1))
        net.optimizer(torch.optim.SGD, lr=0.01)
        x, y = torch.randn(2, 1, size, size), torch.tensor([0, 1])
        times = []
        for _ in range(steps):
            dist.barrier()
            t = time.perf_counter()
            net.train_step(x, y, nn.CrossEntropyLoss())
            times.append(time.perf_counter() - t)
        return {"step_s": statistics.median(times[1:]), "group_s": group_s, "world_s": made - start}


def main(argv=None) -> None:
    from bigconv.runtime import spmd_launch

    p = cli.parser("experiments.grad_group_cost", __doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=256, help="image side in pixels")
    p.add_argument("--steps", type=int, default=6, help="steps per variant (the first is a warm-up)")
    args = p.parse_args(argv)
    for variant in ("own_group", "deferred"):
        r = spmd_launch.run(_rank, 2, (variant, args.size, args.steps), timeout=600)
        print(f"{variant:10s} step {max(x['step_s'] for x in r) * 1e3:8.1f} ms   "
              f"new_group {max(x['group_s'] for x in r) * 1e3:6.1f} ms")


if __name__ == "__main__":
    main()
