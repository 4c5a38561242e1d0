"""Step time of a Lightning ``Trainer`` with ``BigconvStrategy`` against the native loop on the same model.

    python -m experiments.lightning_step                          # 2 ranks on (2, 1), 256², 5 rounds
    python -m experiments.lightning_step --ranks 4 --grid 2 2 --size 384 --rounds 7

Both loops run in one spawn of SPMD ranks (1 thread each), on the same model (a small classification CNN
with a replicated head), batches, AdamW and ``clip_grad_norm_``; the native loop is the one of
docs/loop.md (``net(x)``, ``net.whole_loss``, ``backward``, clip, step), the Lightning one is an unchanged
``LightningModule`` whose ``training_step`` logs the loss (unsynced: with one replica it is already the
global value, and the native loop reads it too). Each round runs both loops, in a fresh random order per
round, ``--steps`` timed steps after ``--warmup`` untimed ones, each step between two barriers on rank 0's
clock (Lightning: from ``on_train_batch_start`` to ``on_train_batch_end``, so the Trainer's setup is not
counted). Per loop: the median over rounds of the per-round median step and the best step of all; the
ratio Lightning / native (the median of the per-round ratios, and the ratio of the best steps); the host's
spread (the largest relative range of either loop's per-round figures): a ratio within the spread
is no measurable difference.

Appends one JSON line per round and one summary line to ``--out``; prints a markdown table.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time

import bigconv  # noqa: F401  (torchvision on a CPU torch before lightning)
import torch
import torch.nn as nn
import torch.nn.functional as F

from bigconv.harness import cli


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
                         nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 4))


def batches(size: int, n: int, batch: int = 2):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 3, size, size, generator=g), torch.randint(0, 4, (batch,), generator=g))
            for _ in range(n)]


def native(grid, data, steps: int, warmup: int) -> list[float]:
    import torch.distributed as dist

    with bigconv.World.from_env(mode="spmd", device="cpu", timeout=120.0) as world:
        net = bigconv.parallelize(build(), world, grid=grid)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        times = []
        for i, (x, y) in enumerate(data[: warmup + steps]):
            dist.barrier()
            t = time.perf_counter()
            out = net(x)
            loss = net.whole_loss(F.cross_entropy, out, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            float(loss.detach())
            dist.barrier()
            if i >= warmup:
                times.append(time.perf_counter() - t)
        return times


def lightning(grid, data, steps: int, warmup: int) -> list[float]:
    import lightning.pytorch as pl
    import torch.distributed as dist

    from bigconv.lightning import BigconvStrategy

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = build()

        def training_step(self, batch, index):
            x, y = batch
            loss = F.cross_entropy(self.model(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Clock(pl.Callback):
        def __init__(self):
            self.times, self.t = [], 0.0

        def on_train_batch_start(self, trainer, module, batch, index):
            dist.barrier()
            self.t = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, index):
            dist.barrier()
            if index >= warmup:
                self.times.append(time.perf_counter() - self.t)

    clock = Clock()
    xs = torch.cat([x for x, _ in data[: warmup + steps]])
    ys = torch.cat([y for _, y in data[: warmup + steps]])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=len(data[0][1]))
    world = int(os.environ["WORLD_SIZE"])
    trainer = pl.Trainer(strategy=BigconvStrategy(grid=grid, timeout=120.0), accelerator="cpu", devices=world,
                         max_epochs=1, gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[clock])
    trainer.fit(Lit(), loader)
    return clock.times


def rank_main(grid, size: int, steps: int, warmup: int, rounds: int, seed: int) -> list[dict]:
    torch.set_num_threads(1)
    data = batches(size, warmup + steps)
    order = random.Random(seed)
    port = int(os.environ["BIGCONV_PORT"])
    launched = dict(os.environ)  # Lightning's teardown deletes WORLD_SIZE, which the native loop's World reads
    records = []
    for r in range(rounds):
        loops = ["native", "lightning"]
        order.shuffle(loops)
        record = {"round": r, "order": loops}
        for name in loops:
            port += 10
            os.environ.clear()
            os.environ.update({**launched, "BIGCONV_PORT": str(port)})  # each world its own store port
            fn = native if name == "native" else lightning
            record[name] = fn(grid, data, steps, warmup)
        records.append(record)
    return records


def main(argv=None) -> None:
    from bigconv.runtime import spmd_launch as launch

    parser = cli.parser("experiments.lightning_step", __doc__)
    parser.add_argument("--ranks", type=int, default=2, help="local SPMD ranks")
    parser.add_argument("--grid", type=int, nargs="+", default=[2, 1], help="shards per spatial dim")
    parser.add_argument("--size", type=int, default=256, help="image edge (2 images per batch)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per loop and round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, each timing both loops in a seeded order")
    parser.add_argument("--seed", type=int, default=0, help="of the per-round order of the loops")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before the ranks are stopped")
    parser.add_argument("--out", default="results/lightning_step.jsonl", help="records file (appended)")
    args = parser.parse_args(argv)
    records = launch.run(rank_main, args.ranks, (tuple(args.grid), args.size, args.steps, args.warmup, args.rounds,
                                                 args.seed), timeout=args.timeout)[0]  # rank 0's clock
    med = statistics.median
    per_round = {k: [med(rec[k]) for rec in records] for k in ("native", "lightning")}
    ratios = [lt / nt for lt, nt in zip(per_round["lightning"], per_round["native"])]
    spread = max((max(v) - min(v)) / med(v) for v in per_round.values())
    best = {k: min(min(rec[k]) for rec in records) for k in ("native", "lightning")}
    summary = {"summary": True, "ranks": args.ranks, "grid": args.grid, "size": args.size, "steps": args.steps,
               "rounds": args.rounds, "native_s": med(per_round["native"]), "lightning_s": med(per_round["lightning"]),
               "ratio": med(ratios), "ratios": ratios, "spread": spread, "native_best_s": best["native"],
               "lightning_best_s": best["lightning"], "load": os.getloadavg()[0], "torch": torch.__version__}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "a") as fh:
        for rec in records:
            fh.write(json.dumps({**rec, "size": args.size, "grid": args.grid}) + "\n")
        fh.write(json.dumps(summary) + "\n")
    print("| loop | median step (s) | best step (s) | per-round medians (s) |\n|---|---|---|---|")
    for k in ("native", "lightning"):
        print(f"| {k} | {med(per_round[k]):.4f} | {best[k]:.4f} | {', '.join(f'{v:.4f}' for v in per_round[k])} |")
    print(f"\nLightning / native: {med(ratios):.3f} (per round: {', '.join(f'{v:.3f}' for v in ratios)}; best steps: "
          f"{best['lightning'] / best['native']:.3f}); host spread ±{spread / 2:.1%}; load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
