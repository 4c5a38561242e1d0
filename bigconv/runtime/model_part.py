"""A driver's worker's part of one parallel model: the whole (small) model and its shard's engine, on the
transport the driver chose (installed on the worker's host, ``bigconv.runtime.host``).

Every worker holds the whole (small) model and a shard of the (large) image. On the ``p2p`` transport
a step is the SPMD shard-step (``bigconv.engine.step``), fed by the driver's commands: halos point-to-point in the workers' process
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
from ..data.sources import ShardRead
from ..engine import step
from ..engine.shard import NonFiniteGradientError, ShardEngine
from ..engine.step import OutputGradients, ShardCall, StepCommand
from ..geometry.boxes import box_index
from ..ops.shards import global_shape
from ..transport import WorkerRuntime
from ..transport import rpc as rpc_link
from ..transport.mesh import Mesh
from ..transport.p2p import shard_runtime

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
    if isinstance(exc, (transport.WorkerFailure, NonFiniteGradientError)) or "(in module" in str(exc):
        return exc  # a step's gradient check names its parameter, not a module the forward was in
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


class ModelPart:
    """This worker's copy of one model and its shard's engine, on the transport the driver chose. ("Replica"
    is kept for the data-parallel copies of the SPMD mode.)"""

    def __init__(self, proc: WorkerRuntime, model: torch.nn.Module, transport_name: str, seed: int = 0,
                 compile: bool = False) -> None:
        """``proc``: the worker process's runtime (its host's)."""
        if transport_name == "p2p":
            mesh = Mesh(1, proc.workers, 0, proc.index, tuple(range(proc.workers)), None, None, (proc.index,))
            rt = shard_runtime(mesh, proc.device, proc.timeout, proc.stats, proc.grad_group, proc.checks, proc.reads)
        else:
            rt = proc  # its mailbox takes the RPC pushes
        self.transport = transport_name
        self.rt = rt
        self.engine = ShardEngine(model, rt, grad_group=proc.grad_group, seed=seed, compile=compile)
        self.model = self.engine.model
        self.kept = None
        """The output of a forward whose backward the driver starts later (p2p, a loss on the driver)."""
        self.pyramid = None
        """The writer of a pyramid being written (``bigconv.data.pyramid.LevelWriter``)."""
        self.recorder = None
        """The hooks of a capture under way (``bigconv.engine.capture.Recorder``)."""
        self.last_call: ShardCall | None = None
        """The last call's ``ShardCall`` on the ``rpc`` transport: its step (``step_from_context``) checks the
        gradients as it says."""

    @classmethod
    def install(cls, host, payload: bytes, transport_name: str, seed: int = 0, compile: bool = False) -> "ModelPart":
        """The part a ``WorkerHost`` holds for one model (``World.install``)."""
        return cls(host.rt, pickle.loads(payload), transport_name, seed, compile)

    def set_training(self, mode: bool) -> None:
        self.model.train(mode)

    def prefetch(self, reads: list) -> None:
        self.rt.reads.start(reads)

    def _located(self, exc: Exception) -> Exception:
        return _located(exc, f"{self.engine.path.current} on {transport.worker_name(self.rt.index)}")

    def _forward(self, shard: ShardCall, grad):
        if self.transport == "rpc":
            self.rt.mailbox.drop_calls_before(shard.call)
            self.last_call = shard
        try:
            return step.forward(self.engine, shard, grad)
        except Exception as exc:
            raise self._located(exc) from exc

    def forward(self, shard: ShardCall, loss_fn=None, grad=True):
        """Run this shard; return the output shard, the replicated output, or (num, den) of the loss.

        Inference on either transport, and the forward of a step on ``rpc``."""
        try:
            out = self._forward(shard, grad)
            if loss_fn is not None:
                target = self.engine.read_agreed(shard.target)
                if isinstance(shard.target, ShardRead):  # this worker's box of the label maps
                    losses.check_labels_here(loss_fn, out, target)
                num, den = losses.shard_parts(loss_fn.to(self.rt.device), out, target.to(self.rt.device))
                return num.cpu(), den
            return self._sent(out, grad)
        finally:
            if self.transport == "rpc":
                rpc_link.flush(self.rt)  # RPC pushes

    def _sent(self, out, grad, kept: bool = False):
        """What goes back to the driver: each output tensor on the CPU (several: a list), a replicated one
        from worker 0 only when no gradient flows back through the other copies over RPC. An output
        ``kept`` here for a later backward goes as plain data; its graph stays here."""
        def one(t: torch.Tensor) -> torch.Tensor | None:
            if global_shape(t) is None and self.rt.index != 0 and (kept or not grad):
                return None  # worker 0's copy is the one that counts
            return t.detach().cpu() if kept else t.cpu()

        return one(out) if isinstance(out, torch.Tensor) else [one(t) for t in pytree.tree_leaves(out)]

    def predict(self, shard: ShardCall, path: str, box, keep: str = "float") -> None:
        """Run this shard without gradients and write its output region, as ``keep`` says
        (``bigconv.data.pyramid.convert``), into the zarr array at ``path``."""
        from ..data import outputs, pyramid

        out = self.forward(shard, grad=False)
        outputs.write(path, box_index(box, out.dim()), pyramid.convert(keep, out, out.shape[1], box, path))

    def predict_several(self, shard: ShardCall, targets: list, keep: str = "float") -> None:
        """``predict`` of a model with several outputs: ``targets[i]`` is, for output tensor i, ``(zarr array
        path, this shard's box)`` or ``(path, box, kind)`` (``keep`` when none), ``("ome", image root, its
        pyramid spec, this shard's coord)`` for level 0 of an OME-Zarr image whose next levels
        ``pyramid_level`` writes, or None for one not written (a vector per image)."""
        from ..data import outputs, pyramid

        self.pyramid = None
        leaves = self.forward(shard, grad=False)  # each output as sent: this shard's part of each dense one
        writers = []
        for t, target in zip(leaves, targets):
            if target is None:
                continue
            if target[0] == "ome" and len(target) == 4:
                writers.append(pyramid.LevelWriter(target[2], target[1], target[3]))
                writers[-1].first(t)
                continue
            path, box, kind = target if len(target) == 3 else (*target, keep)
            outputs.write(path, box_index(box, t.dim()), pyramid.convert(kind, t, t.shape[1], box, path))
        if writers:
            self.pyramid = pyramid.Writers(writers)

    def predict_pyramid(self, shard: ShardCall, root: str, spec, coord) -> None:
        """Level 0 of an OME-Zarr pyramid: this shard's region; kept here for ``pyramid_level``."""
        from ..data import pyramid

        self.pyramid = None
        writer = pyramid.LevelWriter(spec, root, coord)
        writer.first(self.forward(shard, grad=False))
        self.pyramid = writer

    def pyramid_level(self, level: int) -> None:
        """Level ``level`` of the pyramid ``predict_pyramid`` began, from this worker's region above."""
        if self.pyramid is None:
            raise RuntimeError("no pyramid is being written here (an earlier call failed); predict again")
        self.pyramid.next(level)
        if level == self.pyramid.spec.levels - 1:
            self.pyramid = None

    # -- captures of named modules (bigconv.capture) ----------------------------------------------------
    def capture_begin(self, names: list, grads: bool) -> None:
        """Hook the modules ``names`` until ``capture_end`` (``bigconv.engine.capture.Recorder``)."""
        from ..engine.capture import Recorder

        self.capture_end()
        self.recorder = Recorder(self.model, names, grads)

    def capture_end(self) -> dict | None:
        """Remove the hooks; what they recorded on this shard, per name and call."""
        recorder, self.recorder = self.recorder, None
        if recorder is None:
            return None
        recorder.close()
        return recorder.result()

    def capture_layout(self) -> dict:
        """Per name and call, what the driver needs to make the arrays ``capture_write`` fills
        (``capture_layout_of``)."""
        return self.capture_layout_of(self.recorder.calls)

    @staticmethod
    def capture_layout_of(calls: dict) -> dict:
        """Per name and call of a ``Recorder``'s ``calls`` (a worker's, or an SPMD rank's): the global
        shape, the dtype, whether it is sharded and whether a gradient reached it."""
        return {name: [(p.value.shape[:p.value.dim() - len(p.shape)] + tuple(p.shape) if p.shape else
                        tuple(p.value.shape), str(p.value.dtype).replace("torch.", ""), p.shape is not None,
                        p.grad is not None) for p in pieces] for name, pieces in calls.items()}

    def capture_write(self, root: str, grid, coord) -> dict:
        """Write this shard's parts of the sharded captures into the group ``root`` (``KEY/output``,
        ``KEY/grad``); worker 0 writes the whole tensors' values. Returns the gradients of the whole
        tensors (the driver sums the copies'); the hooks end here."""
        calls = self.recorder.calls
        self.capture_end()
        return self.capture_write_parts(calls, root, grid, coord, self.rt.index == 0)

    @staticmethod
    def capture_write_parts(calls: dict, root: str, grid, coord, first: bool) -> dict:
        """Write the parts at ``coord`` of a ``Recorder``'s sharded ``calls`` into the arrays of the group
        ``root``, and with ``first`` the whole tensors' values; the whole tensors' gradients, per key."""
        import zarr

        from ..engine.capture import call_names
        from ..geometry.boxes import shard_box

        whole_grads = {}
        for name, pieces in calls.items():
            for key, p in zip(call_names(name, len(pieces)), pieces):
                if p.shape is None:
                    if first:
                        zarr.open_array(f"{root}/{key}/output", mode="r+")[...] = p.value.cpu().numpy()
                    whole_grads[key] = None if p.grad is None else p.grad.cpu()
                    continue
                index = box_index(shard_box(p.shape, tuple(grid), tuple(coord)), p.value.dim())
                zarr.open_array(f"{root}/{key}/output", mode="r+")[index] = p.value.cpu().numpy()
                if p.grad is not None:
                    zarr.open_array(f"{root}/{key}/grad", mode="r+")[index] = p.grad.cpu().numpy()
        return whole_grads

    def capture_forward(self, shard: ShardCall) -> None:
        """A forward without gradients whose output stays here (the hooks record what they need)."""
        self.forward(shard, grad=False)

    def capture_score(self, shard: ShardCall, target) -> None:
        """Forward and backward of an output score (``engine.capture.score_gradient``), built on this
        shard: no gradients summed into the weights, no step."""
        from ..engine.capture import score_gradient

        out = self._forward(shard, "input")
        cmd = StepCommand(shard, OutputGradients(score_gradient(out, target, self.rt.index == 0)), grad="input",
                          gradients=True)
        try:
            step.run(self.engine, cmd, out)
        except Exception as exc:
            raise self._located(exc) from exc

    def gradcam_sums(self, name: str) -> torch.Tensor:
        """This shard's per-channel sums of the gradient reaching ``name`` (captured by ``capture_score``)."""
        from ..engine.capture import channel_sums

        return channel_sums(self.recorder.calls[name][0])

    def gradcam_map(self, name: str, weights, grid, call: int, size, region) -> torch.Tensor | None:
        """This shard's part of the Grad-CAM map on the input grid; the hooks end here. With ``region``
        (path, box index), written into the zarr array there instead of sent back."""
        from ..engine.capture import cam_map

        piece = self.recorder.calls[name][0]
        self.capture_end()
        try:
            up = cam_map(self.engine, tuple(grid), call, piece, weights, tuple(size))
        except Exception as exc:
            raise self._located(exc) from exc
        return self._region(up, region)

    def saliency_map(self, region) -> torch.Tensor | None:
        """max over channels of |d score / d input| on this shard (after ``capture_score``)."""
        self.capture_end()
        x = self.engine.last_input
        g = x.grad if x is not None and x.grad is not None else torch.zeros_like(x)
        return self._region(g.detach().abs().amax(1, keepdim=True).cpu(), region)

    def _region(self, t: torch.Tensor, region):
        """``t`` itself (``region`` None), or None after writing it: ``("zarr", path, index)`` into an array,
        ``("ome", root, spec, coord)`` as level 0 of a pyramid whose next levels ``pyramid_level`` writes."""
        if region is None:
            return t
        from ..data import outputs, pyramid

        if region[0] == "zarr":
            outputs.write(region[1], region[2], t.numpy())
        else:
            self.pyramid = pyramid.LevelWriter(region[2], region[1], region[3])
            self.pyramid.first(t)
        return None

    def make_optimizer(self, spec: bytes) -> dict:
        """``spec``: ``ShardEngine.make_optimizer``'s arguments, pickled by value on the driver."""
        return self.engine.make_optimizer(**pickle.loads(spec))

    # -- a step on the p2p transport: the shard-step of every SPMD rank, fed by the driver's commands ------
    def step(self, cmd: StepCommand):
        """The engine's shard-step for ``cmd``: the whole loss for a per-shard loss (one message from the
        driver); for the gradients of a loss the driver took (the output kept from ``keep_forward``),
        with ``cmd.gradients`` (this shard's input gradient, the summed parameter gradients on worker 0)."""
        kept = None
        if isinstance(cmd.loss, OutputGradients):
            kept, self.kept = self.kept, None
            if kept is None:
                raise RuntimeError("no forward is waiting for its backward (an earlier call failed); call again")
        try:
            result = step.run(self.engine, cmd, kept)
        except Exception as exc:
            raise self._located(exc) from exc
        if cmd.gradients:
            return result.input_grad, (result.param_grads if self.rt.index == 0 else None)
        return None if result.loss is None else float(result.loss)

    def keep_forward(self, shard: ShardCall, grad):
        """The forward of a step whose loss the driver computes: the output goes back to the driver and
        stays here, for ``step`` with its gradient."""
        self.kept = None
        out = self._forward(shard, grad)
        self.kept = out
        return self._sent(out, grad, kept=True)

    # -- a step on the rpc transport: gradients from the driver's distributed-autograd context -----------
    def step_from_context(self, context_id: int) -> None:
        self.engine.buckets.reduce(dist_autograd.get_gradients(context_id))
        shard = self.last_call
        self.engine.end(step=True, check_finite=shard is not None and shard.check_finite,
                        call=None if shard is None else shard.call)

    def gradients(self, context_id: int) -> tuple[torch.Tensor | None, dict]:
        """This shard's input gradient and this replica's (unreduced) parameter gradients."""
        grads = dist_autograd.get_gradients(context_id)
        x = self.engine.last_input
        params = {name: grads[p].cpu() for name, p in self.model.named_parameters() if p in grads}
        return (grads[x].cpu() if x is not None and x in grads else None), params

    # -- state ----------------------------------------------------------------------------------------------
    def state_dict(self, ema: bool = False) -> dict:
        """The weights, or with ``ema`` their moving average (``net.optimizer(..., ema=)``)."""
        return self.engine.ema_state() if ema else self.engine.state_dict()

    def checkpoint_state(self, full: bool) -> dict:
        """This replica's generator states and random draws' counter; with ``full``, its weights and optimizer
        state as well."""
        state: dict = {"rng": rng_state(self.rt.device), "draws": self.engine.draws_state()}
        if full:
            state["model"] = self.state_dict()
            state["optimizer"] = self.engine.optimizer_state()
            state["scheduler"] = self.engine.scheduler_state()
            state["ema"] = self.engine.ema_state()
        return state

    def load_checkpoint(self, model_state: dict, optimizer_state: dict | None, rng: dict | None,
                        scheduler_state: dict | None = None, ema_state: dict | None = None,
                        draws: dict | None = None) -> None:
        self.engine.load(model_state, optimizer_state, scheduler_state, ema_state, draws)
        if rng is not None:
            set_rng_state(rng, self.rt.device)

    def restore_draws(self, draws: dict) -> None:
        """``ParallelModel.load_draws_state``: the random draws go on from ``draws`` (checked by the driver)."""
        self.engine.random.restore(draws)
