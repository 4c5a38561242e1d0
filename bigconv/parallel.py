"""``bigconv.parallelize``: a plain ``torch.nn`` model, trained on a World, exactly.

The driver validates everything it can before any remote work: input rank, grid, image size and
every operation of every layer in a dry run on meta tensors at the first call with a new input
shape (there is no list of module types: the dry run decides).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Callable

import torch
import torch.nn as nn

from . import input_checks
from . import losses, saving
from .data.sources import ShardRead, is_source_batch
from .engine.executor import join_shards
from .engine.step import OutputGradients, PerShardLoss, ShardCall, StepCommand, shard_calls
from .geometry.boxes import validate_grid
from .engine.plan import Plan
from .planning import Planner
from .runtime.model_part import TRANSPORTS, ModelPart, to_payload
from .ops.random import draws_problem, draws_to_load, random_seed, saved_draws
from .ops.support import unwrap_compiled
from .transport import WorkerFailure
from .runtime.world import World

P2P_SETTLE_S = 5.0
"""After a worker fails on the p2p transport, how long the others may take to finish before the World
counts as broken."""


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

    def __init__(self, model: nn.Module, world: World, grid: tuple[int, ...] | None, check_finite: bool = False,
                 transport: str = "p2p", seed: int | None = None, compile: bool = False) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"parallelize expects a torch.nn.Module, got {type(model).__name__}")
        model, compiled = unwrap_compiled(model)
        self.compile = bool(compile) or compiled
        if not isinstance(world, World):
            raise ValueError(f"parallelize expects a bigconv.World, got {type(world).__name__}")
        check_transport(transport)
        world.check_usable()
        self.world = world
        self.transport = transport
        self.grid = validate_grid(grid, world.workers) if grid is not None else None
        self.planner = Planner(model, self.grid, world.workers, check_finite)
        self.training = model.training
        self._calls = itertools.count(1)
        self.has_optimizer = False
        self.optimizer_class: str | None = None
        self.optimizer_groups: list[int] | None = None
        self.has_scheduler = False
        self.has_ema = False
        self.steps = 0
        """Optimizer steps taken (restored by ``load``)."""
        self.epoch: int | None = None
        """What the last ``save(..., epoch=)`` or ``load`` recorded: where a resumed run's loop starts."""
        self.seed = random_seed(seed)
        """The random draws' seed (``load`` restores the saved run's)."""
        self._seed_given = seed is not None
        payload = to_payload(model)
        install = (payload, transport, self.seed, self.compile)
        self.id = world.install(ModelPart.install, [install] * world.workers, "installing the model")
        weakref.finalize(self, world.retire, self.id)

    def plan(self, x) -> Plan:
        """``x``: the batch as a tensor (N, C, *spatial), or as a list of image sources
        (``bigconv.data``), one per item, of which each worker reads only its own box."""
        return self.planner.plan(x, self.training)

    # -- training API -----------------------------------------------------------------------------
    def optimizer(self, cls, /, *, scheduler: Callable | None = None, clip_grad_norm: float | None = None,
                  ema: float | None = None, **kwargs) -> None:
        """Create a replicated optimizer on every worker: ``cls(params, **kwargs)``, or, given a factory,
        ``factory(named_parameters)`` (a list of ``(name, parameter)``: param groups by name). ``scheduler``:
        a factory ``optimizer -> scheduler``, stepped after every optimizer step. ``clip_grad_norm``: clip the
        summed gradients to this global norm before each step. ``ema``: a decay in (0, 1); the workers keep an
        exponential moving average of the weights from now on, updated after every step as timm's
        ``ModelEmaV3(model, decay=ema)`` is (``state_dict(ema=True)`` reads it; ``save`` and ``load`` carry it).
        Classes and functions of your script travel by value (cloudpickle). Everything is tried on a meta copy
        of the model first."""
        spec = input_checks.optimizer_spec(self.planner.meta, cls, kwargs, scheduler, clip_grad_norm)
        spec["ema"] = check_ema(ema)
        payload = input_checks.by_value(spec, "the optimizer (its class or factory, and the scheduler factory)")
        made = self._all("make_optimizer", (payload,), "creating the optimizer")
        self.has_optimizer = True
        self.optimizer_class, self.optimizer_groups = made[0]["class"], made[0]["groups"]
        self.has_scheduler = scheduler is not None
        self.has_ema = ema is not None

    def train_step(self, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable, *, step: bool = True) -> float:
        """One forward, backward and optimizer step on the whole batch; returns the loss. ``step=False``:
        the gradients wait on the workers (unsummed, as under DDP's ``no_sync``) and add to the next call's,
        which sums them all and steps: accumulation over micro-batches."""
        if not self.has_optimizer:
            raise ValueError("call net.optimizer(torch.optim.SGD, lr=...) before train_step")
        refuse_autocast("net.train_step")
        if not step and self.transport == "rpc":
            raise ValueError("train_step(..., step=False) accumulates on the p2p transport only; use "
                             "parallelize(..., transport='p2p') (the default)")
        plan = self.plan(x)
        dense = self.planner.per_shard_loss(plan, x, y, loss_fn)
        shards = self._shard_calls(plan, x, y if dense else None, loss_fn)
        if self.transport == "rpc":
            loss = self._rpc_step(plan, shards, y, loss_fn if dense else None, loss_fn)
        elif dense:  # one command per worker: the shard-step of an SPMD rank
            cmds = [(StepCommand(s, PerShardLoss(loss_fn), accumulate=not step),) for s in shards]
            loss = self._wait(self._launch("step", cmds), f"step {shards[0].call}")[0]
        else:
            loss, _ = self._loss_on_driver(plan, shards, y, loss_fn, grad=True, gradients=False, accumulate=not step)
        self.steps += int(step)
        return float(loss)

    def _rpc_step(self, plan: Plan, shards: list[ShardCall], y, shard_loss, loss_fn: Callable) -> torch.Tensor:
        """The ``rpc`` transport: distributed autograd from the driver, then the gradient sum and step."""
        call = shards[0].call
        with self.world.autograd_context() as ctx:
            results = self._wait(self._launch("forward", [(s, shard_loss, True) for s in shards]),
                                 f"forward of step {call}")
            if shard_loss is not None:
                loss = losses.combine(results)
            else:
                loss = check_scalar(loss_fn(self._assemble(plan, results, grad=True), y))
            self.world.backward(ctx, loss, f"backward of step {call}")
            self._all("step_from_context", (ctx,), f"optimizer step {call}")
        return loss.detach()

    def _loss_on_driver(self, plan: Plan, shards: list[ShardCall], y, loss_fn: Callable, grad, gradients: bool,
                        accumulate: bool = False):
        """The ``p2p`` transport with a loss the driver computes on the whole output: the workers keep
        their forward; the driver sends each the gradient of its part of the output in a step command;
        they run backward, the gradient sum and the step (or, with ``gradients``, return them). Two
        messages per worker."""
        call = shards[0].call
        outs = self._wait(self._launch("keep_forward", [(s, grad) for s in shards]), f"forward of step {call}")
        per_worker = outs if plan.several else [[o] for o in outs]  # each worker's output tensors
        # A dense output is joined from every worker's shard; a replicated one is worker 0's copy (the
        # others' copies count once: they get no gradient, i.e. zeros).
        parts = [[w[i] if w[i] is None or not w[i].is_floating_point() else w[i].requires_grad_(True)
                  for w in (per_worker if shape is not None else per_worker[:1])]
                 for i, (shape, _) in enumerate(plan.leaf_shapes())]
        whole = plan.rebuild([join_shards(p, plan.grid) if shape is not None else p[0]
                              for p, (shape, _) in zip(parts, plan.leaf_shapes())])
        loss = check_scalar(loss_fn(whole, y))
        leaves = [(i, w, t) for i, p in enumerate(parts) for w, t in enumerate(p) if t is not None and t.requires_grad]
        found = torch.autograd.grad(loss, [t for *_, t in leaves], allow_unused=True) if loss.requires_grad and \
            leaves else [None] * len(leaves)
        grads: list = [[None] * len(parts) for _ in range(self.world.workers)]
        for (i, w, _), g in zip(leaves, found):
            grads[w][i] = g
        if not plan.several:  # one output: the gradient itself
            grads = [g[0] for g in grads]
        what = f"backward of call {call}" if gradients else f"backward and optimizer step {call}"
        commands = [(StepCommand(s, OutputGradients(g), grad=grad, gradients=gradients, accumulate=accumulate),)
                    for s, g in zip(shards, grads)]
        return loss.detach(), self._wait(self._launch("step", commands), what)

    def gradients(self, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable) -> tuple[float, torch.Tensor, dict]:
        """The loss, the gradient of the input and the summed parameter gradients, without a step.

        What a single process gets from ``loss_fn(model(x), y).backward()``: the evidence, layer
        by layer, that the distributed backward pass is the single-process one.
        """
        refuse_autocast("net.gradients")
        plan = self.plan(x)
        self.planner.check_loss(plan, x, y, loss_fn)
        shards = self._shard_calls(plan, x)
        if self.transport == "p2p":
            loss, parts = self._loss_on_driver(plan, shards, y, loss_fn, grad="input", gradients=True)
            return float(loss), join_shards([g for g, _ in parts], plan.grid), parts[0][1]
        with self.world.autograd_context() as ctx:
            results = self._wait(self._launch("forward", [(s, None, "input") for s in shards]),
                                 f"forward of call {shards[0].call}")
            loss = loss_fn(self._assemble(plan, results, grad=True), y)
            self.world.backward(ctx, loss, f"backward of call {shards[0].call}")
            parts = self._all("gradients", (ctx,), "reading gradients")
        input_grad = join_shards([g for g, _ in parts], plan.grid)
        params: dict[str, torch.Tensor] = {}
        for _, grads in parts:  # in worker order, as the allreduce would
            for name, g in grads.items():
                params[name] = params[name] + g if name in params else g
        return float(loss.detach()), input_grad, params

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The full output on the driver, without gradients."""
        refuse_autocast("net(x)")
        plan = self.plan(x)
        shards = self._shard_calls(plan, x)
        results = self._wait(self._launch("forward", [(s, None, False) for s in shards]),
                             f"inference call {shards[0].call}")
        return self._assemble(plan, results, grad=False)

    def full(self, x: torch.Tensor) -> torch.Tensor:
        """The full output on the driver, without gradients: ``net(x)`` (the SPMD mode's name for it, where
        ``net(x)`` is a rank's share)."""
        return self(x)

    def predict(self, x, out: str, *, overwrite: bool = False, max_chunk: int = 1024, keep="float",
                levels: int | None = None, mpp: float | None = None, classes=None) -> str:
        """Write the dense output for ``x`` (a tensor, or a list of image sources) at ``out``, each worker
        writing its own region; nothing the size of the output reaches the driver. Returns ``out``.

        ``out``: ``NAME.zarr`` (one array, chunks never crossing shards), ``NAME.ome.zarr`` (an OME-Zarr
        pyramid of ``levels`` levels, each reduced by the workers; default: down to 512 px) or
        ``NAME.ome.tif`` (the same as a pyramidal OME-TIFF). ``keep``: ``"float"``, ``"float16"``,
        ``"probabilities"`` (uint8 softmax), ``"labels"`` (argmax; a label image) or, for OME, an image
        kind and ``"labels"``. ``mpp``: the input's microns per pixel (default: the sources'); ``classes``:
        the label image's class names. A model with several outputs writes an image per dense output (a
        ``.zarr`` group of arrays, or one OME container with a series each); ``keep``, ``levels`` and
        ``classes`` then take one value for all or a dict by output name. See ``bigconv.prediction`` and
        ``bigconv.data.pyramid``.

        ``out`` may not be, hold or lie inside an input; ``overwrite=True`` replaces only an output that
        bigconv wrote. The workers write into a temporary sibling that moves to ``out`` when all are done:
        a failed run leaves the old output as it was."""
        from . import prediction

        refuse_autocast("net.predict")
        return prediction.predict(self, x, out, overwrite=overwrite, max_chunk=max_chunk, keep=keep, levels=levels,
                                  mpp=mpp, classes=classes)

    def capture(self, layers, x, y=None, loss_fn: Callable | None = None, target=None, *, out=None,
                overwrite: bool = False) -> dict:
        """For each module named in ``layers``: its output and, with ``target`` (a class) or ``y`` and
        ``loss_fn``, the gradient reaching it, whole on the driver, or with ``out=`` written by the workers
        into a zarr group (``bigconv.capture``)."""
        from . import capture

        refuse_autocast("net.capture")
        return capture.capture(self, layers, x, y, loss_fn, target, out=out, overwrite=overwrite)

    def prefetch(self, x, y=None, loss_fn=None) -> None:
        """Start every worker reading its boxes of the next call's sources (``x``, and ``y`` when they
        are sources too) while the current call computes; that call must then get the same arguments.
        Tensors need nothing: this returns at once for them."""
        if not (is_source_batch(x) or is_source_batch(y)):
            return
        plan = self.plan(x)
        # Target sources need one dense output (train_step says so); several outputs read only x ahead.
        y_reads = y if is_source_batch(y) and plan.out_shape is not None else None
        reads = [[r for r in (s.x, s.target) if isinstance(r, ShardRead)]
                 for s in shard_calls(0, plan, x, y_reads, loss_fn, check_finite=self.planner.check_finite)]
        self.world.call_part(self.id, "prefetch", [(r,) for r in reads], "starting the next reads")

    def _shard_calls(self, plan: Plan, x, y=None, loss_fn=None) -> list[ShardCall]:
        return shard_calls(next(self._calls), plan, x, y, loss_fn, check_finite=self.planner.check_finite)

    def _launch(self, method: str, args: list[tuple]) -> list:
        """Start ``method`` of this model's replica on every worker, worker i with ``args[i]``."""
        return [self.world.launch_part(w, self.id, method, *a)[1] for w, a in enumerate(args)]

    def _all(self, method: str, args: tuple, what: str) -> list:
        return self.world.call_part(self.id, method, [args] * self.world.workers, what)

    def _wait(self, futures: list, what: str) -> list:
        """The workers' results; on the ``p2p`` transport a failure while other workers are still inside
        an exchange or a collective breaks the World (their process group cannot be resumed)."""
        try:
            return self.world.wait(futures, what)
        except WorkerFailure:
            if self.transport == "p2p" and not self.world.broken and not self.world.settled(futures, P2P_SETTLE_S):
                self.world.broken = (f"{what} failed while other workers were still exchanging with it; the workers' "
                                     "process group cannot resume after that (p2p transport)")
            raise

    def _assemble(self, plan: Plan, results: list, grad: bool):
        """The whole output from the workers' results: each dense output joined from its shards, each
        replicated one worker 0's copy (on ``rpc`` with ``grad``, every copy on the loss's graph)."""
        per_worker = results if plan.several else [[r] for r in results]
        joined = []
        for i, (shape, _) in enumerate(plan.leaf_shapes()):
            copies = [w[i] for w in per_worker]
            if shape is not None:
                joined.append(join_shards(copies, plan.grid))
            else:
                joined.append(_PickFirst.apply(*copies) if grad else copies[0])
        return plan.rebuild(joined)

    # -- state -------------------------------------------------------------------------------------
    def state_dict(self, ema: bool = False) -> dict:
        """Worker 0's weights, under the single-process names (every replica holds the same); with ``ema``,
        the moving average of them that the workers keep (``optimizer(..., ema=)``)."""
        if not ema:
            return self.replica_state_dicts(workers=1)[0]
        if not self.has_ema:
            raise ValueError("this model keeps no EMA of its weights; create the optimizer with "
                             "net.optimizer(..., ema=0.999) before reading net.state_dict(ema=True)")
        return self.world.call_part(self.id, "state_dict", [(True,)], "reading the EMA weights", workers=range(1))[0]

    def replica_state_dicts(self, workers: int | None = None) -> list[dict]:
        """The weights of the first ``workers`` replicas (all by default), to check they agree."""
        n = workers or self.world.workers
        return self.world.call_part(self.id, "state_dict", [()] * n, "reading weights", workers=range(n))

    def replica_optimizer_states(self, workers: int | None = None) -> list[dict | None]:
        """The optimizer state (``Optimizer.state_dict()``, on the CPU) of the first ``workers`` replicas (all by
        default), to check they agree; None on a worker without an optimizer."""
        n = workers or self.world.workers
        parts = self.world.call_part(self.id, "checkpoint_state", [(True,)] * n, "reading optimizer states",
                                     workers=range(n))
        return [p["optimizer"] for p in parts]

    def save(self, path, extra: dict | None = None, epoch: int | None = None) -> str:
        """Write weights, optimizer and scheduler state, step count, ``epoch``, generator states and the random
        draws' seed and forward count to ``path`` atomically: what a preempted run needs to resume exactly
        (``load``), dropout and stochastic depth included.

        The file loads into a plain model and optimizer too (see ``bigconv.saving``). ``extra``: plain
        data kept under ``"extra"`` (e.g. ``{"classes": dataset.classes}``).
        """
        self.world.check_usable()
        parts = self.world.call_part(self.id, "checkpoint_state", [(i == 0,) for i in range(self.world.workers)],
                                     "saving a checkpoint")
        epoch = epoch if epoch is not None else self.epoch
        ck = saving.checkpoint(parts[0]["model"], parts[0]["optimizer"], self.optimizer_class, self.steps,
                               [p["rng"] for p in parts], self.world.workers,
                               grid=list(self.grid) if self.grid else None, extra=extra or {},
                               scheduler=parts[0]["scheduler"], epoch=epoch, ema=parts[0]["ema"],
                               draws=saved_draws([p["draws"] for p in parts]))
        self.epoch = ck["epoch"]  # kept only once the checkpoint took it (a refused epoch is not)
        return saving.atomic_save(ck, path)

    def load(self, path) -> "ParallelModel":
        """Restore what ``save`` wrote, on any worker count or grid; the optimizer must already exist,
        made with the same class and arguments. Every check runs before any worker changes, so a bad
        file leaves the model as it was. Workers' generator states return on the same worker count; the random
        draws' seed and forward count on any (the next forward draws what the saved run's next would have:
        the saved seed wins over this model's, see ``bigconv.ops.random.draws_to_load``; a file without
        them, from an older bigconv, leaves the count as it is, with a warning for a model with dropout).
        """
        path = str(path)
        ck = saving.read(path)
        self.planner.check_checkpoint(ck, self.optimizer_class, path, self.optimizer_groups)
        saving.check_scheduler_state(ck.get("scheduler"), self.has_scheduler, path)
        check_ema_state(ck.get("ema"), self.has_ema, path)
        draws = draws_to_load(ck.get("draws"), self.seed, self._seed_given, path, self.planner.meta)
        n = self.world.workers
        rngs = ck["rng"]["workers"] if ck.get("workers") == n else [None] * n
        self.world.call_part(self.id, "load_checkpoint",
                             [(ck["model"], ck.get("optimizer"), r, ck.get("scheduler"), ck.get("ema"), draws)
                              for r in rngs], "loading a checkpoint")
        if draws is not None:
            self.seed = draws["seed"]
        self.steps = int(ck.get("step", 0))
        self.epoch = ck.get("epoch")
        torch.set_rng_state(ck["rng"]["driver"])
        return self

    def draws_state(self) -> dict:
        """The random draws' seed and forward count, ``{"seed": int, "forwards": int}`` (the workers'; the SPMD
        mode's ``draws_state``): what a checkpoint written by hand keeps for ``load_draws_state``. ``save``
        keeps it already."""
        n = self.world.workers
        parts = self.world.call_part(self.id, "checkpoint_state", [(False,)] * n, "reading the random draws' state")
        return saved_draws([p["draws"] for p in parts])

    def load_draws_state(self, state: dict) -> None:
        """Continue the random draws where ``state`` (the saved run's ``draws_state()``) stopped, on every worker;
        its seed replaces this model's. A malformed dict is a ``ValueError`` before any worker changes."""
        problem = draws_problem(state)
        if problem is not None:
            raise ValueError(f"load_draws_state: the state is malformed: {problem}; pass what net.draws_state() "
                             "returned when the checkpoint was written")
        self.world.call_part(self.id, "restore_draws", [(dict(state),)] * self.world.workers,
                             "restoring the random draws")
        self.seed = state["seed"]

    def train(self, mode: bool = True) -> "ParallelModel":
        self.training = mode
        self._all("set_training", (mode,), "setting train mode")
        return self

    def eval(self) -> "ParallelModel":
        return self.train(False)


def refuse_autocast(what: str) -> None:
    """``torch.autocast`` is a setting of the calling thread: around a driver call it cannot reach the
    workers' processes, and the result would silently be one precision where one process gives another.
    Refused before any remote work."""
    on = [d for d in ("cuda", "cpu") if torch.is_autocast_enabled(d)]
    if on:
        raise ValueError(
            f"torch.autocast({on[0]!r}) is on around {what}, but the driver mode runs the model in the workers' "
            "processes, which the driver's autocast does not reach (the output would silently keep the model's "
            "dtype); put the autocast inside the model's forward (it then runs on the workers), or train with "
            "your own loop on an SPMD world, where autocast applies (docs/loop.md)")


def check_ema(ema) -> float | None:
    if ema is None:
        return None
    if isinstance(ema, bool) or not isinstance(ema, (int, float)) or not 0 < ema < 1:
        raise ValueError(f"ema must be a decay between 0 and 1 (the EMA keeps decay * itself + (1 - decay) * the "
                         f"weights after every step; e.g. ema=0.999), got {ema!r}")
    return float(ema)


def check_ema_state(saved: dict | None, has_ema: bool, path: str) -> None:
    if saved is not None and not has_ema:
        raise ValueError(f"the checkpoint {path!r} holds an EMA of the weights but this model's optimizer keeps none; "
                         "create it with net.optimizer(..., ema=<decay>) as in the saved run before net.load()")


def check_transport(transport) -> None:
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(map(repr, TRANSPORTS))} ('p2p': halos and gradients "
                         "point-to-point between the workers, the default; 'rpc': halos over RPC and distributed "
                         f"autograd from the driver), got {transport!r}")


