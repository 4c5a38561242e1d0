"""What each SPMD rank runs for ``tests/test_native_loop.py``: the user's own loop on ``parallelize``'s module.

The loop every PyTorch user writes: AdamW with two param groups (no weight decay on norms and biases),
a warmup-cosine ``LambdaLR``, ``clip_grad_norm_`` by the global norm, two micro-batches accumulated
under ``no_sync``, an EMA of the weights (timm's ``ModelEmaV3`` on the local module). One process runs
the same loop on the same model and batches; each rank returns the per-tensor relative errors of its run
against it. A ``plant`` breaks one habit in the library (or the loop) on purpose.
"""

from __future__ import annotations

import math

import bigconv  # noqa: F401  (before timm: torchvision on a CPU torch, for an environment installed before the entry point)
import torch
import torch.nn as nn

STEPS = 3
MICRO = 2
IMAGES = 2  # per micro-batch


class Seg(nn.Module):
    """A dense map: convolutions with a GroupNorm (norm weights: the no-decay group)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Tanh(),
                                  nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 3, 1))

    def forward(self, x):
        return self.body(x)


class Cls(nn.Module):
    """A replicated head after global pooling."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Tanh(),
                                  nn.Conv2d(4, 6, 3, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                  nn.Flatten(), nn.Linear(6, 3))

    def forward(self, x):
        return self.body(x)


def param_groups(named):
    decay, no_decay = [], []
    for name, p in named:
        (no_decay if p.dim() <= 1 else decay).append(p)
    return [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}]


def warmup_cosine(step: int) -> float:
    warm, total = 2, STEPS
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))


def batches(kind: str, dtype, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS * MICRO):
        x = torch.randn(IMAGES, 2, 12, 10, generator=g, dtype=dtype)
        y = torch.randint(0, 3, (IMAGES, 12, 10) if kind == "seg" else (IMAGES,), generator=g)
        out.append((x, y))
    return out


def build(kind: str, dtype, seed: int = 0):
    torch.manual_seed(seed)
    return (Seg() if kind == "seg" else Cls()).to(dtype)


