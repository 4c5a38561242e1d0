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
from dataclasses import replace
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree

from .. import input_checks as checks
from .. import saving
from .agreement import agree
from ..data import prefetch
from ..data.sources import SourceBatch, ShardRead, class_index_targets, is_source_batch
from ..engine.executor import join_shards
from ..geometry.boxes import balanced_bounds, coord_of, shard_box, validate_grid
from ..planning import Plan, Planner, output_leaves
from ..saving import rng_state, set_rng_state
from ..engine.step import ShardEngine
from ..ops.random import random_seed
from ..ops.support import unwrap_compiled
from ..transport import WorkerFailure, WorkerRuntime, new_stats
from ..transport.p2p import P2PLink
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
        rt = WorkerRuntime(index=self.mesh.shard, workers=self.mesh.spatial, device=world.device,
                           timeout=world.timeout, stats=self.stats, grad_group=world.grad_group, checks=world.checks)
        wire = dict(device=world.device, tag_free=world.checks.tag_free)
        rt.link = P2PLink(self.mesh.spatial_group, self.mesh.spatial_ranks, self.mesh.shard, world.timeout,
                          self.stats, **wire)
        if replicas > 1:
            rt.replica, rt.replicas = self.mesh.replica, replicas
            rt.replica_link = P2PLink(self.mesh.replica_group, self.mesh.replica_ranks, self.mesh.replica,
                                      world.timeout, self.stats, **wire)
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
    def _my_items(self, n: int) -> tuple[int, int]:
        if n < self.replicas:
            raise ValueError(f"the batch has {n} images for {self.replicas} replicas; give every replica at least "
                             "one image (a larger batch, or fewer replicas)")
        return balanced_bounds(n, self.replicas)[self.mesh.replica]

    def _coord(self, grid):
        return coord_of(self.mesh.shard, grid)

    def _input_read(self, plan, x) -> ShardRead:
        lo, hi = self._my_items(len(x))
        return ShardRead(tuple(x)[lo:hi], shard_box(plan.in_shape, plan.grid, self._coord(plan.grid)),
                         check_finite=self.planner.check_finite)

    def _target_read(self, plan, y, loss_fn) -> ShardRead:
        lo, hi = self._my_items(len(y))
        return ShardRead(tuple(y)[lo:hi], shard_box(plan.out_shape, plan.grid, self._coord(plan.grid)),
                         class_index_targets(SourceBatch(y), loss_fn), self.planner.check_finite)

    def _read(self, read: ShardRead) -> torch.Tensor:
        return prefetch.take_or_read(read, self.world.timeout, self.stats)

    def _local_input(self, plan, x) -> torch.Tensor:
        if is_source_batch(x):
            return self._read(self._input_read(plan, x))
        lo, hi = self._my_items(x.shape[0])
        box = shard_box(plan.in_shape, plan.grid, self._coord(plan.grid))
        index = (slice(lo, hi), slice(None)) + tuple(slice(a, b) for a, b in box)
        return x.detach()[index].contiguous()

    def _local_target(self, plan, y, loss_fn) -> torch.Tensor:
        if is_source_batch(y):
            return self._read(self._target_read(plan, y, loss_fn))
        lo, hi = self._my_items(y.shape[0])
        box = shard_box(plan.out_shape, plan.grid, self._coord(plan.grid))
        lead = (slice(lo, hi),) + (slice(None),) * (y.dim() - len(plan.grid) - 1)
        return y[lead + tuple(slice(a, b) for a, b in box)]

    def _forward(self, plan, x_local: torch.Tensor, grad: bool) -> torch.Tensor:
        self._call += 1
        return self.engine.forward(plan.grid, plan.in_shape, x_local, grad, self._call)

    def _whole_batch_head(self, out: torch.Tensor) -> torch.Tensor:
        """The replicated outputs of every replica, joined in batch order; only this replica's part
        carries gradient (each replica's shard 0 takes the loss's gradient for its own images)."""
        if self.replicas == 1:
            return out
        parts = [None] * self.replicas
        dist.all_gather_object(parts, out.detach().cpu(), group=self.mesh.replica_group)
        parts = [out if i == self.mesh.replica else p.to(out.device) for i, p in enumerate(parts)]
        return torch.cat(parts)

    # -- training API -----------------------------------------------------------------------------------
    def optimizer(self, cls: type, **kwargs) -> None:
        checks.check_optimizer_class(cls)
        self.engine.make_optimizer(cls, kwargs)
        self.optimizer_class = saving.class_name(cls)

    def _loss_and_backward(self, plan, x, y, loss_fn, grad) -> torch.Tensor:
        dense = self.planner.per_shard_loss(plan, x, y, loss_fn)
        out = self._forward(plan, self._local_input(plan, x), grad)
        if dense:
            target = self._local_target(plan, y, loss_fn)
            if is_source_batch(y):
                self.engine.check_labels(loss_fn, out, target)
            part, loss = self.engine.dense_loss(loss_fn, out, target)
            part.backward()
            return loss
        if plan.several:
            return self._structured_loss(plan, out, y, loss_fn)
        dense_map = plan.out_shape is not None
        # A loss not computed per shard sees the whole batch's map on every rank, only this rank's shard
        # carrying gradient: every rank backpropagates the same loss, so the sum over ranks is the
        # single-process gradient (the driver mode gathers the map on the driver instead).
        whole = self._gather_dense(plan, out, live=True) if dense_map else self._whole_batch_head(out)
        loss = loss_fn(whole, y.to(out.device))
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
            raise ValueError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
        if dense_map or self.mesh.shard == 0:
            loss.backward()
        else:  # same graph, zero gradient: the halo exchanges of backward still need this rank
            out.backward(torch.zeros_like(out))
        return loss.detach()

    def _structured_loss(self, plan, out, y, loss_fn) -> torch.Tensor:
        """Several outputs, each joined as one would be (a dense map gathered with this rank's part live;
        a replicated one live on shard 0 only), the loss over their structure, one backward."""
        outs = output_leaves(out)
        joined, idle = [], []
        for t, (shape, _) in zip(outs, plan.outputs):
            if shape is not None:
                joined.append(self._gather_dense(plan, t, live=True))
            elif self.mesh.shard == 0 or not t.requires_grad:
                joined.append(self._whole_batch_head(t))
            else:  # this rank's copy counts once, on shard 0; a zero gradient still runs its exchanges
                joined.append(self._whole_batch_head(t.detach()))
                idle.append(t)
        loss = loss_fn(plan.rebuild(joined), pytree.tree_map(lambda t: t.to(outs[0].device), y))
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
            raise ValueError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
        roots = ([loss] if loss.requires_grad else []) + idle
        if roots:
            torch.autograd.backward(roots, [None] * (len(roots) - len(idle)) + [torch.zeros_like(t) for t in idle])
        return loss.detach()

    def train_step(self, x, y, loss_fn: Callable) -> float:
        if not self.has_optimizer:
            raise ValueError("call net.optimizer(torch.optim.SGD, lr=...) before train_step")
        plan = self.plan(x, loss_fn)
        self.engine.begin()
        try:
            loss = self._loss_and_backward(plan, x, y, loss_fn, True)
        except BaseException:
            self.engine.abort()
            raise
        self.engine.end(step=True)
        self.steps += 1
        return float(loss)

    def gradients(self, x, y, loss_fn: Callable) -> tuple[float, torch.Tensor, dict]:
        """The loss, the whole input gradient and the summed parameter gradients, on every rank."""
        plan = self.plan(x, loss_fn)
        self.engine.begin()
        try:
            loss = self._loss_and_backward(plan, x, y, loss_fn, "input")
        except BaseException:
            self.engine.abort()
            raise
        self.engine.end(step=False)
        params = self.engine.param_grads()
        return float(loss), self._gather_dense(plan, self.engine.input_grad()), params

    def _gather_dense(self, plan, local: torch.Tensor, grid=None, live: bool = False) -> torch.Tensor:
        """Every rank's shard, joined into the whole batch on every rank (on the CPU); with ``live``, on
        ``local``'s device with this rank's own part ``local`` itself, so it carries gradient."""
        parts = [None] * self.world.size
        dist.all_gather_object(parts, local.detach().cpu())
        if live:
            parts = [p.to(local.device) for p in parts]
            parts[self.world.rank] = local
        s = self.mesh.spatial
        replicas = [join_shards(parts[r * s:(r + 1) * s], grid or plan.grid) for r in range(self.replicas)]
        return torch.cat(replicas)

    def __call__(self, x) -> torch.Tensor:
        """The full output, on every rank, without gradients."""
        plan = self.plan(x)
        out = self._forward(plan, self._local_input(plan, x), False)
        if plan.several:
            return plan.rebuild([self._whole(replace(plan, outputs=(), spec=None, out_shape=shape), t)
                                 for t, (shape, _) in zip(output_leaves(out), plan.outputs)])
        return self._whole(plan, out)

    def _whole(self, plan, out: torch.Tensor) -> torch.Tensor:
        """One output tensor of every rank, whole, on every rank."""
        if plan.out_shape is not None:
            return self._gather_dense(plan, out)
        if self.replicas == 1:
            return out.cpu()
        parts = [None] * self.replicas
        dist.all_gather_object(parts, out.cpu(), group=self.mesh.replica_group)
        return torch.cat(parts)

    def predict(self, x, out: str, *, overwrite: bool = False, max_chunk: int = 1024) -> str:
        """Each rank writes its own output region into the zarr array at ``out`` (see the driver mode's:
        the same refusals, the same temporary sibling moved into place once every rank is done)."""
        from ..data import outputs

        plan = self.plan(x)
        if plan.several:
            raise ValueError(f"predict writes one dense map, but this model returns {len(plan.outputs)} outputs; "
                             "use net(x) for them, or predict with a wrapper returning the one map to write")
        if plan.out_shape is None:
            raise ValueError("predict writes a dense map, but this model's output is one vector per image; use net(x)")
        chunks = outputs.aligned_chunks(plan.out_shape, plan.grid, max_chunk)
        dtype = str(x.dtype if isinstance(x, torch.Tensor) else SourceBatch(x).dtype).replace("torch.", "")
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
            result = self._forward(plan, self._local_input(plan, x), False)
            lo, hi = self._my_items(len(x) if is_source_batch(x) else x.shape[0])
            box = shard_box(plan.out_shape, plan.grid, self._coord(plan.grid))
            outputs.write(tmp, (slice(lo, hi), slice(None)) + tuple(slice(a, b) for a, b in box), result.cpu().numpy())
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

    def prefetch(self, x, y=None, loss_fn=None) -> None:
        """Start reading this rank's boxes of the next call's sources (``x``, and ``y`` when they are
        sources too) in a background thread while the current call computes; that call must then get
        the same arguments. Tensors need nothing: this returns at once for them. No message is sent."""
        reads = []  # the plan unchecked by the other ranks: the call that takes these reads agrees on it
        if is_source_batch(x):
            reads.append(self._input_read(self.planner.plan(x, self.training), x))
        if is_source_batch(y):
            plan = self.planner.plan(x, self.training)
            if plan.out_shape is not None:
                reads.append(self._target_read(plan, y, loss_fn))
        prefetch.start(reads)

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