def check_scalar(loss) -> torch.Tensor:
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
        raise ValueError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
    return loss


def parallelize(model: nn.Module, world, grid: tuple[int, ...] | None = None, *, replicas: int = 1,
                check_finite: bool = False, transport: str = "p2p", seed: int | None = None,
                compile: bool = False) -> ParallelModel:
    """Return ``model`` decomposed over ``world``'s workers on ``grid`` (None: balanced per input).

    On an SPMD world (``World.from_env(mode="spmd")``) every rank calls this with the same arguments;
    ``replicas=R`` adds data parallelism: R copies of the spatial grid, each on an equal slice of the
    batch, with ``prod(grid) * R`` equal to the world size. The driver mode has one replica.

    ``check_finite``: refuse inputs and targets holding NaN or inf before sending them (each worker
    checks the box it reads of image sources and names the slide and the box), and gradients holding
    them after the sum and before the optimizer step (naming the call and the first parameter; the
    weights stay as they were). Off by default: it reads the whole batch once more.

    ``transport`` (driver mode): ``"p2p"`` (the default) runs each worker's step as an SPMD rank runs
    it: halos point-to-point between the workers (on the GPU with NCCL), local autograd, gradients
    summed in buckets during backward, one message from the driver per worker and step when the loss
    is computed per shard (two otherwise). ``"rpc"`` pushes halos over RPC and runs backward by
    distributed autograd from the driver, the design of the ORNL study; it stages CUDA halos
    through host memory. Both train to the same weights. An SPMD world is always ``p2p``.

    ``seed``: of the random draws in the model's forward (dropout, stochastic depth, noise), which every
    shard makes as one process drawing once would (``bigconv.ops.random``); None takes torch's initial
    seed (what ``torch.manual_seed`` set; on an SPMD world, rank 0's). One process draws the same values under
    ``bigconv.ops.random.RandomDraws(seed).forward()``, one context per forward.

    ``compile``: every worker (SPMD: every rank) runs its shard's forward through ``torch.compile``.
    ``parallelize(torch.compile(model))`` does the same: the dry run and the rules see the original
    module (``_orig_mod``). Dynamo compiles what it can trace and runs the rest (bigconv's rules and
    halo exchanges, which live in a TorchFunctionMode) eagerly; the results are exact either way.
    """
    from .spmd import SpmdModel, SpmdWorld

    check_transport(transport)
    if isinstance(world, SpmdWorld):
        if transport != "p2p":
            raise ValueError("an SPMD world exchanges halos point-to-point only; leave transport='p2p' "
                             "(transport='rpc' is for the driver mode)")
        return SpmdModel(model, world, grid, replicas, check_finite, seed, compile)
    if replicas != 1:
        raise ValueError(f"replicas={replicas} needs an SPMD world (World.from_env(mode='spmd') under torchrun, "
                         "srun or jsrun); a driver-mode World has one replica")
    return ParallelModel(model, world, grid, check_finite, transport, seed, compile)
