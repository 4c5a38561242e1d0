"""The target-only bound of the demo recipe's DSN benchmark: the same classifier trained on a target's own labels.
(The paper recipe has its own target_only row: ``python -m multidsn.train --methods target_only``.)

Domain-adaptation papers (DSN's Table 1 among them) report it next to source-only: how much of the gap a
perfect adaptation could close. Here it tells a target that cannot be read (a low bound) from one that
adaptation fails on (a high bound with a low DSN score).

    python -m experiments.dsn_target_only --shifts mnistm,noise

appends one line per shift to ``results/multidsn_target_only.jsonl``. The network, optimizer, batch size,
step count and standardisation are ``multidsn.train``'s defaults; the labels are the target's training split,
the accuracy its held-out test split.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from multidsn.data import Sampler, procedural_domains, standardized
from multidsn.evaluation import accuracy
from multidsn.model import DSN
from multidsn.train import model_config, task_only
from multidsn.train import parse_args as train_args
from multidsn.train_report import environment
from multidsn.trainer import LocalDSN
from bigconv.harness import cli


def target_only(shift: str, seed: int, steps: int) -> float:
    args = train_args(["--recipe", "demo", "--targets", "1", "--shifts", shift, "--seed", str(seed), "--steps", str(steps)])
    _, (target,) = procedural_domains(1, args.image_size, seed=seed, shifts=[shift])
    target = standardized(target)
    cfg = task_only(model_config(args), steps)
    torch.manual_seed(seed)
    model = LocalDSN(DSN(cfg))
    model.optimizer(torch.optim.Adam, lr=args.lr or 1e-3)  # multidsn.train's default optimizer
    sampler = Sampler(target, [target], args.batch_size, seed=seed)
    for _ in range(steps):
        model.train_step_terms(next(sampler))
    return accuracy(model, target, 1)


def main(argv: list[str] | None = None) -> list[dict]:
    p = cli.parser("experiments.dsn_target_only", __doc__.split("\n\n")[0])
    p.add_argument("--shifts", type=lambda s: s.split(","), default=["mnistm", "noise"],
                   help="comma-separated target domains to train on their own labels")
    p.add_argument("--seed", type=int, default=0, help="the seed")
    p.add_argument("--steps", type=int, default=3000, help="as multidsn.train's default")
    p.add_argument("--out", default="results/multidsn_target_only.jsonl",
                   help="results file the records are appended to")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    stamp, env = time.strftime("%Y-%m-%dT%H:%M:%S"), environment()
    records = []
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for shift in args.shifts:
        acc = target_only(shift, args.seed, args.steps)
        records.append({"time": stamp, "record": "target_only", "shift": shift, "seed": args.seed,
                        "steps": args.steps, "target_accuracy": acc, **env})
        with open(args.out, "a") as f:
            f.write(json.dumps(records[-1]) + "\n")
        print(f"{shift:<12} target-only {100 * acc:.1f}%")
    return records


if __name__ == "__main__":
    main()
