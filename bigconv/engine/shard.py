"""One shard's model and what every front end runs on it (the engine of one shard).

A driver's worker (the default ``p2p`` transport) and an SPMD rank hold the same thing: the whole
(small) model, a shard of the (large) image, a point-to-point link to the other shards, gradient
buckets that sum replicated weights' gradients while backward runs, and a replicated optimizer. This
module is that thing. The front ends only decide where the input, the targets and the loss come from.

- ``forward`` runs the model on this shard under the op rules, halos by the link inside autograd.
- ``dense_loss`` is this shard's part of a loss computed shard by shard (``bigconv.losses``), summed
  over every rank: ``sum(numerators) / sum(denominators)``.
- ``begin`` / ``end`` bracket a backward whose gradients are summed over the gradient group (every
  rank, spatial shards and replicas alike: no DDP averaging), then step the optimizer.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import losses, saving
from ..data.sources import ShardRead
from ..ops.mode import ShardMode
from ..ops.random import RandomDraws
from ..ops.shards import ModulePath, mark
from ..ops.sync_norm import adopt as adopt_sync_batchnorm
from ..ops import global_attention, whole
from ..transport import WorkerFailure, WorkerRuntime, check_wire
from .buckets import GradBuckets, lost_rank_wait
from .executor import ShardExecutor


class SourceReadError(RuntimeError):
    """Another process could not read its box of the sources (its own error is in the message); this
    one stopped with it before its forward."""


class NonFiniteGradientError(FloatingPointError, ValueError):
    """``check_finite``: a summed gradient holds NaN or inf; the optimizer did not step."""


class ShardEngine:
    def __init__(self, model: nn.Module, rt: WorkerRuntime, grad_group=None, seed: int = 0,
                 compile: bool = False) -> None:
        """``rt`` carries this shard's index, device, timeout and links; ``grad_group`` the ranks whose
        gradients are summed (None: the default group); ``seed`` the model's random draws' (equal on
        every shard; a data-parallel replica mixes its number in, its images being other images)."""
        self.rt = rt
        self.random = RandomDraws(seed, stream=getattr(rt, "replica", 0) or 0)
        # SyncBatchNorm's own forward refuses CPU shards and syncs over the wrong group: bigconv's rule instead
        self.model = adopt_sync_batchnorm(model.to(rt.device))
        self.path = ModulePath(self.model)
        whole.install(self.model)  # after the path's hooks: modules held whole (bigconv.ops.whole)
        global_attention.install(self.model)  # timm BottleneckAttn: ring attention (bigconv.ops.global_attention)
        # torch.compile of the whole shard forward: dynamo compiles what it can trace and runs the rest
        # (the ShardMode's rules, halo exchanges) eagerly; the module, its names and hooks stay the plain one.
        self.run = torch.compile(self.model) if compile else self.model
        self.opt: torch.optim.Optimizer | None = None
        self.scheduler = None
        """Stepped after every optimizer step (``make_optimizer``'s ``scheduler``)."""
        self.clip: float | None = None
        """Clip the summed gradients to this global norm before each optimizer step."""
        self.ema: dict[str, torch.Tensor] | None = None
        """An exponential moving average of the state dict, updated after every optimizer step (``make_optimizer``'s
        ``ema``): kept here, where the weights are, so that no step moves the weights to the driver."""
        self.ema_decay = 0.0
        self.accumulating = False
        """Gradients of calls with ``accumulate`` wait in ``.grad``, unsummed, for the next summing call."""
        self.grad_group = grad_group
        self._buckets: GradBuckets | None = None
        self.last_input: torch.Tensor | None = None

    @property
    def buckets(self) -> GradBuckets:
        if self._buckets is None:  # hooks only on a model that trains on this engine
            params = [p for p in self.model.parameters() if p.requires_grad]
            self._buckets = GradBuckets(params, self.grad_group, self.rt.timeout,
                                        roll_call=getattr(self.rt.mesh, "roll_call", None))
        return self._buckets

    # -- forward ------------------------------------------------------------------------------------
    def read(self, x):
        """``x`` itself, or for a ``ShardRead`` its tensor: prefetched, or read here now."""
        return self.rt.reads.take_or_read(x, self.rt.timeout, self.rt.stats) if isinstance(x, ShardRead) else x

    @contextmanager
    def naming_lost_ranks(self, what: str):
        """Around a collective: if it fails, a ``WorkerFailure`` naming the ranks gone, from a roll call
        (SPMD; in the driver mode the driver names a dead worker itself). A collective's own error
        says only that some rank is gone; a halo wait already names its peers."""
        try:
            yield
        except Exception as exc:
            roll_call = getattr(self.rt.mesh, "roll_call", None)
            if roll_call is None:
                raise
            gone = roll_call.describe(lost_rank_wait(self.rt.timeout))
            raise WorkerFailure(f"rank {dist.get_rank()}: {what} failed ({gone}): {exc}") from exc

    def read_agreed(self, x):
        """``read(x)``, agreed by every rank of the gradient group: when one process cannot read its box,
        every process raises together, before any halo exchange or collective waits on the one that
        failed (it would wait out the timeout and leave the process group unusable). The failing
        process raises its own error, the others a ``SourceReadError`` carrying its message. One
        one-element all-reduce per call that reads sources; the messages travel only on failure."""
        if not isinstance(x, ShardRead):
            return x
        try:
            tensor, error = self.read(x), None
        except Exception as exc:  # noqa: BLE001 - every read error is agreed, then re-raised as it was
            tensor, error = None, exc
        failed = torch.tensor([0 if error is None else 1], device=self.rt.device)
        with self.naming_lost_ranks("agreeing on the reads"):
            dist.all_reduce(failed, group=self.grad_group)
        if not failed.item():
            return tensor
        messages: list = [None] * dist.get_world_size(self.grad_group)
        mine = None if error is None else f"{type(error).__name__}: {error}"
        dist.all_gather_object(messages, mine, group=self.grad_group)
        if error is not None:
            raise error
        raise SourceReadError("; ".join(f"rank {r} could not read its box: {m}"
                                         for r, m in enumerate(messages) if m is not None))

    def forward(self, grid: tuple[int, ...], in_shape: tuple[int, ...], x_local: torch.Tensor, grad, call: int):
        """The model on this shard; ``grad="input"`` keeps the input shard as a leaf to read its gradient."""
        self.path.clear()
        x = mark(x_local.to(self.rt.device), in_shape)
        if grad == "input":
            self.last_input = x.requires_grad_(True)
        mode = ShardMode(ShardExecutor(grid, call, self.rt), self.path, random=self.random.next_forward())
        with torch.set_grad_enabled(bool(grad)), mode:
            return self.run(x)

    def dense_loss(self, loss_fn: nn.Module, out: torch.Tensor, target: torch.Tensor, group=None):
        """This shard's part of a loss computed per shard, scaled by the denominator summed over
        ``group``: (what to backpropagate here, the whole loss)."""
        num, den = losses.shard_parts(loss_fn.to(out.device), out, target.to(out.device))
        sums = torch.stack([num.detach().double().reshape(()),
                            torch.tensor(float(den or 0.0), dtype=torch.float64, device=out.device)])
        check_wire([sums], self.rt.device, "the loss's sum")
        with self.naming_lost_ranks("the loss's sum"):
            dist.all_reduce(sums, group=group)
        if den is None:
            return num, sums[0]
        total = sums[1].item()
        return num / total, sums[0] / total

    def check_labels(self, loss_fn: nn.Module, out: torch.Tensor, target: torch.Tensor, group=None) -> None:
        """Class labels read on this shard (target sources) lie in [0, classes). Checked with every rank
        of ``group``, so all raise the same ValueError together and none is left waiting in the loss's sum."""
        bad = losses.labels_out_of_range(loss_fn, target, out.shape[1])
        found: list = [None] * dist.get_world_size(group)
        with self.naming_lost_ranks("checking the labels"):
            dist.all_gather_object(found, int(bad[0]) if bad.numel() else None, group=group)
        first = next((b for b in found if b is not None), None)
        if first is not None:
            raise ValueError(losses.label_message(first, out.shape[1]))

    # -- a training step ------------------------------------------------------------------------------
    def make_optimizer(self, cls: type, kwargs: dict, factory=None, scheduler=None, clip: float | None = None,
                       ema: float | None = None) -> dict:
        """``cls(parameters, **kwargs)``, or ``factory(named_parameters)`` (param groups by name); a
        ``scheduler(optimizer)`` stepped after each step; gradient clipping by the global norm; with ``ema``
        (a decay), an EMA of the weights from now on (``update_ema``). Returns what the front end records of
        it: the class and the group sizes."""
        if factory is not None:
            opt = factory(list(self.model.named_parameters()))
            if not isinstance(opt, torch.optim.Optimizer):
                raise ValueError(f"the optimizer factory must return a torch.optim.Optimizer, got {type(opt).__name__}")
        else:
            opt = cls(self.model.parameters(), **kwargs)
        self.opt, self.clip, self.accumulating = opt, clip, False
        self.scheduler = scheduler(opt) if scheduler is not None else None
        self.ema_decay = float(ema) if ema is not None else 0.0
        self.ema = {k: v.detach().clone() for k, v in self.model.state_dict().items()} if ema is not None else None
        return {"class": saving.class_name(type(opt)), "groups": [len(g["params"]) for g in opt.param_groups]}

    def begin(self, accumulate: bool = False) -> None:
        """Before a backward: clear the gradients (unless earlier calls accumulate in them) and arm the buckets
        (with ``accumulate``, disarm them: this call's gradients wait, unsummed, for the next summing call)."""
        if not self.accumulating:
            self.model.zero_grad(set_to_none=True)
        if accumulate:
            self.buckets.reset()
        else:
            self.buckets.arm()

    def abort(self) -> None:
        self.buckets.reset()
        self.accumulating = False

    def end(self, step: bool, accumulate: bool = False, check_finite: bool = False, call: int | None = None) -> None:
        """Wait for the gradient sums; with ``step``, clip, take the optimizer step, step the scheduler and
        clear them. With ``accumulate`` nothing is summed or stepped: the gradients wait in ``.grad``. With
        ``check_finite``, a NaN or inf in a summed gradient is a ``NonFiniteGradientError`` before anything changes
        (``check_gradients``)."""
        if accumulate:
            self.accumulating = True
            return
        self.accumulating = False
        self.buckets.finish()
        if step:
            if self.opt is None:
                raise RuntimeError("no optimizer: call net.optimizer(torch.optim.SGD, lr=...) before train_step")
            if check_finite:
                self.check_gradients(call)
            if self.clip is not None:
                torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.grad is not None], self.clip)
            self.opt.step()
            if self.scheduler is not None:
                self.scheduler.step()
            self.opt.zero_grad(set_to_none=True)
            self.update_ema()

    @torch.no_grad()
    def check_gradients(self, call: int | None) -> None:
        """Refuse a step whose summed gradients hold NaN or inf, naming the first such parameter: the weights,
        the optimizer's and the scheduler's state and the EMA stay as they were; the gradients are cleared.
        The sums are equal on every rank, so every rank refuses together, with no message between them. One
        reduction and one device sync per step."""
        named = [(n, p.grad) for n, p in self.model.named_parameters() if p.grad is not None]
        if not named:
            return
        bad = torch.stack([torch.isfinite(g).logical_not().any() for _, g in named])
        if not bool(bad.any()):
            return
        name, grad = named[int(bad.nonzero()[0, 0])]
        count = int(torch.isfinite(grad).logical_not().sum())
        self.model.zero_grad(set_to_none=True)
        where = f"the step of call {call}" if call is not None else "this step"
        raise NonFiniteGradientError(
            f"check_finite: in {where} the summed gradient of {name!r} holds {count} NaN or infinite value(s) of "
            f"{grad.numel()} (the first such parameter of {len(named)}); the optimizer did not step, the weights "
            "are as before this step. A finite loss can hide it: look for an operation with an infinite derivative "
            "(sqrt or log at 0, a division by ~0), or lower the learning rate")

    @torch.no_grad()
    def update_ema(self) -> None:
        """``ema = decay * ema + (1 - decay) * weight`` for every floating entry of the state dict, a copy for the
        others (counters): timm's ``ModelEmaV3(model, decay)`` with ``update(model)``, made at the optimizer."""
        if self.ema is None:
            return
        for name, value in self.model.state_dict().items():
            kept = self.ema[name]
            if kept.is_floating_point():
                kept.lerp_(value, 1.0 - self.ema_decay)
            else:
                kept.copy_(value)

    def param_grads(self) -> dict[str, torch.Tensor]:
        """The summed parameter gradients (after ``end(step=False)``), on the CPU; then cleared."""
        grads = {n: p.grad.detach().cpu().clone() for n, p in self.model.named_parameters() if p.grad is not None}
        self.model.zero_grad(set_to_none=True)
        return grads

    def input_grad(self) -> torch.Tensor:
        x = self.last_input
        return (x.grad if x.grad is not None else torch.zeros_like(x)).detach().cpu()

    # -- state ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def optimizer_state(self) -> dict | None:
        return saving.to_cpu(self.opt.state_dict()) if self.opt is not None else None

    def scheduler_state(self) -> dict | None:
        return saving.to_cpu(self.scheduler.state_dict()) if self.scheduler is not None else None

    def ema_state(self) -> dict | None:
        return saving.to_cpu(self.ema) if self.ema is not None else None

    def draws_state(self) -> dict:
        """The random draws' seed and forward count (``RandomDraws.state``), for a checkpoint."""
        return self.random.state()

    def load(self, model_state: dict, optimizer_state: dict | None, scheduler_state: dict | None = None,
             ema_state: dict | None = None, draws: dict | None = None) -> None:
        """Restore a checkpoint's states; ``draws`` (``draws_state``'s, or None: left as they are) makes the
        next forward draw what the saved run's next forward would have drawn."""
        self.model.load_state_dict(model_state)
        if optimizer_state is not None:
            self.opt.load_state_dict(optimizer_state)
        if scheduler_state is not None:
            self.scheduler.load_state_dict(scheduler_state)
        if ema_state is not None:
            for name, kept in self.ema.items():
                kept.copy_(ema_state[name])
        if draws is not None:
            self.random.restore(draws)
        self.accumulating = False
