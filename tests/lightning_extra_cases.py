"""More of what each rank runs for ``tests/test_lightning.py`` (in ``lightning_cases.run_all``'s spawn):
a ``Trainer`` stopped at an epoch's end and resumed from its checkpoint, the precision plugins
(``bf16-mixed``, ``16-mixed`` with its GradScaler) and metrics beyond the loss (torchmetrics' accuracy and
AUROC over a validation set) through Lightning's ``CSVLogger``. Each against one process on the batches
Lightning's sampler drew.
"""

from __future__ import annotations

import os
import shutil

import bigconv  # noqa: F401  (torchvision on a CPU torch before lightning)
import torch
import torch.nn.functional as F

import native_loop_cases as nl

ACCUMULATE, BATCH = 2, 2
EPOCH_STEPS, EPOCHS = 2, 2
VAL_IMAGES = 12  # per replica (divisible, so that the sampler pads nothing)
FP16_INIT_SCALE = 2.0 ** 22  # the first steps overflow in fp16: the scaler skips them


def schedule(step: int) -> float:
    """Per optimizer step, over the two epochs: every step its own learning rate (a lost schedule shows)."""
    return (1.0, 0.8, 0.5, 0.2)[min(step, 3)]


def make_module(kind: str, dtype, seed: int = 0, metrics: bool = False):
    import lightning.pytorch as pl

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = nl.build(kind, dtype, seed=seed)
            self.dtypes, self.scales = [], []
            if metrics:
                from torchmetrics.classification import MulticlassAccuracy, MulticlassAUROC

                self.acc = MulticlassAccuracy(num_classes=3, average="micro")
                self.auc = MulticlassAUROC(num_classes=3)

        def training_step(self, batch, index):
            x, y = batch
            out = self.model(x)
            self.dtypes.append(str(out.dtype))
            loss = F.cross_entropy(out, y)
            self.log("loss", loss, sync_dist=True)
            return loss

        def validation_step(self, batch, index):
            x, y = batch
            out = self.model(x)
            self.acc(out, y)
            self.auc(out, y)
            self.log("val_acc", self.acc)  # a torchmetrics object: Lightning computes it (synced) at the epoch's end
            self.log("val_auc", self.auc)

        def on_train_batch_end(self, outputs, batch, index):
            scaler = getattr(self.trainer.precision_plugin, "scaler", None)
            if scaler is not None and (index + 1) % ACCUMULATE == 0:
                self.scales.append(scaler.get_scale())

        def configure_optimizers(self):
            opt = torch.optim.AdamW(nl.param_groups(self.model.named_parameters()), lr=0.02, betas=(0.9, 0.99))
            sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
            return [opt], [{"scheduler": sched, "interval": "step"}]

    return Lit()


def dataset(kind: str, replicas: int, dtype, n: int | None = None, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    n = n or EPOCH_STEPS * ACCUMULATE * BATCH * replicas
    x = torch.randn(n, 2, 12, 10, generator=g, dtype=dtype)
    y = torch.randint(0, 3, (n, 12, 10) if kind == "seg" else (n,), generator=g)
    return torch.utils.data.TensorDataset(x, y)


def one_process(kind: str, replicas: int, dtype, epochs: int, autocast=None, scaler=None) -> dict:
    """The same loop on the same batches (each replica's ``DistributedSampler``, shuffled with seed 0 and
    ``set_epoch`` per epoch), the replicas averaged as DDP does. ``autocast``: the forward's dtype, as
    Lightning's ``MixedPrecision`` runs ``training_step``; ``scaler``: a GradScaler, as ``16-mixed``."""
    data = dataset(kind, replicas, dtype)
    model = nl.build(kind, dtype)
    opt = torch.optim.AdamW(nl.param_groups(model.named_parameters()), lr=0.02, betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    samplers = [torch.utils.data.DistributedSampler(data, num_replicas=replicas, rank=r, shuffle=True, seed=0)
                for r in range(replicas)]
    scales, dtypes = [], []
    for epoch in range(epochs):
        for s in samplers:
            s.set_epoch(epoch)
        per_replica = [list(s) for s in samplers]
        for step in range(EPOCH_STEPS):
            for k in range(ACCUMULATE):
                b = step * ACCUMULATE + k
                idx = [i for r in range(replicas) for i in per_replica[r][b * BATCH:(b + 1) * BATCH]]
                x, y = data[idx]
                with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None,
                                    cache_enabled=False):
                    out = model(x)
                    loss = F.cross_entropy(out, y) / ACCUMULATE
                dtypes.append(str(out.dtype))
                (scaler.scale(loss) if scaler is not None else loss).backward()
            if scaler is not None:
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
                scales.append(scaler.get_scale())
            else:
                opt.step()
            opt.zero_grad()
            sched.step()
    return {"weights": {k: v.detach().clone() for k, v in model.state_dict().items()}, "scales": scales,
            "dtypes": dtypes}


def trainer(strategy, epochs: int, **kwargs):
    import lightning.pytorch as pl

    kwargs.setdefault("logger", False)
    kwargs.setdefault("enable_checkpointing", False)
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=4, max_epochs=epochs,
                      accumulate_grad_batches=ACCUMULATE, gradient_clip_val=0.05, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, **kwargs)