def loop(model, data, loss_of, clip: float, ema_model=None, before_step=None, stop: int = STEPS, save=None,
         resume=None, seen=None) -> dict:
    """The user's loop; ``loss_of(model, x, y)`` is the micro-batch's loss. Returns what it saw.

    Preemption, as a user's loop handles it: with ``save``, ``save(checkpoint)`` after ``stop`` steps
    (weights, optimizer, scheduler, EMA and the step: plain ``state_dict``s); ``resume()`` returns such a
    checkpoint, loaded before the loop goes on from its step. ``seen``: what the run before the stop saw."""
    from timm.utils import ModelEmaV3

    opt = torch.optim.AdamW(param_groups(model.named_parameters()), lr=0.02, betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
    ema = ModelEmaV3(ema_model if ema_model is not None else model, decay=0.7)
    seen = seen if seen is not None else {"losses": [], "norms": [], "lrs": []}
    start = 0
    if resume is not None:
        ck = resume()
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        ema.load_state_dict(ck["ema"])
        start = ck["step"]
    for step in range(start, stop):
        for k in range(MICRO):
            x, y = data[step * MICRO + k]
            sync = getattr(model, "no_sync", None)
            ctx = sync() if sync is not None and k < MICRO - 1 else _null()
            with ctx:
                loss = loss_of(model, x, y) / MICRO
                loss.backward()
            seen["losses"].append(float(loss.detach()))
        if before_step is not None:
            before_step(model)
        seen["norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        sched.step()
        ema.update(ema_model if ema_model is not None else model, step=step)
        seen["lrs"].append([g["lr"] for g in opt.param_groups])
    if save is not None:
        save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
              "ema": ema.state_dict(), "step": stop})
    seen["weights"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    seen["ema"] = {k: v.detach().clone() for k, v in ema.module.state_dict().items()}
    return seen


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def one_process(kind: str, dtype) -> dict:
    model = build(kind, dtype)
    ce = nn.CrossEntropyLoss()
    return loop(model, batches(kind, dtype), lambda m, x, y: ce(m(x), y), clip=0.05)


def distributed(world, kind: str, dtype, grid, replicas, how: str) -> dict:
    """The same loop on ``parallelize``'s module: ``how`` is ``shard_loss`` or ``whole_loss``."""
    net = bigconv.parallelize(build(kind, dtype), world, grid=grid, replicas=replicas)
    ce = nn.CrossEntropyLoss()

    def loss_of(m, x, y):
        out = m(x)
        return m.shard_loss(ce, out, y) if how == "shard_loss" else m.whole_loss(ce, out, y)

    return loop(net, batches(kind, dtype), loss_of, clip=0.05, ema_model=net.module)


RESUME_AT = 2  # of STEPS: past the warmup, so a lost schedule changes the learning rate


def resumed(world, kind: str, dtype, grid, replicas, how: str) -> dict:
    """The loop stopped after ``RESUME_AT`` steps, its checkpoint written by rank 0 (``torch.save`` of the
    plain ``state_dict``s, as a DDP user writes it) and read by every rank into a new module made from other
    weights, which goes on to ``STEPS``: what the uninterrupted run saw."""
    import os
    import tempfile

    import torch.distributed as dist

    folder = [tempfile.mkdtemp(prefix="bigconv-resume-") if world.rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    path = os.path.join(folder[0], "ck.pt")
    ce = nn.CrossEntropyLoss()

    def loss_of(m, x, y):
        out = m(x)
        return m.shard_loss(ce, out, y) if how == "shard_loss" else m.whole_loss(ce, out, y)

    def save(ck):
        if world.rank == 0:
            torch.save(ck, path)
        world.barrier()

    data = batches(kind, dtype)
    first = bigconv.parallelize(build(kind, dtype), world, grid=grid, replicas=replicas)
    seen = loop(first, data, loss_of, clip=0.05, ema_model=first.module, stop=RESUME_AT, save=save)
    seen = {k: seen[k] for k in ("losses", "norms", "lrs")}
    then = bigconv.parallelize(build(kind, dtype, seed=1), world, grid=grid, replicas=replicas)
    got = loop(then, data, loss_of, clip=0.05, ema_model=then.module, seen=seen,
               resume=lambda: torch.load(path, weights_only=True))
    world.barrier()
    if world.rank == 0:
        os.unlink(path)
        os.rmdir(folder[0])
    return got


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm()) if b.norm() > 0 else float((a - b).norm())


def errors(got: dict, ref: dict) -> dict:
    """Each tensor against its own size, and the scalars the loop saw."""
    out = {}
    for part in ("weights", "ema"):
        for k, v in ref[part].items():
            out[f"{part}/{k}"] = rel(got[part][k], v)
    for part in ("losses", "norms"):
        out[part] = rel(torch.tensor(got[part]), torch.tensor(ref[part]))
    out["lrs"] = rel(torch.tensor(got["lrs"]), torch.tensor(ref["lrs"]))
    return out


# -- planted errors: each breaks one habit the tests must catch ------------------------------------------
def apply_plant(plant: str | None):
    """Patch the library in this rank; returns an undo."""
    from bigconv.spmd import native

    undo = []

    def patch(obj, name, value):
        old = getattr(obj, name)
        setattr(obj, name, value)
        undo.append(lambda: setattr(obj, name, old))

    if plant == "skip_sum":  # the backward never waits for the sums: .grad stays this rank's part
        patch(native.GradSync, "queue_finish", lambda self: None)
    elif plant == "drop_accumulated":  # the synced micro-batch forgets what no_sync accumulated
        old_arm = native.GradSync.arm

        def arm(self):
            self.engine.model.zero_grad(set_to_none=True)
            old_arm(self)
        patch(native.GradSync, "arm", arm)
    elif plant == "every_head_counts":  # every shard's copy of a replicated head passes its gradient
        old_apply = native.Sink.apply
        patch(native.Sink, "apply", lambda sync, count, *outs: old_apply(sync, tuple(True for _ in count), *outs))
    elif plant == "clip_local":  # clipping by the norm of this rank's own part, taken before the sum
        old_finish = native.GradSync.finish
        local = {}

        def finish(self):
            if self.pending:
                grads = [p.grad for p in self.engine.model.parameters() if p.grad is not None]
                local["norm"] = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            old_finish(self)

        def clip(params, max_norm, *args, **kwargs):
            scale = min(1.0, max_norm / (float(local["norm"]) + 1e-6))
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(scale)
            return local["norm"]
        patch(native.GradSync, "finish", finish)
        patch(torch.nn.utils, "clip_grad_norm_", clip)
    elif plant == "drop_scheduler":  # a resumed run's schedule starts over: its state is not loaded
        patch(torch.optim.lr_scheduler.LambdaLR, "load_state_dict", lambda self, state: None)
    elif plant is not None:
        raise ValueError(plant)
    return lambda: [u() for u in reversed(undo)]


# -- mixed precision ---------------------------------------------------------------------------------------
def autocast_case(world, kind: str, grid, replicas, how: str) -> dict:
    """One forward and backward under bf16 autocast: the output's dtype, and the output's and each gradient's
    error against one process under bf16, beside that process's own bf16 error (against float32)."""
    x, y = batches(kind, torch.float32)[0]
    ce = nn.CrossEntropyLoss()

    def single(enabled: bool):
        m = build(kind, torch.float32)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            out = m(x)
            loss = ce(out, y)
        loss.backward()
        return out.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}

    out32, g32 = single(False)
    outbf, gbf = single(True)
    net = bigconv.parallelize(build(kind, torch.float32), world, grid=grid, replicas=replicas)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = net(x)
        loss = net.shard_loss(ce, out, y) if how == "shard_loss" else net.whole_loss(ce, out, y)
    loss.backward()
    whole = net.gather(out.detach())
    r = {"dtype": str(out.dtype), "ref_dtype": str(outbf.dtype), "whole_dtype": str(whole.dtype),
         "output": (rel(whole, outbf), rel(outbf, out32))}
    for n, p in net.named_parameters():
        r[f"grad/{n}"] = (rel(p.grad, gbf[n]), rel(gbf[n], g32[n]))
    return r


