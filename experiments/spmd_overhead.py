"""The SPMD mode's own cost on one rank, measured interleaved with plain PyTorch in one process.

    python -m experiments.spmd_overhead            # CNN2D 2048², 1 thread, 6 rounds -> results/spmd_overhead.jsonl

Separate processes on a shared 2-core host drift by ±10% from run to run (``bench_core`` measures
each configuration in its own processes, minutes apart). Here one process alternates a plain step
and a 1-rank SPMD step (same model, same batch), so both see the same host state; the ratio of the
medians is the overhead of the mode itself: the shard mode's dispatch, the dry run's cached plan,
gradient buckets (a 1-rank world exchanges no halos).
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import time

import torch
from bigconv.harness import cli


def main(argv=None) -> None:
    parser = cli.parser("experiments.spmd_overhead", __doc__)
    parser.add_argument("--size", type=int, default=2048, help="image edge (CNN2D)")
    parser.add_argument("--rounds", type=int, default=6, help="alternating plain and 1-rank rounds")
    parser.add_argument("--out", default="results/spmd_overhead.jsonl", help="results file the records are appended to")
    args = parser.parse_args(argv)
    from bigconv.runtime import spmd_launch as launch

    print(json.dumps(launch.run(_rank, 1, (args.size, args.rounds, args.out), timeout=1800)[0]))


def _rank(size: int, rounds: int, out: str) -> dict:
    import bigconv
    from bigconv.harness.workload import Workload, environment

    torch.set_num_threads(1)
    w = Workload(model="cnn2d", size=size, steps=rounds)
    model, x, y = w.build()
    plain = copy.deepcopy(model)
    opt = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    plain_s, spmd_s = [], []
    with bigconv.World.from_env(mode="spmd") as world:
        net = bigconv.parallelize(model, world, grid=(1, 1))
        net.optimizer(torch.optim.SGD, lr=0.01, momentum=0.9)
        for i in range(rounds + 1):
            t = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss_fn(plain(x), y).backward()
            opt.step()
            t_plain = time.perf_counter() - t
            t = time.perf_counter()
            net.train_step(x, y, loss_fn)
            t_spmd = time.perf_counter() - t
            if i:  # the first round warms both up
                plain_s.append(t_plain)
                spmd_s.append(t_spmd)
    record = {"bench": "spmd_overhead", "workload": {"model": "cnn2d", "size": size, "threads": 1},
              "plain_step_s": plain_s, "spmd_1rank_step_s": spmd_s,
              "overhead_median": statistics.median(spmd_s) / statistics.median(plain_s),
              "env": environment(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "a") as fh:
        fh.write(json.dumps(record) + "\n")
    return {k: record[k] for k in ("plain_step_s", "spmd_1rank_step_s", "overhead_median")}


if __name__ == "__main__":
    main()
