"""``parallelize`` on an SPMD world: a ``torch.nn.Module`` every rank calls with the same arguments.

Each rank validates everything the driver would (types, grid, the dry run on meta tensors) before its
first message, so bad input raises the same ``ValueError`` on every rank and nobody is left waiting.
Then it runs its own shard of its replica's slice of the batch; no tensor the size of the batch is
sent anywhere.

- **The native loop** (DDP's habits): ``net(x)`` returns this rank's share of the output with autograd,
  and ``loss.backward()`` leaves every parameter's ``.grad`` equal to one process's gradient (summed in
  buckets while backward runs, ``bigconv.spmd.native``); the user's own optimizer, scheduler,
  ``clip_grad_norm_``, ``no_sync()``, ``torch.autocast`` and EMA work as on one process. Losses:
  ``net.shard_loss`` (a loss computed per shard, its value the whole batch's) and ``net.whole_loss``
  (any loss, on the whole batch's output gathered on every rank). ``net.named_parameters()`` and
  ``net.state_dict()`` are the plain model's (its names, no prefix); ``net.module`` is the plain model.
- ``train_step`` (one call: forward, loss, backward, sum and optimizer step) returns the same loss on
  every rank; ``net.full(x)`` returns the full output on every rank (gathered; use ``predict`` for
  outputs too large for that).
- A loss per shard (``bigconv.losses``) is ``sum(numerators) / sum(denominators)`` over every rank; any
  other loss sees the replicated output of the whole batch (replicas exchange their heads) and its
  gradient is taken once per replica, on shard 0 (the other shards' copies pass zero gradients, so
  their halo exchanges still run).
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import input_checks
from .. import losses as shard_losses
from .. import saving
from .agreement import agree
from .native import GradSync, Sink
from ..data.prefetch import Prefetcher
from ..data.sources import ShardRead, is_source_batch
from ..engine import step as shard_step
from ..engine.step import PerShardLoss, StepCommand, WholeOutputLoss, gather_dense, gather_heads
from ..geometry.boxes import batch_share, box_index, box_size, coord_of, shard_box, validate_grid
from ..engine.executor import join_shards
from ..engine.plan import Plan, output_leaves
from ..planning import Planner
from ..saving import rng_state, set_rng_state
from ..engine.shard import ShardEngine
from ..ops.random import draws_problem, draws_to_load, random_seed, saved_draws
from ..ops.support import unwrap_compiled
from ..transport import new_stats
from ..transport.p2p import shard_runtime
from ..runtime import spmd_outputs
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


class SpmdModel(nn.Module):
    """A model trained by every rank of an SPMD world, each on its own shard (see the module doc)."""

    def __init__(self, model: nn.Module, world: SpmdWorld, grid, replicas: int = 1, check_finite: bool = False,
                 seed: int | None = None, compile: bool = False) -> None:
        super().__init__()
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
        self.optimizer_groups: list[int] | None = None
        self.epoch: int | None = None
        self.mesh = world.mesh(replicas)
        self.stats = new_stats()
        rt = shard_runtime(self.mesh, world.device, world.timeout, self.stats, world.grad_group, world.checks,
                           Prefetcher())
        self._seed_given = seed is not None  # every rank gets the same arguments
        seed_t = torch.tensor([random_seed(seed)], dtype=torch.int64)
        dist.broadcast(seed_t, src=0)  # every rank draws with rank 0's seed
        self.engine = ShardEngine(model, rt, grad_group=world.grad_group, seed=int(seed_t.item()),
                                  compile=bool(compile) or compiled)
        # The plain model's own tables, shared: state_dict, load_state_dict, named_parameters and train() see its
        # names with no wrapper prefix, here and inside a LightningModule that holds this module.
        self.__dict__["_plain"] = self.engine.model
        self._parameters, self._buffers, self._modules = (self.engine.model._parameters, self.engine.model._buffers,
                                                          self.engine.model._modules)
        self.replica_batches = False
        """True where a sampler splits the data over replicas (``bigconv.lightning``): ``x`` holds this replica's
        images only, and ``net(x)`` returns the replica's whole output (``gather``), so any loss is the
        replica's."""
        self._sync = GradSync(self.engine)
        self._last: tuple[Plan, int] | None = None  # the plan and batch size of the last native forward
        self._structure: tuple | None = None  # the model's names and shapes, for ``agree``
        self._agreed: set[int] = set()  # fingerprints of the plans every rank agreed on
        with torch.no_grad():  # every rank starts from rank 0's weights, whatever its own seed made
            for t in [*self.model.parameters(), *self.model.buffers()]:
                dist.broadcast(t.data, src=0)

    @property
    def module(self) -> nn.Module:
        """The plain model (this rank's copy)."""
        return self.__dict__["_plain"]

    @property
    def model(self) -> nn.Module:
        return self.module

    def train(self, mode: bool = True) -> "SpmdModel":
        super().train(mode)
        self.module.training = mode
        return self

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
        return self._share(len(x) if is_source_batch(x) else x.shape[0])

    def _share(self, images: int) -> tuple[int, int]:
        return (0, images) if self.replica_batches else batch_share(images, self.replicas, self.mesh.replica)

    def _shard_call(self, plan: Plan, x, y=None, loss_fn=None) -> shard_step.ShardCall:
        self._call += 1
        items, coord = self._items(x), coord_of(self.mesh.shard, plan.grid)
        return shard_step.shard_calls(self._call, plan, x, y, loss_fn, coords=[coord], items=items,
                                      check_finite=self.planner.check_finite)[0]

    # -- the native loop ----------------------------------------------------------------------------------
    def forward(self, x, *, shape: tuple[int, ...] | None = None):
        """This rank's share of the output, with autograd (the native loop; see the module doc).

        ``x``: the whole batch (every rank passes the same; each cuts its share), a list of image
        sources (each rank reads its own box), or, with ``shape`` (the whole batch's), this rank's share
        of the batch as ``net.cut_input`` would cut it. A dense output is this rank's box of its
        replica's images; a replicated one (a head) its replica's images, equal on the replica's shards."""
        if shape is not None:
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"with shape=, x must be this rank's share of the batch as a tensor, got "
                                 f"{type(x).__name__}")
            whole = torch.empty(tuple(shape), dtype=x.dtype, device="meta")
            plan = self.plan(whole)
            shard = self._local_call(plan, x, tuple(shape))
        else:
            whole = x
            plan = self.plan(x)
            shard = self._shard_call(plan, x)
        self._last = (plan, len(x) if is_source_batch(x) else whole.shape[0])
        grad = torch.is_grad_enabled()
        out = shard_step.forward(self.engine, shard, grad)
        out = self._sink(plan, out) if grad else out
        return self.gather(out) if self.replica_batches else out

    def _local_call(self, plan: Plan, x: torch.Tensor, whole: tuple[int, ...]) -> shard_step.ShardCall:
        """The call on ``x``, this rank's share of a batch of shape ``whole``, checked to be that share."""
        lo, hi = self._share(whole[0])
        box = shard_box(plan.in_shape, plan.grid, coord_of(self.mesh.shard, plan.grid))
        expected = (hi - lo, whole[1], *box_size(box))
        if tuple(x.shape) != expected:
            raise ValueError(f"x has shape {tuple(x.shape)} but this rank's share of a batch of shape {whole} is "
                             f"{expected} (images {lo}:{hi}, box {box}); pass the whole batch without shape=, or "
                             "cut it with net.cut_input(x)")
        self._call += 1
        return shard_step.ShardCall(self._call, plan.grid, plan.in_shape, x)

    def cut_input(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the whole batch ``x`` (what ``net(share, shape=x.shape)`` takes)."""
        plan = self.planner.plan(x, self.training)
        box = shard_box(plan.in_shape, plan.grid, coord_of(self.mesh.shard, plan.grid))
        return x[box_index(box, x.dim(), self._items(x))]

    def _sink(self, plan: Plan, out):
        """Route the outputs through ``Sink``: the end of the gradient sum, and one counted copy of each
        replicated output per replica. Inside ``no_sync`` the buckets are disarmed instead of armed."""
        leaves = output_leaves(out)
        live = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not live:
            return out
        if self._sync.enabled:
            self._sync.arm()
        else:
            self.engine.buckets.reset()
            self._sync.pending = False
        shapes = plan.leaf_shapes()
        count = tuple(shapes[i][0] is not None or self.mesh.shard == 0 for i in live)
        routed = Sink.apply(self._sync if self._sync.enabled else None, count, *[leaves[i] for i in live])
        leaves = list(leaves)
        for i, t in zip(live, routed):
            leaves[i] = t
        return plan.rebuild(leaves)

    @contextlib.contextmanager
    def no_sync(self):
        """Forwards inside accumulate their gradients locally; the next synced backward sums them all
        (DDP's ``no_sync``). Every rank must use it alike."""
        before = self._sync.enabled
        self._sync.enabled = False
        try:
            yield
        finally:
            self._sync.enabled = before

    def _last_plan(self, what: str) -> tuple[Plan, int]:
        if self._last is None:
            raise ValueError(f"net.{what} reads the layout of the last forward: call out = net(x) first")
        return self._last

    def cut(self, y):
        """This rank's share of targets ``y`` for the last forward's output: ``y`` of the whole batch is cut
        (its box of the output, its replica's images); ``y`` already of this rank's share is returned."""
        plan, n = self._last_plan("cut")
        if not isinstance(y, torch.Tensor):
            raise ValueError(f"targets must be a tensor, got {type(y).__name__}")
        items = self._share(n)
        if plan.several:
            raise ValueError("cut takes the targets of one output; this model returns several: use net.whole_loss")
        if plan.out_shape is None:  # a replicated head: the replica's images
            if y.dim() >= 1 and y.shape[0] == n:
                return y[slice(*items)]
            if y.dim() >= 1 and y.shape[0] == items[1] - items[0]:
                return y
            raise ValueError(f"targets of shape {tuple(y.shape)} fit neither the batch ({n} images) nor this "
                             f"replica's share ({items[1] - items[0]})")
        d = len(plan.grid)
        box = shard_box(plan.out_shape, plan.grid, coord_of(self.mesh.shard, plan.grid))
        got = (y.shape[0], *y.shape[-d:]) if y.dim() > d else None
        if got == (n, *plan.out_shape):
            return y[box_index(box, y.dim(), items)]
        if got == (items[1] - items[0], *box_size(box)):
            return y
        raise ValueError(f"targets of shape {tuple(y.shape)} fit neither the whole output (batch {n}, spatial "
                         f"{tuple(plan.out_shape)}) nor this rank's share (batch {items[1] - items[0]}, spatial "
                         f"{box_size(box)})")

    def shard_loss(self, loss_fn: nn.Module, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """A loss computed per shard (``bigconv.losses``: MSELoss, L1Loss, BCEWithLogitsLoss, CrossEntropyLoss
        with mean or sum) of this rank's output ``out``: its value is the whole batch's loss on every rank,
        its gradient this rank's part (``sum(numerators) / sum(denominators)`` over every rank). ``y``: the
        whole batch's targets or this rank's share (``cut``)."""
        plan, _ = self._last_plan("shard_loss")
        if plan.several or plan.out_shape is None or not shard_losses.is_dense(loss_fn, len(plan.grid)):
            raise ValueError("shard_loss takes a loss computed per shard (MSELoss, L1Loss, BCEWithLogitsLoss, "
                             "CrossEntropyLoss with mean or sum reduction) of one dense output; use "
                             "net.whole_loss(loss_fn, out, y) for any other loss or output")
        local, whole = self.engine.dense_loss(loss_fn, out, self.cut(y))
        return _Valued.apply(local, whole.to(local.dtype))

    def gather(self, out):
        """The whole batch's output on every rank, from this rank's share ``out``: only this rank's part
        carries gradient, so a loss every rank computes alike on it sums to one process's gradient."""
        plan, _ = self._last_plan("gather")
        if self.replica_batches:  # the replica's own images: its shards only
            joined = [self._gather_replica(plan, t) if shape is not None else t
                      for t, (shape, _) in zip(output_leaves(out), plan.leaf_shapes())]
        else:
            joined = [gather_dense(self.engine, plan.grid, t, live=True) if shape is not None
                      else gather_heads(self.engine, t)
                      for t, (shape, _) in zip(output_leaves(out), plan.leaf_shapes())]
        return plan.rebuild(joined)

    def _gather_replica(self, plan: Plan, local: torch.Tensor) -> torch.Tensor:
        parts: list = [None] * self.mesh.spatial
        dist.all_gather_object(parts, local.detach().cpu(), group=self.mesh.spatial_group)
        parts = [p.to(local.device) for p in parts]
        parts[self.mesh.shard] = local
        return join_shards(parts, plan.grid)

    def whole_loss(self, loss_fn: Callable, out, y) -> torch.Tensor:
        """Any loss, on the whole batch's output (``gather``) against the whole batch's targets ``y``: the
        same value on every rank; every rank backpropagates it."""
        loss = loss_fn(self.gather(out), y)
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
            raise ValueError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
        return loss

    # -- training API -----------------------------------------------------------------------------------
    def optimizer(self, cls, /, *, scheduler: Callable | None = None, clip_grad_norm: float | None = None,
                  **kwargs) -> None:
        """``train_step``'s optimizer (the driver mode's arguments: a class and its arguments, or a factory
        ``named_parameters -> Optimizer``; a scheduler factory; ``clip_grad_norm``). The native loop needs
        none: make your own over ``net.parameters()``."""
        spec = input_checks.optimizer_spec(self.planner.meta, cls, kwargs, scheduler, clip_grad_norm)
        made = self.engine.make_optimizer(**spec)
        self.optimizer_class, self.optimizer_groups = made["class"], made["groups"]

    def _command(self, plan: Plan, x, y, loss_fn, **how) -> StepCommand:
        """A per-shard loss takes this rank's box of the targets; any other loss sees the whole batch's
        output on every rank (the driver mode gathers it on the driver instead)."""
        if self.planner.per_shard_loss(plan, x, y, loss_fn):
            shard = self._shard_call(plan, x, y, loss_fn)
            return StepCommand(shard, PerShardLoss(loss_fn), **how)
        shard = self._shard_call(plan, x)
        return StepCommand(shard, WholeOutputLoss(loss_fn, y, plan), **how)

    def train_step(self, x, y, loss_fn: Callable, *, step: bool = True) -> float:
        """Forward, loss, backward, the gradient sum and the optimizer step; ``step=False`` keeps the
        gradients, unsummed, for the next call (accumulation)."""
        if not self.has_optimizer:
            raise ValueError("call net.optimizer(torch.optim.SGD, lr=...) before train_step")
        plan = self.plan(x, loss_fn)
        cmd = self._command(plan, x, y, loss_fn, accumulate=not step)
        loss = shard_step.run(self.engine, cmd).loss
        self.steps += int(step)
        return float(loss)

    def gradients(self, x, y, loss_fn: Callable) -> tuple[float, torch.Tensor, dict]:
        """The loss, the whole input gradient and the summed parameter gradients, on every rank."""
        plan = self.plan(x, loss_fn)
        cmd = self._command(plan, x, y, loss_fn, grad="input", gradients=True)
        result = shard_step.run(self.engine, cmd)
        return float(result.loss), gather_dense(self.engine, plan.grid, result.input_grad), result.param_grads

    def full(self, x) -> torch.Tensor:
        """The full output, on every rank, without gradients (gathered on the CPU)."""
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

        return prediction.predict_spmd(self, x, out, overwrite=overwrite, max_chunk=max_chunk, keep=keep,
                                       levels=levels, mpp=mpp, classes=classes)

    def capture(self, layers, x, y=None, loss_fn: Callable | None = None, target=None, *, out=None,
                overwrite: bool = False) -> dict:
        """The driver mode's ``capture``, on every rank (``bigconv.capture``; replicas=1); with ``out=``
        every rank writes its own parts into the zarr group (``bigconv.capture.capture_spmd``)."""
        from .. import capture

        return capture.capture_spmd(self, layers, x, y, loss_fn, target, out=out, overwrite=overwrite)

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
    def replica_state_dicts(self, workers: int | None = None) -> list[dict]:
        parts = [None] * self.world.size
        with self.engine.naming_lost_ranks("gathering the replicas' weights"):
            dist.all_gather_object(parts, self.engine.state_dict())
        return parts[: workers or self.world.size]

    def replica_optimizer_states(self, workers: int | None = None) -> list[dict | None]:
        """Every rank's optimizer state (``Optimizer.state_dict()``, on the CPU; None without an optimizer),
        gathered on every rank."""
        parts = [None] * self.world.size
        with self.engine.naming_lost_ranks("gathering the replicas' optimizer states"):
            dist.all_gather_object(parts, self.engine.optimizer_state())
        return parts[: workers or self.world.size]

    def save(self, path, extra: dict | None = None, epoch: int | None = None) -> str:
        """Rank 0 writes the file (the driver mode's format, ``extra``, the scheduler's state, ``epoch`` and the
        random draws' seed and forward count included); every rank returns once it is on disk, or raises
        ``WorkerFailure("save of PATH failed on rank 0: ...")`` with rank 0's error (a full disk, a folder it
        cannot make) as soon as rank 0 met it."""
        epoch = epoch if epoch is not None else self.epoch
        # What load could not read back is refused on every rank alike, before any message (rank 0 alone would
        # leave the others at the barrier).
        extra, epoch = saving.plain(extra or {}, "extra"), saving.plain(epoch, "epoch")
        parts = [None] * self.world.size
        with self.engine.naming_lost_ranks("save: gathering the ranks' generator states"):
            dist.all_gather_object(parts, (rng_state(torch.device("cpu")), self.engine.draws_state()))
        self.epoch = epoch

        def write() -> None:  # on rank 0 only; every rank learns how it went
            ck = saving.checkpoint(self.engine.state_dict(), self.engine.optimizer_state(), self.optimizer_class,
                                   self.steps, [rng for rng, _ in parts], self.world.size,
                                   grid=list(self.grid) if self.grid else None, extra=extra,
                                   scheduler=self.engine.scheduler_state(), epoch=self.epoch,
                                   draws=saved_draws([d for _, d in parts]))
            saving.atomic_save(ck, path)

        spmd_outputs.done_by_rank_zero(self.world, self.engine, write, f"save of {str(path)!r}")
        return str(path)

    def load(self, path) -> "SpmdModel":
        """Every rank reads the file and restores what ``save`` wrote (the driver mode's ``load``: the random
        draws' seed and forward count on any grid, torch's generator states on the same world size)."""
        path = str(path)
        ck = saving.read(path)
        self.planner.check_checkpoint(ck, self.optimizer_class, path, self.optimizer_groups)
        saving.check_scheduler_state(ck.get("scheduler"), self.engine.scheduler is not None, path)
        draws = draws_to_load(ck.get("draws"), self.engine.random.seed, self._seed_given, path, self.module)
        self.engine.load(ck["model"], ck.get("optimizer"), ck.get("scheduler"), draws=draws)
        if ck.get("workers") == self.world.size:
            set_rng_state(ck["rng"]["workers"][self.world.rank], torch.device("cpu"))
        self.steps = int(ck.get("step", 0))
        self.epoch = ck.get("epoch")
        return self

    # -- the random draws' state, for checkpoints of your own loop --------------------------------------------
    def draws_state(self) -> dict:
        """The random draws' seed and forward count, ``{"seed": int, "forwards": int}``: what a checkpoint of
        your own loop keeps beside ``state_dict()`` (which holds the plain model's tensors only, so it still
        loads into an undecomposed model) for ``load_draws_state`` to resume the dropout and drop-path masks
        where they stopped. Plain ints (``torch.load(weights_only=True)`` reads them back); the same on every
        rank and read without communication, so rank 0 alone may call it inside ``if rank == 0: torch.save``."""
        return self.engine.draws_state()

    def load_draws_state(self, state: dict) -> None:
        """Continue the random draws where ``state`` (the saved run's ``draws_state()``) stopped: the next
        forward draws what the saved run's next forward would have drawn. Its seed replaces this model's, as
        ``torch.set_rng_state`` replaces what ``manual_seed`` set. Every rank calls it with the same dict (the
        rest of SPMD's habit; one ``all_gather_object`` checks it): a malformed dict on any rank, or ranks
        given different ones, is a ``ValueError`` on every rank before any rank changes."""
        problem = draws_problem(state)
        every = [None] * self.world.size
        with self.engine.naming_lost_ranks("load_draws_state: checking the ranks' states"):
            dist.all_gather_object(every, (dict(state) if problem is None else None, problem))
        bad = [(rank, p) for rank, (_, p) in enumerate(every) if p is not None]
        if bad:
            raise ValueError(f"load_draws_state: rank {bad[0][0]}'s state is malformed: {bad[0][1]}; pass what "
                             "net.draws_state() returned when the checkpoint was written (e.g. ck[\"draws\"])")
        differing = [rank for rank, (s, _) in enumerate(every) if s != every[0][0]]
        if differing:
            raise ValueError(f"load_draws_state: rank {differing[0]} was given {every[differing[0]][0]}, rank 0 "
                             f"{every[0][0]}; every rank must restore the same state (read the same checkpoint)")
        self.engine.random.restore(state)



class _Valued(torch.autograd.Function):
    """``value`` forward, the gradient to ``part``: a loss whose value is the whole batch's and whose
    gradient is this rank's part of it."""

    @staticmethod
    def forward(ctx, part, value):
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None