def scaler_run(model, data, loss_of, poison=None) -> dict:
    """fp16 autocast with a GradScaler whose scale overflows now and then (skipped steps), the scales it
    went through, and the weights."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 22, growth_interval=1)
    scales = []
    for step, (x, y) in enumerate(data):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_of(model, x, y)
        handle = poison(step) if poison is not None else None
        scaler.scale(loss).backward()
        if handle is not None:
            handle.remove()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return {"scales": scales, "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


POISONED = 3


def scaler_case(world, grid, replicas) -> dict:
    ce = nn.CrossEntropyLoss()
    data = batches("seg", torch.float32)
    ref = scaler_run(build("seg", torch.float32), data, lambda m, x, y: ce(m(x), y))
    net = bigconv.parallelize(build("seg", torch.float32), world, grid=grid, replicas=replicas)
    got = scaler_run(net, data, lambda m, x, y: m.shard_loss(ce, m(x), y))
    # An inf in one rank's own part of one weight's gradient, at step POISONED: every rank must skip that step.
    net2 = bigconv.parallelize(build("seg", torch.float32), world, grid=grid, replicas=replicas)
    last = world.size - 1

    def poison(step):
        if step == POISONED and world.rank == last:
            return next(net2.module.parameters()).register_hook(lambda g: g * float("inf"))
        return None
    poisoned = scaler_run(net2, data, lambda m, x, y: m.shard_loss(ce, m(x), y), poison)
    return {"scales": got["scales"], "ref_scales": ref["scales"], "poisoned_scales": poisoned["scales"],
            "poisoned_state": {k: v.numpy().copy() for k, v in poisoned["weights"].items()},
            "weights": max(rel(got["weights"][k], v) for k, v in ref["weights"].items()),
            "state": {k: v.numpy().copy() for k, v in got["weights"].items()}}  # numpy: by value


def _error(fn) -> str:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return "no error"


def api_case(world) -> dict:
    """The module's names, its local-share input, its loss helpers' refusals, load_state_dict, eval."""
    plain = build("seg", torch.float64)
    net = bigconv.parallelize(build("seg", torch.float64), world, grid=(2, 2))
    x, y = batches("seg", torch.float64)[0]
    r = {"keys": list(net.state_dict()) == list(plain.state_dict()),
         "names": [n for n, _ in net.named_parameters()] == [n for n, _ in plain.named_parameters()],
         "is_module": isinstance(net, nn.Module)}
    with torch.no_grad():
        whole, local = net(x), net(net.cut_input(x), shape=tuple(x.shape))
    r["local_input"] = torch.equal(whole, local)
    r["wrong_share"] = _error(lambda: net(x[:, :, :5], shape=tuple(x.shape)))
    r["wrong_target"] = _error(lambda: net.cut(y[:, :5]))
    head = bigconv.parallelize(build("cls", torch.float64), world, grid=(2, 2))
    r["loss_before_forward"] = _error(lambda: head.shard_loss(nn.CrossEntropyLoss(), None, y))
    r["head_shard_loss"] = _error(lambda: head.shard_loss(nn.CrossEntropyLoss(), head(x), y[:, 0, 0]))
    net.load_state_dict({k: v + 1 for k, v in plain.state_dict().items()})
    r["loaded"] = all(torch.equal(net.module.state_dict()[k], v + 1) for k, v in plain.state_dict().items())
    net.eval()
    r["eval"] = (net.training, net.module.training, net.module.body[1].training)
    return r


CONFIGS = {"(2,2)": ((2, 2), 1), "R2x(2,1)": ((2, 1), 2)}
RUNS = [("seg", "shard_loss"), ("seg", "whole_loss"), ("cls", "whole_loss")]
PLANTS = [("skip_sum", "(2,2)", "seg", "shard_loss"), ("drop_accumulated", "(2,2)", "seg", "shard_loss"),
          ("every_head_counts", "(2,2)", "cls", "whole_loss"), ("clip_local", "R2x(2,1)", "seg", "shard_loss")]

RESUMES = {"resume/(2,2)/seg/shard_loss": ("(2,2)", "seg", "shard_loss"),
           "resume/R2x(2,1)/cls/whole_loss": ("R2x(2,1)", "cls", "whole_loss"),
           "resume_plant/drop_scheduler": ("(2,2)", "seg", "shard_loss")}


def run_all(timeout: float = 60.0) -> dict:
    """Every exactness run and every planted error, in one SPMD world of 4 ranks."""
    torch.set_num_threads(1)
    refs = {kind: one_process(kind, torch.float64) for kind in ("seg", "cls")}
    results = {}
    with bigconv.World.from_env(mode="spmd", device="cpu", timeout=timeout) as world:
        for cfg, (grid, replicas) in CONFIGS.items():
            for kind, how in RUNS:
                name = f"{cfg}/{kind}/{how}"
                try:
                    results[name] = errors(distributed(world, kind, torch.float64, grid, replicas, how), refs[kind])
                except Exception as exc:
                    results[name] = f"{type(exc).__name__}: {exc}"
        for name, (cfg, kind, how) in RESUMES.items():
            grid, replicas = CONFIGS[cfg]
            undo = apply_plant("drop_scheduler" if name.startswith("resume_plant/") else None)
            try:
                results[name] = errors(resumed(world, kind, torch.float64, grid, replicas, how), refs[kind])
            except Exception as exc:
                results[name] = f"{type(exc).__name__}: {exc}"
            finally:
                undo()
        for cfg, (grid, replicas) in CONFIGS.items():
            for kind, how in RUNS:
                name = f"bf16/{cfg}/{kind}/{how}"
                try:
                    results[name] = autocast_case(world, kind, grid, replicas, how)
                except Exception as exc:
                    results[name] = f"{type(exc).__name__}: {exc}"
            try:
                results[f"fp16/{cfg}"] = scaler_case(world, grid, replicas)
            except Exception as exc:
                results[f"fp16/{cfg}"] = f"{type(exc).__name__}: {exc}"
        try:
            results["api"] = api_case(world)
        except Exception as exc:
            results["api"] = f"{type(exc).__name__}: {exc}"
        for plant, cfg, kind, how in PLANTS:
            grid, replicas = CONFIGS[cfg]
            undo = apply_plant(plant)
            try:
                results[f"plant/{plant}"] = errors(distributed(world, kind, torch.float64, grid, replicas, how),
                                                   refs[kind])
            except Exception as exc:
                results[f"plant/{plant}"] = f"{type(exc).__name__}: {exc}"
            finally:
                undo()
    return results
