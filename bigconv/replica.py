"""A worker's copy of the model: sharded forward, gradient allreduce and optimizer step.

Every worker holds the whole (small) model and a shard of the (large) image. Gradients are read
from the driver's distributed-autograd context, **summed** over the gradient group (the loss of the
image is the sum of shard contributions, so a replicated weight's gradient is the sum, not the
DistributedDataParallel average), and applied by an optimizer that is replicated too, so every
replica stays bit-for-bit equal.
"""

from __future__ import annotations

import pickle
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd

from . import losses, saving, transport
from .data import prefetch
from .data.sources import ShardRead
from .executors import ShardExecutor
from .sharding import ModulePath, ShardMode, global_shape, mark

try:
    import cloudpickle
except ImportError:  # classes must then be importable on the workers
    cloudpickle = None


def to_payload(model: torch.nn.Module) -> bytes:
    # cloudpickle ships classes defined in a user's __main__ script, which workers cannot import.
    return (cloudpickle or pickle).dumps(model)


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


class Replica:
    def __init__(self, model: torch.nn.Module) -> None:
        self.rt = transport.runtime()
        self.model = model.to(self.rt.device)
        self.path = ModulePath(self.model)
        self.optimizer: torch.optim.Optimizer | None = None

    @classmethod
    def from_payload(cls, payload: bytes) -> "Replica":
        return cls(pickle.loads(payload))

    def forward(self, call: int, grid: tuple[int, ...], shape: tuple[int, ...], x: torch.Tensor,
                loss_fn=None, target: torch.Tensor | None = None, grad: bool = True):
        """Run this shard; return the output shard, the replicated output, or (num, den) of the loss."""
        self.rt.mailbox.drop_calls_before(call)
        self.path.stack.clear()
        if isinstance(x, ShardRead):  # this worker's box, read from the file here (or already, ahead)
            x = self._read(x)
        x = mark(x.to(self.rt.device), shape)
        if grad == "input":  # keep the input shard as a leaf, to read its gradient afterwards
            self.last_input = x.requires_grad_(True)
        try:
            with torch.set_grad_enabled(bool(grad)), ShardMode(ShardExecutor(grid, call, self.rt), self.path):
                try:
                    out = self.model(x)
                except Exception as exc:
                    raise _located(exc, f"{self.path.current} on {transport.worker_name(self.rt.index)}") from exc
            if loss_fn is not None:
                if isinstance(target, ShardRead):  # this worker's box of the label maps
                    target = self._read(target)
                    losses.check_labels_here(loss_fn, out, target)
                num, den = losses.shard_parts(loss_fn.to(self.rt.device), out, target.to(self.rt.device))
                return num.cpu(), den
            if global_shape(out) is None and self.rt.index != 0 and not grad:
                return None  # replicated inference output: worker 0's copy is enough
            return out.cpu()
        finally:
            transport.flush(self.rt)  # RPC pushes

    def _read(self, read: ShardRead) -> torch.Tensor:
        return prefetch.take_or_read(read, self.rt.timeout, self.rt.stats)

    def predict(self, call: int, grid, shape, x, path: str, box) -> None:
        """Run this shard without gradients and write its output region into the zarr array at ``path``."""
        from .data import outputs

        out = self.forward(call, grid, shape, x, grad=False)
        outputs.write(path, (slice(None), slice(None)) + tuple(slice(a, b) for a, b in box), out.numpy())

    def make_optimizer(self, cls, kwargs: dict) -> None:
        self.optimizer = cls(self.model.parameters(), **kwargs)

    def step(self, context_id: int) -> None:
        if self.optimizer is None:
            raise RuntimeError("no optimizer: call net.optimizer(torch.optim.SGD, lr=...) before train_step")
        grads = dist_autograd.get_gradients(context_id)
        params = [p for p in self.model.parameters() if p.requires_grad]
        present = torch.tensor([p in grads for p in params], dtype=torch.float32, device=self.rt.device)
        dist.all_reduce(present)
        buckets: dict[tuple, list[torch.nn.Parameter]] = defaultdict(list)
        for p in params:
            buckets[(p.dtype, p.device)].append(p)
        for group in buckets.values():
            # One flat allreduce per dtype: few large messages beat many small ones.
            flat = torch.cat([grads[p].reshape(-1) if p in grads else torch.zeros_like(p).reshape(-1) for p in group])
            dist.all_reduce(flat)
            offset = 0
            for p in group:
                p.grad = flat[offset: offset + p.numel()].view_as(p).clone()
                offset += p.numel()
        for p, seen in zip(params, present.tolist()):
            if not seen:
                p.grad = None  # unused everywhere: skip, as a single process would
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def gradients(self, context_id: int) -> tuple[torch.Tensor | None, dict]:
        """This shard's input gradient and this replica's (unreduced) parameter gradients."""
        grads = dist_autograd.get_gradients(context_id)
        x = getattr(self, "last_input", None)
        params = {name: grads[p].cpu() for name, p in self.model.named_parameters() if p in grads}
        return (grads[x].cpu() if x is not None and x in grads else None), params

    def state_dict(self) -> dict:
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def checkpoint_state(self, full: bool) -> dict:
        """This replica's generator states; with ``full``, its weights and optimizer state as well."""
        state: dict = {"rng": rng_state(self.rt.device)}
        if full:
            state["model"] = self.state_dict()
            state["optimizer"] = saving.to_cpu(self.optimizer.state_dict()) if self.optimizer is not None else None
        return state

    def load_checkpoint(self, model_state: dict, optimizer_state: dict | None, rng: dict | None) -> None:
        self.model.load_state_dict(model_state)
        if optimizer_state is not None:
            self.optimizer.load_state_dict(optimizer_state)
        if rng is not None:
            set_rng_state(rng, self.rt.device)


def rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)

