"""Step time on the workers with and without ``torch.compile`` (issue 22: a benchmark row, not a test).

    python -m experiments.bench_compile --size 128 --steps 5

One World of 2 workers, CNN2D (float32, batch 1); the same model parallelized plainly, with
``compile=True`` and as ``parallelize(torch.compile(model))``, interleaved for ``--rounds`` rounds;
the best step of each after a warm-up step (the first compiled step pays for compilation, reported
separately). Appends one JSON line per variant to ``--out``.

What runs compiled: each worker wraps its shard's forward in ``torch.compile``; bigconv's
``ShardMode`` rules (every torch call on a sharded tensor goes through them, halo exchanges
included) are excluded from tracing (``torch.compiler.disable``), so dynamo breaks the graph at each
such call and little of a plain conv net is left to compile: expect no speedup, only the cost of
the guards.
"""

from __future__ import annotations

import json
import time

import torch
import torch.nn as nn

import bigconv
from bigconv.models import CNN2D
from bigconv.harness import cli
from bigconv.harness.workload import environment


def main() -> None:
    ap = cli.parser("experiments.bench_compile", __doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=128, help="image side in pixels (CNN2D, batch 1, float32)")
    ap.add_argument("--steps", type=int, default=5, help="timed training steps per variant and round")
    ap.add_argument("--rounds", type=int, default=2, help="rounds over the three variants; the best step is kept")
    ap.add_argument("--workers", type=int, default=2, help="worker processes of the World")
    ap.add_argument("--out", default="results/bench_compile.jsonl", help="JSON-lines file the records are appended to")
    args = ap.parse_args()
    torch.manual_seed(0)
    x = torch.randn(1, 1, args.size, args.size)
    y = torch.tensor([1])
    loss_fn = nn.CrossEntropyLoss()
    best: dict[str, float] = {}
    first: dict[str, float] = {}
    with bigconv.World(workers=args.workers, threads_per_worker=1) as world:
        nets = {}
        for variant in ("eager", "compile=True", "torch.compile(model)"):
            model = CNN2D()
            if variant == "compile=True":
                net = bigconv.parallelize(model, world, grid=(args.workers, 1), compile=True)
            elif variant == "torch.compile(model)":
                net = bigconv.parallelize(torch.compile(model), world, grid=(args.workers, 1))
            else:
                net = bigconv.parallelize(model, world, grid=(args.workers, 1))
            net.optimizer(torch.optim.SGD, lr=0.01)
            t = time.perf_counter()
            net.train_step(x, y, loss_fn)
            first[variant] = time.perf_counter() - t
            nets[variant] = net
        for _ in range(args.rounds):
            for variant, net in nets.items():
                for _ in range(args.steps):
                    t = time.perf_counter()
                    net.train_step(x, y, loss_fn)
                    best[variant] = min(best.get(variant, float("inf")), time.perf_counter() - t)
    base = best["eager"]
    with open(args.out, "a") as f:
        for variant in best:
            row = {"experiment": "bench_compile", "variant": variant, "size": args.size, "workers": args.workers,
                   "best_step_s": best[variant], "first_step_s": first[variant], "vs_eager": best[variant] / base,
                   **environment()}
            f.write(json.dumps(row) + "\n")
            print(f"| {variant} | {args.workers} | {args.size}^2 | {best[variant] * 1e3:.1f} ms | "
                  f"{best[variant] / base:.2f}x | first step {first[variant]:.1f} s |")


if __name__ == "__main__":
    main()
