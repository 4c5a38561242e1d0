"""A driver's worker's copy of the model: its shard's engine, run on the transport the driver chose.

Every worker holds the whole (small) model and a shard of the (large) image. On the ``p2p`` transport
a step is the SPMD shard-step (``bigconv.engine.shard``): halos point-to-point in the workers' process
group, local autograd, gradients summed in buckets while backward runs. On ``rpc`` the halos go over
RPC and the gradients are read from the driver's distributed-autograd context. Either way they are
**summed** over the workers (the loss of the image is the sum of shard contributions, so a replicated
weight's gradient is the sum, not the DistributedDataParallel average) and applied by an optimizer
that is replicated too, so every replica stays bit-for-bit equal.
"""

from __future__ import annotations

import io
import pickle

import torch
import torch.distributed.autograd as dist_autograd
import torch.utils._pytree as pytree
from torch.nn.utils import parametrize

from .. import losses, transport
from ..saving import rng_state, set_rng_state
from ..data import prefetch
from ..data.sources import ShardRead
from ..engine.shard import ShardEngine
from ..ops.shards import global_shape
from ..transport import WorkerRuntime
from ..transport import rpc as rpc_link
from ..transport.p2p import P2PLink

try:
    import cloudpickle
except ImportError:  # classes must then be importable on the workers
    cloudpickle = None


def _rebuild_parametrized(cls: type, state: dict) -> torch.nn.Module:
    """A parametrized module (``torch.nn.utils.parametrizations.weight_norm``...) from its plain
    class and attributes: the class and properties ``register_parametrization`` injects, again."""
    module = cls.__new__(cls)
    module.__dict__.update(state)
    parametrize._inject_new_class(module)
    for name in state["_modules"]["parametrizations"]:
        parametrize._inject_property(module, name)
    return module


def _reduce_parametrized(obj):
    """torch refuses to pickle a parametrized module (its class is made at run time): ship it as the
    user's class and its attributes, parametrizations and their original tensors included."""
    if isinstance(obj, torch.nn.Module) and parametrize.is_parametrized(obj):
        return _rebuild_parametrized, (type(obj).__bases__[0], obj.__dict__.copy())
    return NotImplemented


if cloudpickle is not None:
    class _Pickler(cloudpickle.CloudPickler):
        def reducer_override(self, obj):
            reduced = _reduce_parametrized(obj)
            return super().reducer_override(obj) if reduced is NotImplemented else reduced
else:
    class _Pickler(pickle.Pickler):
        def reducer_override(self, obj):
            return _reduce_parametrized(obj)


def to_payload(model: torch.nn.Module) -> bytes:
    # cloudpickle ships classes defined in a user's __main__ script, which workers cannot import.
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(model)
    return buffer.getvalue()


def _located(exc: Exception, where: str) -> Exception:
    """``exc`` with where it happened in its message, keeping its type where the type allows it.

    The driver sees a remote error as its text only; without the module a worker's error says
    what failed but not where.
    """
    if isinstance(exc, transport.WorkerFailure) or "(in module" in str(exc):
        return exc
    message = f"{exc} (in {where})"
    if isinstance(exc, KeyError):  # its text is a repr, which RPC would quote again
        return RuntimeError(f"KeyError: {message}")
    try:
        return type(exc)(message)
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {message}")


TRANSPORTS = ("p2p", "rpc")
"""How a driver's workers exchange halos and gradients: ``p2p`` (the default: point-to-point in the
workers' process group, local autograd, gradients summed in buckets during backward, as SPMD ranks
do) or ``rpc`` (halos pushed over RPC, backward by distributed autograd from the driver)."""


