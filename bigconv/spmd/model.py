"""``parallelize`` on an SPMD world: the driver mode's API, called by every rank with the same arguments.

Each rank validates everything the driver would (types, grid, the dry run on meta tensors) before its
first message, so bad input raises the same ``ValueError`` on every rank and nobody is left waiting.
Then it runs its own shard of its replica's slice of the batch; no tensor the size of the batch is
sent anywhere.

- ``train_step`` returns the same loss on every rank; ``net(x)`` returns the full output on every rank
  (gathered; use ``predict`` for outputs too large for that).
- A loss per shard (``bigconv.losses``) is ``sum(numerators) / sum(denominators)`` over every rank; any
  other loss sees the replicated output of the whole batch (replicas exchange their heads) and its
  gradient is taken once per replica, on shard 0 (the other shards' copies pass zero gradients, so
  their halo exchanges still run).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import input_checks
from .. import saving
from .agreement import agree
from ..data.prefetch import Prefetcher
from ..data.sources import ShardRead, is_source_batch
from ..engine import step as shard_step
from ..engine.step import PerShardLoss, StepCommand, WholeOutputLoss, gather_dense, gather_heads
from ..geometry.boxes import batch_share, box_index, coord_of, shard_box, validate_grid
from ..engine.plan import Plan, output_leaves
from ..planning import Planner
from ..saving import rng_state, set_rng_state
from ..engine.shard import ShardEngine
from ..ops.random import random_seed
from ..ops.support import unwrap_compiled
from ..transport import WorkerFailure, new_stats
from ..transport.p2p import shard_runtime
from ..runtime.spmd_world import SpmdWorld


def check_layout(world: SpmdWorld, grid, replicas) -> tuple[tuple[int, ...] | None, int]:
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be a positive integer, got {replicas!r}")
    if world.size % replicas:
        raise ValueError(f"replicas={replicas} does not divide the world's {world.size} ranks; prod(grid) * replicas "
                         f"must equal the world size")
    spatial = world.size // replicas
    if grid is None:
        return None, spatial
    if not isinstance(grid, (tuple, list)) or not grid:
        raise ValueError(f"grid must be a tuple with one entry per spatial dim, e.g. (2, 2); got {grid!r}")
    if all(isinstance(g, int) and g > 0 for g in grid) and math.prod(grid) * replicas != world.size:
        raise ValueError(f"grid {tuple(grid)} × replicas={replicas} is {math.prod(grid) * replicas} ranks but the world "
                         f"has {world.size}; prod(grid) * replicas must equal the world size")
    return validate_grid(grid, spatial), spatial


class SpmdModel:
    """A model trained by every rank of an SPMD world, each on its own shard (see the module doc)."""

    def __init__(self, model: nn.Module, world: SpmdWorld, grid, replicas: int = 1, check_finite: bool = False,
                 seed: int | None = None, compile: bool = False) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"parallelize expects a torch.nn.Module, got {type(model).__name__}")
        model, compiled = unwrap_compiled(model)
        world.check_usable()
        grid, spatial = check_layout(world, grid, replicas)
        self.planner = Planner(model, grid, spatial, check_finite)
        self.world, self.replicas, self.grid = world, replicas, grid
        self.training = model.training
        self._call = 0
        self.steps = 0
        self.optimizer_class: str | None = None
        self.mesh = world.mesh(replicas)
        self.stats = new_stats()
        rt = shard_runtime(self.mesh, world.device, world.timeout, self.stats, world.grad_group, world.checks,
                           Prefetcher())
        seed_t = torch.tensor([random_seed(seed)], dtype=torch.int64)
        dist.broadcast(seed_t, src=0)  # every rank draws with rank 0's seed
        self.engine = ShardEngine(model, rt, grad_group=world.grad_group, seed=int(seed_t.item()),
                                  compile=bool(compile) or compiled)
        self.model = self.engine.model
        self._structure: tuple | None = None  # the model's names and shapes, for ``agree``
        self._agreed: set[int] = set()  # fingerprints of the plans every rank agreed on
        with torch.no_grad():  # every rank starts from rank 0's weights, whatever its own seed made
            for t in [*self.model.parameters(), *self.model.buffers()]:
                dist.broadcast(t.data, src=0)

    @property
    def has_optimizer(self) -> bool:
        return self.engine.opt is not None

    @property
    def opt(self):
        return self.engine.opt

    def plan(self, x, loss_fn=None) -> Plan:
        """The plan of ``x``, agreed by every rank (``agree``)."""
        plan = self.planner.plan(x, self.training)
        agree(self, plan, x, loss_fn)
        return plan

    # -- this rank's part of a batch ----------------------------------------------------------------
    def _items(self, x) -> tuple[int, int]:
        """The images of the batch ``x`` (a tensor, or a list of sources) this rank's replica takes."""
        return batch_share(len(x) if is_source_batch(x) else x.shape[0], self.replicas, self.mesh.replica)

    def _shard_call(self, plan: Plan, x, y=None, loss_fn=None) -> shard_step.ShardCall:
        self._call += 1
        items, coord = self._items(x), coord_of(self.mesh.shard, plan.grid)
        return shard_step.shard_calls(self._call, plan, x, y, loss_fn, coords=[coord], items=items,
                                      check_finite=self.planner.check_finite)[0]

    # -- training API -----------------------------------------------------------------------------------
    def optimizer(self, cls: type, **kwargs) -> None:
        input_checks.check_optimizer_class(cls)
        self.engine.make_optimizer(cls, kwargs)
        self.optimizer_class = saving.class_name(cls)

    def _command(self, plan: Plan, x, y, loss_fn, **how) -> StepCommand:
        """A per-shard loss takes this rank's box of the targets; any other loss sees the whole batch's
        output on every rank (the driver mode gathers it on the driver instead)."""
        if self.planner.per_shard_loss(plan, x, y, loss_fn):
            shard = self._shard_call(plan, x, y, loss_fn)
            return StepCommand(shard, PerShardLoss(loss_fn), **how)
        shard = self._shard_call(plan, x)
        return StepCommand(shard, WholeOutputLoss(loss_fn, y, plan), **how)

    def train_step(self, x, y, loss_fn: Callable) -> float:
        if not self.has_optimizer:
            raise ValueError("call net.optimizer(torch.optim.SGD, lr=...) before train_step")
        plan = self.plan(x, loss_fn)
        cmd = self._command(plan, x, y, loss_fn)
        loss = shard_step.run(self.engine, cmd).loss
        self.steps += 1
        return float(loss)

    def gradients(self, x, y, loss_fn: Callable) -> tuple[float, torch.Tensor, dict]:
        """The loss, the whole input gradient and the summed parameter gradients, on every rank."""
        plan = self.plan(x, loss_fn)
        cmd = self._command(plan, x, y, loss_fn, grad="input", gradients=True)
        result = shard_step.run(self.engine, cmd)
        return float(result.loss), gather_dense(self.engine, plan.grid, result.input_grad), result.param_grads

    def __call__(self, x) -> torch.Tensor:
        """The full output, on every rank, without gradients."""
        plan = self.plan(x)
        out = shard_step.forward(self.engine, self._shard_call(plan, x), False)
        return plan.rebuild([gather_dense(self.engine, plan.grid, t) if shape is not None
                             else gather_heads(self.engine, t).cpu()
                             for t, (shape, _) in zip(output_leaves(out), plan.leaf_shapes())])

    def predict(self, x, out: str, *, overwrite: bool = False, max_chunk: int = 1024, keep="float",
                levels: int | None = None, mpp: float | None = None, classes=None) -> str:
        """Each rank writes its own output region into the zarr array at ``out`` (see the driver mode's:
        the same refusals, the same temporary sibling moved into place once every rank is done; ``keep``,
        ``.ome.zarr`` and ``.ome.tif`` as there: ``bigconv.prediction.predict_spmd``)."""
        from .. import prediction
        from ..data import outputs

        if keep != "float" or levels is not None or prediction.output_format(out) != "zarr":
            return prediction.predict_spmd(self, x, out, overwrite=overwrite, max_chunk=max_chunk, keep=keep,
                                           levels=levels, mpp=mpp, classes=classes)

        plan = self.plan(x)
        chunks, dtype = self.planner.prediction(plan, x, max_chunk)
        inputs = [s.path for s in x] if is_source_batch(x) else []
        path = tmp = refused = None
        if self.world.rank == 0:  # one rank checks and creates, so the file system is asked once
            try:
                path = outputs.check_out(out, inputs, overwrite)
                tmp = outputs.begin(path, plan.out_full_shape, chunks, dtype)
            except (ValueError, OSError) as exc:
                refused = f"{type(exc).__name__}: {exc}"
        # Every rank gets rank 0's answer: a refusal is the same ValueError everywhere, not an error on
        # rank 0 and a closed connection on the others.
        shared = [(path, tmp, refused)]
        dist.broadcast_object_list(shared, src=0)
        path, tmp, refused = shared[0]
        if refused:
            raise ValueError(f"predict refused on rank 0: {refused}")
        failure = None
        try:
            result = shard_step.forward(self.engine, self._shard_call(plan, x), False)
            box = shard_box(plan.out_shape, plan.grid, coord_of(self.mesh.shard, plan.grid))
            outputs.write(tmp, box_index(box, result.dim(), self._items(x)), result.cpu().numpy())
        except Exception as exc:
            failure = f"{type(exc).__name__}: {exc}"
        failures = [None] * self.world.size
        dist.all_gather_object(failures, failure)  # collective assert: every rank learns who failed, and why
        bad = [(r, f) for r, f in enumerate(failures) if f]
        if bad:
            if self.world.rank == 0:
                outputs.abandon(tmp)
            raise WorkerFailure(f"predict failed on rank {bad[0][0]}: {bad[0][1]}; {out!r} is as it was")
        if self.world.rank == 0:
            outputs.finish(tmp, path)
        self.world.barrier()
        return path

    def capture(self, layers, x, y=None, loss_fn: Callable | None = None, target=None) -> dict:
        """The driver mode's ``capture``, on every rank (``bigconv.capture``; replicas=1)."""
        from .. import capture

        return capture.capture_spmd(self, layers, x, y, loss_fn, target)

    def prefetch(self, x, y=None, loss_fn=None) -> None:
        """Start reading this rank's boxes of the next call's sources (``x``, and ``y`` when they are
        sources too) in a background thread while the current call computes; that call must then get
        the same arguments. Tensors need nothing: this returns at once for them. No message is sent."""
        if not (is_source_batch(x) or is_source_batch(y)):
            return
        plan = self.planner.plan(x, self.training)  # unchecked by the other ranks: the call taking the reads agrees
        y_reads = y if is_source_batch(y) and plan.out_shape is not None else None
        shard = shard_step.shard_calls(0, plan, x, y_reads, loss_fn, coords=[coord_of(self.mesh.shard, plan.grid)],
                                       items=self._items(x), check_finite=self.planner.check_finite)[0]
        self.engine.rt.reads.start([r for r in (shard.x, shard.target) if isinstance(r, ShardRead)])

    # -- state --------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return self.engine.state_dict()

    def replica_state_dicts(self, workers: int | None = None) -> list[dict]:
        parts = [None] * self.world.size
        dist.all_gather_object(parts, self.state_dict())
        return parts[: workers or self.world.size]

    def save(self, path, extra: dict | None = None) -> str:
        """Rank 0 writes the file (the driver mode's format, ``extra`` included); every rank returns once
        it is on disk."""
        rngs = [None] * self.world.size
        dist.all_gather_object(rngs, rng_state(torch.device("cpu")))
        if self.world.rank == 0:
            ck = saving.checkpoint(self.state_dict(), self.engine.optimizer_state(), self.optimizer_class, self.steps, rngs, self.world.size,
                                   grid=list(self.grid) if self.grid else None, extra=extra or {})
            saving.atomic_save(ck, path)
        self.world.barrier()
        return str(path)

    def load(self, path) -> "SpmdModel":
        path = str(path)
        ck = saving.read(path)
        self.planner.check_checkpoint(ck, self.optimizer_class, path)
        self.engine.load(ck["model"], ck.get("optimizer"))
        if ck.get("workers") == self.world.size:
            set_rng_state(ck["rng"]["workers"][self.world.rank], torch.device("cpu"))
        self.steps = int(ck.get("step", 0))
        return self

    def train(self, mode: bool = True) -> "SpmdModel":
        self.training = mode
        self.model.train(mode)
        return self

    def eval(self) -> "SpmdModel":
        return self.train(False)

