"""What each rank runs for ``tests/test_lightning.py``: a Lightning ``Trainer`` with ``BigconvStrategy``.

An unchanged LightningModule (AdamW with two param groups, a warmup-cosine schedule stepped per step,
``gradient_clip_val``, ``accumulate_grad_batches=2``, ``self.log(..., sync_dist=True)``) on spawned gloo
ranks; each rank also runs the same loop in one process on the batches every replica's sampler drew (and
twice more with only sums reordered, the noise the verdict measures: ``tests/loop_verdict.py``), and returns
the per-tensor errors and ``bigconv.verify``'s verdict of its weights.
"""

from __future__ import annotations

import bigconv  # noqa: F401  (torchvision on a CPU torch before lightning, in an environment installed earlier)
import torch
import torch.nn.functional as F

import native_loop_cases as nl
from loop_verdict import state_reference, state_verdict

STEPS, ACCUMULATE, BATCH = 3, 2, 2


def make_module(kind: str):
    import lightning.pytorch as pl

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = nl.build(kind, torch.float64)
            self.logged = []

        def training_step(self, batch, index):
            x, y = batch
            loss = F.cross_entropy(self.model(x), y)
            self.log("loss", loss, sync_dist=True)
            self.logged.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(nl.param_groups(self.model.named_parameters()), lr=0.02, betas=(0.9, 0.99))
            sched = torch.optim.lr_scheduler.LambdaLR(opt, nl.warmup_cosine)
            return [opt], [{"scheduler": sched, "interval": "step"}]

    return Lit()


def dataset(kind: str, replicas: int):
    g = torch.Generator().manual_seed(5)
    n = STEPS * ACCUMULATE * BATCH * replicas
    x = torch.randn(n, 2, 12, 10, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (n, 12, 10) if kind == "seg" else (n,), generator=g)
    return torch.utils.data.TensorDataset(x, y)


def one_process(kind: str, replicas: int, reverse: bool = False, channels_last: bool = False,
                own_order: bool = False) -> dict:
    """The same loop on the same batches: micro-batch k of every replica's sampler (Lightning's
    ``DistributedSampler``: shuffled with seed 0, over ``replicas`` only), averaged over replicas as DDP does;
    ``own_order``: the loader's own order (``shuffle=False``), as ``Trainer(devices=1)`` runs it.
    ``reverse``, ``channels_last``: the verdict's noise runs (``tests/loop_verdict.py``)."""
    data = dataset(kind, replicas)
    model = nl.build(kind, torch.float64)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(memory_format=layout)
    opt = torch.optim.AdamW(nl.param_groups(model.named_parameters()), lr=0.02, betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, nl.warmup_cosine)
    per_replica = [list(range(len(data)))] if own_order else [
        list(torch.utils.data.DistributedSampler(data, num_replicas=replicas, rank=r, shuffle=True, seed=0))
        for r in range(replicas)]
    for step in range(STEPS):
        for k in range(ACCUMULATE):
            b = step * ACCUMULATE + k
            idx = [i for r in range(replicas) for i in per_replica[r][b * BATCH:(b + 1) * BATCH]]
            x, y = data[idx[::-1] if reverse else idx]
            (F.cross_entropy(model(x.contiguous(memory_format=layout)), y) / ACCUMULATE).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
        sched.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(kind: str, grid, replicas: int, plant: str | None = None) -> dict:
    import lightning.pytorch as pl

    from bigconv.lightning import BigconvStrategy

    lit = make_module(kind)
    cls = BigconvStrategy
    if plant == "no_replica_average":  # the replicas' gradients summed, not averaged as DDP does
        class NoAverage(BigconvStrategy):
            def backward(self, loss, optimizer, *args, **kwargs):
                return pl.strategies.DDPStrategy.backward(self, loss, optimizer, *args, **kwargs)
        cls = NoAverage
    elif plant == "whole_batch_sampler":  # every rank draws its own part of the data, as under DDP
        class EveryRank(BigconvStrategy):
            @property
            def distributed_sampler_kwargs(self):
                return {"num_replicas": self.world_size, "rank": self.global_rank}
        cls = EveryRank
    strategy = cls(grid=grid, replicas=replicas, timeout=30.0)
    # own_order*: the user's sampler kept on every rank (use_distributed_sampler=False): one process's order
    own = plant is not None and plant.startswith("own_order")
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=4, max_steps=STEPS,
                         accumulate_grad_batches=ACCUMULATE, gradient_clip_val=0.05, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=not (own or plant == "unseeded_shuffle"))
    loader = torch.utils.data.DataLoader(dataset(kind, replicas), batch_size=BATCH,
                                         shuffle=plant == "unseeded_shuffle")
    if plant == "unseeded_shuffle":  # each rank would draw its own order: refused before any step
        try:
            trainer.fit(lit, loader)
        except ValueError as exc:
            return {"refused": str(exc), "steps": trainer.global_step}
        return {"refused": None, "steps": trainer.global_step}
    trainer.fit(lit, loader)
    state = {k: v.detach().clone() for k, v in lit.model.state_dict().items()}
    keys = sorted(lit.state_dict())
    r = {"keys": keys, "logged": lit.logged, "callback_loss": float(trainer.callback_metrics["loss"])}
    # own_order_vs_sampler (a planted error): the own-order run judged against the sampler's order
    ref = state_reference(lambda **reorder: one_process(kind, replicas, own_order=plant == "own_order", **reorder))
    r["errors"] = {k: nl.rel(state[k], v) for k, v in ref.run.state.items()}
    r["verdict"] = state_verdict(state, ref)  # the weights judged as every equivalence test judges them
    return r