class Replica:
    """This worker's copy of one model and its shard's engine, on the transport the driver chose."""

    def __init__(self, model: torch.nn.Module, transport_name: str, seed: int = 0, compile: bool = False) -> None:
        proc = transport.runtime()
        if transport_name == "p2p":
            rt = WorkerRuntime(index=proc.index, workers=proc.workers, device=proc.device, timeout=proc.timeout,
                               stats=proc.stats, grad_group=proc.grad_group, checks=proc.checks)
            rt.link = P2PLink(None, range(proc.workers), proc.index, proc.timeout, proc.stats,
                              device=proc.device, tag_free=proc.checks.tag_free)
        else:
            rt = proc  # its mailbox takes the RPC pushes
        self.transport = transport_name
        self.rt = rt
        self.engine = ShardEngine(model, rt, grad_group=proc.grad_group, seed=seed, compile=compile)
        self.model = self.engine.model
        self.kept: torch.Tensor | None = None
        """The output of a forward whose backward the driver starts later (p2p, a loss on the driver)."""

    @classmethod
    def from_payload(cls, payload: bytes, transport_name: str, seed: int = 0, compile: bool = False) -> "Replica":
        return cls(pickle.loads(payload), transport_name, seed, compile)

    def _forward(self, call: int, grid, shape, x, grad) -> torch.Tensor:
        if self.transport == "rpc":
            self.rt.mailbox.drop_calls_before(call)
        if isinstance(x, ShardRead):  # this worker's box, read from the file here (or already, ahead)
            x = self._read(x)
        try:
            return self.engine.forward(grid, shape, x, grad, call)
        except Exception as exc:
            raise _located(exc, f"{self.engine.path.current} on {transport.worker_name(self.rt.index)}") from exc

    def forward(self, call: int, grid: tuple[int, ...], shape: tuple[int, ...], x: torch.Tensor,
                loss_fn=None, target: torch.Tensor | None = None, grad: bool = True):
        """Run this shard; return the output shard, the replicated output, or (num, den) of the loss.

        Inference on either transport, and the forward of a step on ``rpc``."""
        try:
            out = self._forward(call, grid, shape, x, grad)
            if loss_fn is not None:
                if isinstance(target, ShardRead):  # this worker's box of the label maps
                    target = self._read(target)
                    losses.check_labels_here(loss_fn, out, target)
                num, den = losses.shard_parts(loss_fn.to(self.rt.device), out, target.to(self.rt.device))
                return num.cpu(), den
            if not isinstance(out, torch.Tensor):  # several outputs: each as one tensor would go
                return [self._sent(t, grad) for t in pytree.tree_leaves(out)]
            return self._sent(out, grad)
        finally:
            if self.transport == "rpc":
                rpc_link.flush(self.rt)  # RPC pushes

    def _sent(self, out: torch.Tensor, grad) -> torch.Tensor | None:
        if global_shape(out) is None and self.rt.index != 0 and not grad:
            return None  # replicated inference output: worker 0's copy is enough
        return out.cpu()

    def _read(self, read: ShardRead) -> torch.Tensor:
        return prefetch.take_or_read(read, self.rt.timeout, self.rt.stats)

    def predict(self, call: int, grid, shape, x, path: str, box) -> None:
        """Run this shard without gradients and write its output region into the zarr array at ``path``."""
        from ..data import outputs

        out = self.forward(call, grid, shape, x, grad=False)
        outputs.write(path, (slice(None), slice(None)) + tuple(slice(a, b) for a, b in box), out.numpy())

    def make_optimizer(self, cls, kwargs: dict) -> None:
        self.engine.make_optimizer(cls, kwargs)

    # -- a step on the p2p transport: the shard-step of every SPMD rank -----------------------------------
    def dense_step(self, call: int, grid, shape, x, loss_fn, target, step: bool) -> float:
        """Forward, this shard's part of a per-shard loss, backward with the gradient sum, and (with
        ``step``) the optimizer step: one message from the driver. Returns the whole loss."""
        self.engine.begin()
        try:
            out = self._forward(call, grid, shape, x, True)
            if isinstance(target, ShardRead):
                target = self._read(target)
                self.engine.check_labels(loss_fn, out, target)
            part, loss = self.engine.dense_loss(loss_fn, out, target)
            part.backward()
        except BaseException:
            self.engine.abort()
            raise
        self.engine.end(step)
        return float(loss)

    def keep_forward(self, call: int, grid, shape, x, grad) -> torch.Tensor | None:
        """The forward of a step whose loss the driver computes: the output goes back to the driver and
        stays here, for ``backward`` with its gradient."""
        self.kept = None
        out = self._forward(call, grid, shape, x, grad)
        self.kept = out
        if not isinstance(out, torch.Tensor):  # several outputs: a list of what one tensor would send
            return [None if global_shape(t) is None and self.rt.index != 0 else t.detach().cpu()
                    for t in pytree.tree_leaves(out)]
        return None if global_shape(out) is None and self.rt.index != 0 else out.detach().cpu()

    def backward(self, grad: torch.Tensor | None, step: bool, gradients: bool = False):
        """Backward from the kept output with the driver's gradient for it (None: zeros, for a shard
        whose copy of a replicated head does not count), the gradient sum, and the optimizer step or,
        with ``gradients``, (this shard's input gradient, the summed parameter gradients on worker 0)."""
        out, self.kept = self.kept, None
        if out is None:
            raise RuntimeError("no forward is waiting for its backward (an earlier call failed); call again")
        # Several outputs: one gradient per output (None: zeros), in one backward through all of them.
        outs = [out] if isinstance(out, torch.Tensor) else pytree.tree_leaves(out)
        grads = grad if isinstance(grad, list) else [grad]
        pairs = [(o, g.to(o.device) if g is not None else torch.zeros_like(o))
                 for o, g in zip(outs, grads) if o.requires_grad]
        self.engine.begin()
        try:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        except BaseException:
            self.engine.abort()
            raise
        self.engine.end(step)
        if gradients:
            params = self.engine.param_grads()
            return self.engine.input_grad(), (params if self.rt.index == 0 else None)
        return None

    # -- a step on the rpc transport: gradients from the driver's distributed-autograd context -----------
    def step(self, context_id: int) -> None:
        self.engine.buckets.reduce(dist_autograd.get_gradients(context_id))
        self.engine.end(step=True)

    def gradients(self, context_id: int) -> tuple[torch.Tensor | None, dict]:
        """This shard's input gradient and this replica's (unreduced) parameter gradients."""
        grads = dist_autograd.get_gradients(context_id)
        x = self.engine.last_input
        params = {name: grads[p].cpu() for name, p in self.model.named_parameters() if p in grads}
        return (grads[x].cpu() if x is not None and x in grads else None), params

    # -- state ----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return self.engine.state_dict()

    def checkpoint_state(self, full: bool) -> dict:
        """This replica's generator states; with ``full``, its weights and optimizer state as well."""
        state: dict = {"rng": rng_state(self.rt.device)}
        if full:
            state["model"] = self.state_dict()
            state["optimizer"] = self.engine.optimizer_state()
        return state

    def load_checkpoint(self, model_state: dict, optimizer_state: dict | None, rng: dict | None) -> None:
        self.engine.load(model_state, optimizer_state)
        if rng is not None:
            set_rng_state(rng, self.rt.device)
