"""What 2 ranks can gain on this host at all: the bound behind the SPMD speedup figure.

    python -m experiments.host_bound            # CNN2D 2048², 1 thread per process, 3 rounds -> results/host_bound.jsonl

The 2-rank SPMD step (``bench_core --mode spmd``) fell short of 2x. Two things stand between a
shard's step and half the single-process step, and this script measures them apart, each in plain
PyTorch (no bigconv) with 1 thread per process:

- ``half_alone``: one process trains on half the image (the SPMD shard's box, without halos). Against
  ``full`` (one process, whole image), it says how far the compute itself halves.
- ``half_pair``: two processes train on the two halves at once, released together every step by a
  barrier. Against ``half_alone``, it is what running side by side costs: shared cores, caches and
  memory bandwidth. ``full / half_pair`` is the most any 2-process split can gain on this host.
- ``spmd``: the real 2-rank SPMD step on the same model and image. ``half_pair / spmd`` is the share
  of that bound the engine reaches (halos, slab convolutions, bucketed allreduce).

The phases are interleaved for ``--rounds`` rounds, because this host drifts by 10-20% over minutes:
each step figure is the median of the rounds' best steps, and the speedups are also given per round
(each phase against the same round's single process).
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch

from bigconv.harness.records import append
from bigconv.harness import cli


def _plain_steps(size: int, box: tuple[tuple[int, int], tuple[int, int]] | None, steps: int, world=None) -> list:
    """Best-effort plain training steps on the whole image or on ``box`` of it; each step starts at a
    barrier when ``world`` is given (the pair), so both processes compute at the same time."""
    from bigconv.harness.workload import Workload

    torch.set_num_threads(1)
    model, x, y = Workload(model="cnn2d", size=size).build()
    if box is not None:
        (r0, r1), (c0, c1) = box
        x = x[:, :, r0:r1, c0:c1].contiguous()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    times = []
    for step in range(steps + 1):
        if world is not None:
            world.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()
        if step:
            times.append(time.perf_counter() - t0)
    return times


def _rank(size: int, grid: tuple[int, int], steps: int, pair: bool) -> list:
    import bigconv
    from bigconv.geometry.boxes import all_coords, shard_box

    if not pair:
        box = None if grid == (1, 1) else shard_box((size, size), grid, (0, 0))
        return _plain_steps(size, box, steps)
    with bigconv.World.from_env(mode="spmd") as world:
        box = shard_box((size, size), grid, list(all_coords(grid))[world.rank])
        return _plain_steps(size, box, steps, world)


def main(argv=None) -> None:
    parser = cli.parser("experiments.host_bound", __doc__)
    parser.add_argument("--size", type=int, default=2048, help="image edge (CNN2D)")
    parser.add_argument("--steps", type=int, default=3, help="steps per phase and round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--out", default="results/host_bound.jsonl", help="results file the records are appended to")
    args = parser.parse_args(argv)
    from bigconv.harness.spmd_workload import train_spmd
    from bigconv.harness.workload import Workload, environment
    from bigconv.runtime import spmd_launch as launch

    w = Workload(model="cnn2d", size=args.size, steps=args.steps)
    best: dict[str, list[float]] = {"full": [], "half_alone": [], "half_pair": [], "spmd": []}
    grid = None
    for r in range(args.rounds):
        spmd = train_spmd(w, 2, threads=1, timeout=1800)
        grid = tuple(spmd["grid"])
        best["spmd"].append(spmd["step_s"])
        best["full"].append(min(launch.run(_rank, 1, (args.size, (1, 1), args.steps, False), timeout=1800)[0]))
        best["half_alone"].append(min(launch.run(_rank, 1, (args.size, grid, args.steps, False), timeout=1800)[0]))
        pair = launch.run(_rank, 2, (args.size, grid, args.steps, True), timeout=1800)
        best["half_pair"].append(min(max(a, b) for a, b in zip(*pair)))  # a step ends when both halves have
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in best.items()), flush=True)
    med = {k: statistics.median(v) for k, v in best.items()}
    record = {
        "bench": "host-bound", "model": "cnn2d", "size": args.size, "grid": list(grid), "threads_per_process": 1,
        "rounds": args.rounds, "steps": args.steps, "step_s": med, "step_s_per_round": best,
        "compute_halving": med["full"] / med["half_alone"],
        "side_by_side_cost": med["half_pair"] / med["half_alone"],
        "bound_speedup": med["full"] / med["half_pair"],
        "spmd_speedup": med["full"] / med["spmd"],
        "share_of_bound": med["half_pair"] / med["spmd"],
        # Paired within a round (the host drifts between rounds): the steadier reading of the speedups.
        "spmd_speedup_per_round": [f / s for f, s in zip(best["full"], best["spmd"])],
        "bound_speedup_per_round": [f / p for f, p in zip(best["full"], best["half_pair"])],
        "env": environment(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    append(args.out, record)
    print(json.dumps({k: v for k, v in record.items() if k != "env"}, indent=1))


if __name__ == "__main__":
    main()
