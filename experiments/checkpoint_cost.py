"""What a checkpoint costs: ``net.save``/``net.load`` time and file size against ``torch.save`` of the plain
model and optimizer.

    python -m experiments.checkpoint_cost        # appends to results/checkpoint_cost.jsonl

For CNN2D and MONAI's UNet (the benchmark widths), after one SGD-momentum step on a 2048^2 float32
image on 2 workers (so the optimizer holds its momentum): the best of 3 saves and 3 loads, and the
same for ``torch.save``/``torch.load`` + ``load_state_dict`` of the plain model and optimizer in this
process. A checkpoint's cost is the model's size, not the image's: the file holds weights, optimizer
state and generator states only.
"""

from __future__ import annotations

import os
import tempfile
import time

import torch

import bigconv
from bigconv.harness import records, registry
from bigconv.harness.workload import environment
from bigconv.harness import cli

MiB = 2**20


def best_of(fn, reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(name: str, size: int, world: bigconv.World, folder: str) -> dict:
    spec = registry.spec(name)
    torch.manual_seed(0)
    model = spec.build(1, 2, 16, 3)
    net = bigconv.parallelize(model, world)
    net.optimizer(torch.optim.SGD, lr=0.01, momentum=0.9)
    net.train_step(torch.randn(1, 1, size, size), spec.target(1, size), torch.nn.CrossEntropyLoss())
    path = os.path.join(folder, f"{name}.pt")
    save_s = best_of(lambda: net.save(path))
    load_s = best_of(lambda: net.load(path))
    plain_opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ck = torch.load(path, weights_only=True)
    model.load_state_dict(ck["model"])
    plain_opt.load_state_dict(ck["optimizer"])
    plain_path = os.path.join(folder, f"{name}_plain.pt")
    plain_save_s = best_of(lambda: torch.save({"model": model.state_dict(), "optimizer": plain_opt.state_dict()},
                                              plain_path))

    def plain_load():
        state = torch.load(plain_path, weights_only=True)
        model.load_state_dict(state["model"])
        plain_opt.load_state_dict(state["optimizer"])

    plain_load_s = best_of(plain_load)
    return {"bench": "checkpoint_cost", "model": name, "size": size, "workers": world.workers,
            "parameters": sum(p.numel() for p in model.parameters()),
            "file_bytes": os.path.getsize(path), "save_s": save_s, "load_s": load_s,
            "plain_file_bytes": os.path.getsize(plain_path), "plain_save_s": plain_save_s,
            "plain_load_s": plain_load_s}


def main(argv=None) -> None:
    parser = cli.parser("experiments.checkpoint_cost", __doc__)
    parser.add_argument("--models", default="cnn2d,unet", help="comma-separated benchmark models")
    parser.add_argument("--size", type=int, default=2048, help="image edge")
    parser.add_argument("--workers", type=int, default=2, help="worker processes")
    parser.add_argument("--out", default="results/checkpoint_cost.jsonl",
                        help="results file the records are appended to")
    args = parser.parse_args(argv)
    env = environment()
    print("| model | parameters | file (KiB) | save (ms) | load (ms) | plain file (KiB) | plain save (ms) | "
          "plain load (ms) |\n|---|---|---|---|---|---|---|---|")
    with bigconv.World(workers=args.workers) as world, tempfile.TemporaryDirectory() as folder:
        for name in args.models.split(","):
            r = {**measure(name, args.size, world, folder), "env": env, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
            records.append(args.out, r)
            print(f"| {name} | {r['parameters']} | {r['file_bytes'] / 1024:.0f} | {1e3 * r['save_s']:.1f} | "
                  f"{1e3 * r['load_s']:.1f} | {r['plain_file_bytes'] / 1024:.0f} | {1e3 * r['plain_save_s']:.1f} | "
                  f"{1e3 * r['plain_load_s']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