CASES = {"(2,2)/cls": ("cls", (2, 2), 1, None), "R2x(2,1)/seg": ("seg", (2, 1), 2, None),
         "R2x(2,1)/cls": ("cls", (2, 1), 2, None),
         "own_order/(2,2)/cls": ("cls", (2, 2), 1, "own_order"),
         "plant/own_order_vs_sampler": ("cls", (2, 2), 1, "own_order_vs_sampler"),
         "refused/unseeded_shuffle": ("cls", (2, 2), 1, "unseeded_shuffle"),
         "plant/no_replica_average": ("cls", (2, 1), 2, "no_replica_average"),
         "plant/whole_batch_sampler": ("cls", (2, 1), 2, "whole_batch_sampler")}


EXTRA = {"resume/R2x(2,1)/cls": ("resume", "cls", (2, 1), 2, None),
         "resume/(2,2)/seg": ("resume", "seg", (2, 2), 1, None),
         "resume_plant/drop_scheduler": ("resume", "cls", (2, 1), 2, "drop_scheduler"),
         "bf16/(2,2)/cls": ("precision", "cls", (2, 2), 1, "bf16-mixed"),
         "bf16/R2x(2,1)/seg": ("precision", "seg", (2, 1), 2, "bf16-mixed"),
         "fp16/R2x(2,1)/seg": ("precision", "seg", (2, 1), 2, "16-mixed"),
         "metrics/R2x(2,1)/cls": ("metrics", "cls", (2, 1), 2, None),
         "metrics_plant/local": ("metrics", "cls", (2, 1), 2, "local")}
"""``tests/lightning_extra_cases.py``'s runs: name -> (function, kind, grid, replicas, its argument)."""
ZOO = ("resume/(2,2)/seg", "resume_plant/drop_scheduler", "bf16/R2x(2,1)/seg", "metrics_plant/local")
"""Run under ``-m zoo`` only (each Trainer costs seconds on 2 cores): the second layout of a habit, and the
planted errors that show the resume's and the metrics' checks can fail."""


def run_all(names: tuple[str, ...] = tuple(CASES) + tuple(n for n in EXTRA if n not in ZOO)) -> dict:
    """The runs of ``CASES`` and ``EXTRA`` named in ``names`` (the session's selection), in one SPMD spawn."""
    import itertools
    import os
    import traceback

    import lightning_extra_cases as more

    unknown = [n for n in names if n not in CASES and n not in EXTRA]
    if unknown:
        raise ValueError(f"no Lightning run named {unknown}")
    torch.set_num_threads(1)
    results = {}
    port = int(os.environ["BIGCONV_PORT"])
    os.environ["BIGCONV_BASE_PORT"] = str(port)
    # Each Trainer's world its own store port, the same sequence on every rank, below Linux's ephemeral range
    # (32768-60999): counted up from the free base port it had collided with the gloo connections' own client
    # ports ("cannot listen on 127.0.0.1:36047 (Address already in use)" in a zoo-stage run).
    ports = itertools.count(20000 + port % 1000 * 10, 10)
    for name in names:
        try:
            if name in CASES:
                kind, grid, replicas, plant = CASES[name]
                os.environ["BIGCONV_PORT"] = str(next(ports))
                results[name] = train(kind, grid, replicas, plant)
            else:
                fn, kind, grid, replicas, arg = EXTRA[name]
                results[name] = getattr(more, fn)(kind, grid, replicas, ports, arg)
        except Exception as exc:
            results[name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
    return results