def loader(data):
    return torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False)


def weights(lit) -> dict:
    return {k: v.detach().clone() for k, v in lit.model.state_dict().items()}


def shared_folder(tag: str) -> str:
    """One folder every rank names (the spawn's port is in its name): the checkpoint's and the logger's.
    Rank 0 writes into it; every rank leaves ``fit`` after its writes (Lightning's barrier)."""
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"bigconv-lightning-{os.environ['BIGCONV_BASE_PORT']}-{tag}")


def resume(kind: str, grid, replicas: int, ports, plant: str | None = None) -> dict:
    """Epoch 1 of 2, its checkpoint by ``ModelCheckpoint``; a new Trainer and a LightningModule made from other
    weights resume from it (``fit(..., ckpt_path=)``): the weights of an uninterrupted Trainer and of one
    process. ``plant="drop_scheduler"``: the scheduler's state is not loaded."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from bigconv.lightning import BigconvStrategy

    rank = int(os.environ["RANK"])
    folder = shared_folder("resume" if plant is None else f"resume-{plant}")
    data = dataset(kind, replicas, torch.float64)
    os.environ["BIGCONV_PORT"] = str(next(ports))
    first = make_module(kind, torch.float64)
    trainer(BigconvStrategy(grid=grid, replicas=replicas, timeout=30.0), 1, enable_checkpointing=True,
            callbacks=[ModelCheckpoint(dirpath=folder, filename="ck")]).fit(first, loader(data))
    os.environ["BIGCONV_PORT"] = str(next(ports))
    then = make_module(kind, torch.float64, seed=1)
    undo = None
    if plant == "drop_scheduler":
        cls = torch.optim.lr_scheduler.LambdaLR
        old = cls.load_state_dict
        cls.load_state_dict = lambda self, state: None
        undo = lambda: setattr(cls, "load_state_dict", old)  # noqa: E731
    try:
        t = trainer(BigconvStrategy(grid=grid, replicas=replicas, timeout=30.0), EPOCHS)
        t.fit(then, loader(data), ckpt_path=os.path.join(folder, "ck.ckpt"))
    finally:
        if undo is not None:
            undo()
    got = weights(then)
    r = {"steps": t.global_step, "epoch": t.current_epoch}
    ref = one_process(kind, replicas, torch.float64, EPOCHS)["weights"]
    r["errors"] = {k: nl.rel(got[k], v) for k, v in ref.items()}
    if plant is None:
        os.environ["BIGCONV_PORT"] = str(next(ports))
        whole = make_module(kind, torch.float64)
        trainer(BigconvStrategy(grid=grid, replicas=replicas, timeout=30.0), EPOCHS).fit(whole, loader(data))
        uninterrupted = weights(whole)
        r["uninterrupted"] = {k: nl.rel(got[k], v) for k, v in uninterrupted.items()}
        r["equal"] = all(torch.equal(got[k], v) for k, v in uninterrupted.items())
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    return r


def precision(kind: str, grid, replicas: int, ports, plugin: str) -> dict:
    """One epoch under ``Trainer(precision="bf16-mixed")``, or ``16-mixed`` (the ``MixedPrecision`` plugin with
    a GradScaler: on a CPU accelerator Lightning turns ``precision="16-mixed"`` into bf16, so the plugin is
    given as ``plugins=``), float32 weights. bf16: the outputs' dtypes and each weight's error against one
    process under the same autocast, beside that process's own bf16 error (bf16 against float32). fp16: the
    scales after every step (every skipped step halves it) and the weights, to compare across ranks."""
    from lightning.pytorch.plugins import MixedPrecision

    from bigconv.lightning import BigconvStrategy

    os.environ["BIGCONV_PORT"] = str(next(ports))
    lit = make_module(kind, torch.float32)
    data = dataset(kind, replicas, torch.float32)
    if plugin == "bf16-mixed":
        t = trainer(BigconvStrategy(grid=grid, replicas=replicas, timeout=30.0), 1, precision="bf16-mixed")
    else:
        scaler = torch.amp.GradScaler("cpu", init_scale=FP16_INIT_SCALE, growth_interval=1)
        t = trainer(BigconvStrategy(grid=grid, replicas=replicas, timeout=30.0), 1,
                    plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    t.fit(lit, loader(data))
    got = weights(lit)
    if plugin == "bf16-mixed":
        ref = one_process(kind, replicas, torch.float32, 1, autocast=torch.bfloat16)
        exact = one_process(kind, replicas, torch.float32, 1)["weights"]
        return {"dtypes": lit.dtypes, "ref_dtypes": ref["dtypes"],
                "weights": {k: (nl.rel(got[k], v), nl.rel(v, exact[k])) for k, v in ref["weights"].items()}}
    ref = one_process(kind, replicas, torch.float32, 1, autocast=torch.float16,
                      scaler=torch.amp.GradScaler("cpu", init_scale=FP16_INIT_SCALE, growth_interval=1))
    return {"dtypes": lit.dtypes, "ref_dtypes": ref["dtypes"], "scales": lit.scales, "ref_scales": ref["scales"],
            "state": {k: v.numpy().copy() for k, v in got.items()}}


def metrics(kind: str, grid, replicas: int, ports, plant: str | None = None) -> dict:
    """One epoch and a validation over ``VAL_IMAGES * replicas`` images, each replica's sampler its share:
    torchmetrics' accuracy and AUROC, logged with ``self.log`` through a ``CSVLogger``; rank 0 reads
    ``metrics.csv``. Against one process's metrics over the whole validation set (the trained weights, equal
    on every rank) and this replica's own share's. ``plant="local"``: the metrics are not synced."""
    import csv

    from lightning.pytorch.loggers import CSVLogger
    from torchmetrics.classification import MulticlassAccuracy, MulticlassAUROC

    from bigconv.lightning import BigconvStrategy

    rank = int(os.environ["RANK"])
    folder = shared_folder("csv" if plant is None else f"csv-{plant}")
    os.environ["BIGCONV_PORT"] = str(next(ports))
    lit = make_module(kind, torch.float64, metrics=True)
    if plant == "local":
        for m in (lit.acc, lit.auc):
            m.sync_on_compute = False
    val = dataset(kind, replicas, torch.float64, n=VAL_IMAGES * replicas, seed=11)
    t = trainer(BigconvStrategy(grid=grid, replicas=replicas, timeout=30.0), 1,
                logger=CSVLogger(folder, name="csv", version=0))
    t.fit(lit, loader(dataset(kind, replicas, torch.float64)), loader(val))
    plain = nl.build(kind, torch.float64)
    plain.load_state_dict(lit.model.state_dict())
    plain.eval()

    def scores(idx):
        x, y = val[idx]
        with torch.no_grad():
            out = plain(x)
        return (float(MulticlassAccuracy(num_classes=3, average="micro")(out, y)),
                float(MulticlassAUROC(num_classes=3)(out, y)))

    mine = list(torch.utils.data.DistributedSampler(val, num_replicas=replicas, rank=rank // (4 // replicas),
                                                    shuffle=False))
    r = {"global": scores(list(range(len(val)))), "replica": scores(mine), "logged": None}
    if rank == 0:
        with open(os.path.join(folder, "csv", "version_0", "metrics.csv")) as fh:
            rows = [row for row in csv.DictReader(fh) if row.get("val_acc")]
        r["logged"] = (float(rows[-1]["val_acc"]), float(rows[-1]["val_auc"]))
        r["columns"] = sorted(rows[-1]) if rows else []
        shutil.rmtree(folder, ignore_errors=True)
    return r
