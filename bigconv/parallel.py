"""``bigconv.parallelize``: a plain ``torch.nn`` model, trained on a World, exactly.

The driver validates everything it can before any remote work: module types when the model is
parallelized; input rank, grid, image size and every layer's geometry in a dry run on meta tensors
at the first call with a new input shape.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed.rpc as rpc
import torch.nn as nn

from . import checks, losses, saving, worker
from .data.sources import ShardRead, SourceBatch, class_index_targets, is_source_batch, target_stand_in
from .dry_run import dry_run, meta_copy
from .executors import join_shards, split_shards
from .geometry import choose_grid, shard_box, all_coords, validate_grid
from .replica import to_payload
from .sharding import UnsupportedOperation
from .support import check_modules, conv_dims
from .world import World

_model_ids = itertools.count()


@dataclass(frozen=True)
class Plan:
    """What a forward over one input shape looks like."""

    grid: tuple[int, ...]
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...] | None
    """Global spatial shape of a sharded output; None when the output is replicated (a head)."""
    out_full_shape: tuple[int, ...]


class _PickFirst(torch.autograd.Function):
    """Worker 0's copy of a replicated output; the other copies get zero gradients.

    Every replica's head must sit on the loss's graph (FAST-mode distributed autograd waits for a
    gradient on every send), but only one copy may count.
    """

    @staticmethod
    def forward(ctx, *copies):
        ctx.n = len(copies)
        return copies[0].clone()

    @staticmethod
    def backward(ctx, grad):
        return (grad,) + tuple(torch.zeros_like(grad) for _ in range(ctx.n - 1))


class ParallelModel:
    """A model whose forward and training run on the workers of a ``World``."""

    def __init__(self, model: nn.Module, world: World, grid: tuple[int, ...] | None, check_finite: bool = False) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"parallelize expects a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(world, World):
            raise ValueError(f"parallelize expects a bigconv.World, got {type(world).__name__}")
        world.check_usable()
        check_modules(model)
        self.world = world
        self.spatial_workers = world.workers
        self.grid = validate_grid(grid, world.workers) if grid is not None else None
        self.spatial_dims = len(self.grid) if self.grid else conv_dims(model)
        self.training = model.training
        self.check_finite = check_finite
        self._meta = meta_copy(model)
        self._plans: dict[tuple, Plan] = {}
        self._calls = itertools.count(1)
        self.id = next(_model_ids)
        self.has_optimizer = False
        self.optimizer_class: str | None = None
        self.steps = 0
        """Optimizer steps taken (restored by ``load``)."""
        payload = to_payload(model)
        world.drop_retired_models()  # before this one takes their memory
        world.call(worker.install, [(self.id, payload)] * world.workers, "installing the model")
        weakref.finalize(self, world.retire_model, self.id)

    # -- planning (driver only, before remote work) ---------------------------------------------
    def plan(self, x) -> Plan:
        """``x``: the batch as a tensor (N, C, *spatial), or as a list of image sources
        (``bigconv.data``), one per item, of which each worker reads only its own box."""
        if is_source_batch(x):
            x = SourceBatch(x)
        else:
            checks.check_input(x, self.check_finite)
        key = (tuple(x.shape), x.dtype, self.training)
        if key not in self._plans:
            self._plans[key] = self._make_plan(x)
        return self._plans[key]

    def _make_plan(self, x: torch.Tensor) -> Plan:
        d = self.spatial_dims
        if d is None:
            d = x.dim() - 2
        if x.dim() != d + 2:
            raise ValueError(
                f"input has shape {tuple(x.shape)} but this model expects (N, C, *{d} spatial dims), "
                f"i.e. {d + 2} dims; add a batch dim with x.unsqueeze(0) or check the grid"
            )
        shape = tuple(x.shape[2:])
        grid = self.grid or choose_grid(shape, self.spatial_workers)
        for axis, (n, g) in enumerate(zip(shape, grid)):
            if n < g:
                raise ValueError(
                    f"the image has {n} positions along spatial dim {axis} but the grid {grid} cuts it into {g} "
                    f"shards; use at most {n} shards on that axis"
                )
        try:
            result = dry_run(self._meta, grid, tuple(x.shape), x.dtype, self.training)
        except UnsupportedOperation:
            raise
        except (RuntimeError, TypeError, IndexError, NotImplementedError) as exc:
            raise ValueError(
                f"the model cannot run on an input of shape {tuple(x.shape)} and dtype {x.dtype} "
                f"(found in a dry run, before any remote work) in {getattr(exc, 'bigconv_where', 'its forward')}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        return Plan(grid, shape, result.out_shape, result.out_full_shape)

    # -- training API -----------------------------------------------------------------------------
    def optimizer(self, cls: type, **kwargs) -> None:
        """Create a replicated optimizer ``cls(params, **kwargs)`` on every worker."""
        checks.check_optimizer_class(cls)
        self.world.call(worker.make_optimizer, [(self.id, cls, kwargs)] * self.world.workers, "creating the optimizer")
        self.has_optimizer = True
        self.optimizer_class = saving.class_name(cls)

    def train_step(self, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable) -> float:
        """One forward, backward and optimizer step on the whole batch; returns the loss."""
        if not self.has_optimizer:
            raise ValueError("call net.optimizer(torch.optim.SGD, lr=...) before train_step")
        plan = self.plan(x)
        dense = self._per_shard_loss(plan, x, y, loss_fn)
        args = self._shard_args(plan, x, loss_fn if dense else None, y if dense else None, grad=True)
        with self.world.autograd_context() as ctx:
            results = self.world.wait(self._launch(args), f"forward of step {args[0][0]}")
            if dense:
                loss = losses.combine(results)
            else:
                loss = loss_fn(self._assemble(plan, results, grad=True), y)
            if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
                raise ValueError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
            self.world.backward(ctx, loss, f"backward of step {args[0][0]}")
            self.world.call(worker.step, [(self.id, ctx)] * self.world.workers, f"optimizer step {args[0][0]}")
        self.steps += 1
        return float(loss.detach())

    def _per_shard_loss(self, plan: Plan, x, y, loss_fn: Callable) -> bool:
        """Check the targets (before remote work); whether the loss is computed shard by shard."""
        y_sources = is_source_batch(y)
        y_seen = target_stand_in(y, loss_fn) if y_sources else y  # what the loss will receive
        checks.check_target(x, y_seen, loss_fn, plan.out_full_shape)
        dense = plan.out_shape is not None and losses.is_dense(loss_fn, len(plan.grid)) and isinstance(
            y_seen, torch.Tensor) and losses.target_shape_ok(loss_fn, plan.out_full_shape, y_seen)
        if y_sources and not dense:
            raise ValueError(
                "targets given as sources are read shard by shard, which needs a dense output and a loss computed "
                "per shard (MSELoss, L1Loss, BCEWithLogitsLoss, CrossEntropyLoss with mean or sum reduction) and "
                f"targets of the output's shape {plan.out_full_shape}; otherwise pass y as a tensor"
            )
        return dense

    def gradients(self, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable) -> tuple[float, torch.Tensor, dict]:
        """The loss, the gradient of the input and the summed parameter gradients, without a step.

        What a single process gets from ``loss_fn(model(x), y).backward()``: the evidence, layer
        by layer, that the distributed backward pass is the single-process one.
        """
        plan = self.plan(x)
        checks.check_target(x, y, loss_fn, plan.out_full_shape)
        args = self._shard_args(plan, x, None, None, grad="input")
        with self.world.autograd_context() as ctx:
            results = self.world.wait(self._launch(args), f"forward of call {args[0][0]}")
            loss = loss_fn(self._assemble(plan, results, grad=True), y)
            self.world.backward(ctx, loss, f"backward of call {args[0][0]}")
            parts = self.world.call(worker.gradients, [(self.id, ctx)] * self.world.workers, "reading gradients")
        input_grad = join_shards([g for g, _ in parts], plan.grid)
        params: dict[str, torch.Tensor] = {}
        for _, grads in parts:  # in worker order, as the allreduce would
            for name, g in grads.items():
                params[name] = params[name] + g if name in params else g
        return float(loss.detach()), input_grad, params

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The full output on the driver, without gradients."""
        plan = self.plan(x)
        args = self._shard_args(plan, x, None, None, grad=False)
        results = self.world.wait(self._launch(args), f"inference call {args[0][0]}")
        return self._assemble(plan, results, grad=False)

    def predict(self, x, out: str, *, overwrite: bool = False, max_chunk: int = 1024) -> str:
        """Write the dense output for ``x`` (a tensor, or a list of image sources) into a zarr array at
        ``out``, each worker writing its own region; nothing the size of the output reaches the driver.
        Chunks never cross shards (``bigconv.data.outputs``). Returns ``out``."""
        from .data import outputs

        plan = self.plan(x)
        if plan.out_shape is None:
            raise ValueError("predict writes a dense map, but this model's output is one vector per image "
                             "(replicated after pooling); use net(x) for it")
        chunks = outputs.aligned_chunks(plan.out_shape, plan.grid, max_chunk)
        dtype = str(x.dtype if isinstance(x, torch.Tensor) else SourceBatch(x).dtype).replace("torch.", "")
        path = outputs.create(str(out), plan.out_full_shape, chunks, dtype, overwrite)
        args = self._shard_args(plan, x, None, None, grad=False)
        boxes = [shard_box(plan.out_shape, plan.grid, c) for c in all_coords(plan.grid)]
        self.world.check_usable()
        futures = [rpc.rpc_async(name, worker.predict, args=(self.id, *a[:4], path, box),
                                 timeout=self.world.rpc_timeout)
                   for name, a, box in zip(self.world.names, args, boxes)]
        self.world.wait(futures, f"prediction {args[0][0]}")
        return path

    def prefetch(self, x, y=None, loss_fn=None) -> None:
        """Start every worker reading its boxes of the next call's sources (``x``, and ``y`` when they
        are sources too) while the current call computes; that call must then get the same arguments.
        Tensors need nothing: this returns at once for them."""
        if not (is_source_batch(x) or is_source_batch(y)):
            return
        plan = self.plan(x)
        reads = [[a[3], a[5]] for a in self._shard_args(plan, x, loss_fn, y if is_source_batch(y) else None,
                                                        grad=False)]
        reads = [[r for r in pair if isinstance(r, ShardRead)] for pair in reads]
        self.world.check_usable()
        futures = [rpc.rpc_async(name, worker.prefetch, args=(r,), timeout=self.world.rpc_timeout)
                   for name, r in zip(self.world.names, reads)]
        self.world.wait(futures, "starting the next reads")

    def _shard_args(self, plan: Plan, x, loss_fn, y, grad: bool) -> list[tuple]:
        call = next(self._calls)
        if is_source_batch(x):
            sources = tuple(x)
            xs = [ShardRead(sources, shard_box(plan.in_shape, plan.grid, c)) for c in all_coords(plan.grid)]
        else:
            xs = split_shards(x.detach(), plan.grid)
        ys = [None] * len(xs)
        if is_source_batch(y):
            squeeze = class_index_targets(SourceBatch(y), loss_fn)
            ys = [ShardRead(tuple(y), shard_box(plan.out_shape, plan.grid, c), squeeze) for c in all_coords(plan.grid)]
        elif y is not None:
            lead = (slice(None),) * (y.dim() - len(plan.grid))
            ys = [y[lead + tuple(slice(a, b) for a, b in shard_box(plan.out_shape, plan.grid, c))].clone()
                  for c in all_coords(plan.grid)]
        return [(call, plan.grid, plan.in_shape, xi, loss_fn, yi, grad) for xi, yi in zip(xs, ys)]

    def _launch(self, args: list[tuple]) -> list:
        self.world.check_usable()
        return [rpc.rpc_async(name, worker.forward, args=(self.id, *a), timeout=self.world.rpc_timeout)
                for name, a in zip(self.world.names, args)]

    def _assemble(self, plan: Plan, results: list, grad: bool) -> torch.Tensor:
        if plan.out_shape is not None:
            return join_shards(results, plan.grid)
        return _PickFirst.apply(*results) if grad else results[0]

    # -- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Worker 0's weights, under the single-process names (every replica holds the same)."""
        return self.replica_state_dicts(workers=1)[0]

    def replica_state_dicts(self, workers: int | None = None) -> list[dict]:
        """The weights of the first ``workers`` replicas (all by default), to check they agree."""
        self.world.check_usable()
        names = self.world.names[: workers or self.world.workers]
        futures = [rpc.rpc_async(n, worker.state_dict, args=(self.id,), timeout=self.world.rpc_timeout) for n in names]
        return self.world.wait(futures, "reading weights")

    def save(self, path) -> str:
        """Write weights, optimizer state, step count and generator states to ``path`` atomically.

        The file loads into a plain model and optimizer too (see ``bigconv.saving``).
        """
        self.world.check_usable()
        parts = self.world.call(worker.checkpoint_state, [(self.id, i == 0) for i in range(self.world.workers)],
                                "saving a checkpoint")
        ck = saving.checkpoint(parts[0]["model"], parts[0]["optimizer"], self.optimizer_class, self.steps,
                               [p["rng"] for p in parts], self.world.workers,
                               grid=list(self.grid) if self.grid else None)
        return saving.atomic_save(ck, path)

    def load(self, path) -> "ParallelModel":
        """Restore what ``save`` wrote, on any worker count or grid; the optimizer must already exist,
        made with the same class and arguments. Every check runs before any worker changes, so a bad
        file leaves the model as it was. Workers' generator states return on the same worker count.
        """
        path = str(path)
        ck = saving.read(path)
        saving.check_model_state(ck["model"], self._meta.state_dict(), path)
        groups = [len(list(self._meta.parameters()))]
        saving.check_optimizer_state(ck.get("optimizer"), ck.get("optimizer_class"), groups, self.optimizer_class,
                                     path)
        n = self.world.workers
        rngs = ck["rng"]["workers"] if ck.get("workers") == n else [None] * n
        self.world.call(worker.load_checkpoint, [(self.id, ck["model"], ck.get("optimizer"), r) for r in rngs],
                        "loading a checkpoint")
        self.steps = int(ck.get("step", 0))
        torch.set_rng_state(ck["rng"]["driver"])
        return self

    def train(self, mode: bool = True) -> "ParallelModel":
        self.training = mode
        self.world.call(worker.set_training, [(self.id, mode)] * self.world.workers, "setting train mode")
        return self

    def eval(self) -> "ParallelModel":
        return self.train(False)


def parallelize(model: nn.Module, world, grid: tuple[int, ...] | None = None, *, replicas: int = 1,
                check_finite: bool = False) -> ParallelModel:
    """Return ``model`` decomposed over ``world``'s workers on ``grid`` (None: balanced per input).

    On an SPMD world (``World.from_env(mode="spmd")``) every rank calls this with the same arguments;
    ``replicas=R`` adds data parallelism: R copies of the spatial grid, each on an equal slice of the
    batch, with ``prod(grid) * R`` equal to the world size. The driver mode has one replica.

    ``check_finite``: refuse inputs holding NaN or inf before sending them (off by default: it reads
    the whole batch once more).
    """
    from .spmd import SpmdModel, SpmdWorld

    if isinstance(world, SpmdWorld):
        return SpmdModel(model, world, grid, replicas, check_finite)
    if replicas != 1:
        raise ValueError(f"replicas={replicas} needs an SPMD world (World.from_env(mode='spmd') under torchrun, "
                         "srun or jsrun); a driver-mode World has one replica")
    return ParallelModel(model, world, grid, check_finite)
