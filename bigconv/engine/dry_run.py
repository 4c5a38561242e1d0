"""The driver's dry run: every shard's forward, on meta tensors, before any remote work.

Each shard runs in its own thread with the workers' own code (``ShardMode``, the rules, the
``ShardExecutor``) on a meta copy of the model; messages go from thread to thread instead of over
RPC. So the dry run is not a second set of checks that could drift from what workers do: an
operation that would fail on a worker fails here first, with the same message, and costs no
memory (meta tensors have shapes but no data).
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .executor import ShardExecutor
from ..geometry.boxes import all_coords, shard_box
from ..ops.shards import ModulePath, global_shape, global_size, mark, tree_flatten
from ..ops.mode import ShardMode
from ..ops.sync_norm import adopt as adopt_sync_batchnorm
from ..ops import global_attention, whole
from ..transport import Mailbox, WorkerFailure, WorkerRuntime
from ..transport.rpc import LocalLink

DRY_RUN_TIMEOUT_S = 60.0
"""A shard of the dry run waiting this long on another is a bug in bigconv, not the user's model."""


@dataclass(frozen=True)
class DryRunResult:
    out_shape: tuple[int, ...] | None
    """Global spatial shape of a sharded output; None when the output is replicated (a head)."""
    out_full_shape: tuple[int, ...]
    outputs: tuple = ()
    """Several outputs (a list, tuple or dict of tensors): each one's ``(out_shape, out_full_shape)``, in
    the order of ``spec``; empty for one tensor."""
    spec: Any = None
    """The structure of several outputs (a ``torch.utils._pytree`` spec); None for one tensor."""


def copy_model(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model)``, also for a model holding computed tensors as attributes: the old
    ``torch.nn.utils.weight_norm`` keeps ``weight`` as a non-leaf (recomputed before every forward),
    which ``deepcopy`` refuses; the copy gets it detached."""
    memo: dict = {}
    for module in model.modules():
        for value in module.__dict__.values():
            if isinstance(value, torch.Tensor) and not value.is_leaf:
                memo[id(value)] = value.detach().clone()
    return copy.deepcopy(model, memo)


def meta_copy(model: nn.Module) -> nn.Module:
    """The model on meta tensors; scalar buffers stay real, because forward code may read them
    (BatchNorm with momentum=None divides by ``num_batches_tracked``), and on the CPU, where a
    scalar joins tensors of any device (a CUDA model's would sit on CUDA beside meta activations)."""
    meta = adopt_sync_batchnorm(copy_model(model))  # what the workers run (bigconv.ops.sync_norm)
    scalars = {name: buf.cpu() for name, buf in meta.named_buffers() if buf.dim() == 0}
    meta.to("meta")
    for name, buf in scalars.items():
        owner, _, attr = name.rpartition(".")
        setattr(meta.get_submodule(owner) if owner else meta, attr, buf)
    return meta


_TRANSFERS = {"_to_copy", "copy_", "lift_fresh", "lift_fresh_copy", "detach", "alias", "_local_scalar_dense"}
"""Ops that may take a real tensor in the dry run: moving it onto meta (``x.to(y.device)``), reading
a CPU scalar (``num_batches_tracked``)."""


class MetaOnly(TorchDispatchMode):
    """Keeps every tensor of the dry run on meta: a tensor made for another device (``x.cpu()``,
    ``torch.empty(..., device="cpu")``, ``save_on_cpu``'s host copies) is made on meta instead, and
    a real tensor other than a CPU scalar meeting the forward's tensors is a clear error rather than
    a device mix-up the workers would not have."""

    def __init__(self, path: ModulePath) -> None:
        super().__init__()
        self.path = path

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and torch.device(device).type != "meta":
            kwargs["device"] = torch.device("meta")
            if kwargs.get("pin_memory"):
                kwargs["pin_memory"] = False
        if func.overloadpacket.__name__ not in _TRANSFERS:
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, torch.Tensor) and t.device.type != "meta" and not (
                        t.dim() == 0 and t.device.type == "cpu"):
                    raise ValueError(
                        f"the dry run met a tensor of shape {tuple(t.shape)} on {t.device} in {func} in "
                        f"{self.path.current}: the model's "
                        "forward uses a tensor that is neither a parameter nor a buffer (a plain attribute, a "
                        "global); register it with module.register_buffer(name, tensor) so it moves with the "
                        "model, or move it in forward with .to(x.device)")
        return func(*args, **kwargs)


class PlanMismatch(Exception):
    """The dry run planned a layer's output shape other than one process's: a bug in bigconv."""


def _record_shapes(model: nn.Module, into: list) -> None:
    """Every module's output shapes, in call order; under a ``ShardMode`` ``t.shape`` is the global one."""
    for name, module in model.named_modules():
        label = f"'{name or '<root>'}' ({type(module).__name__})"
        module.register_forward_hook(lambda _m, _i, out, label=label: into.append(
            (label, [tuple(t.shape) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)])))


def check_shapes(meta: nn.Module, planned: list, x_shape: tuple[int, ...], dtype: torch.dtype,
                 training: bool) -> None:
    """Compare the shapes the shards planned, layer by layer, with one process's shape arithmetic (on
    meta tensors, no data); a difference is a bug in bigconv's rules, never a silent plan."""
    model = copy.deepcopy(meta).train(training)
    global_attention.install(model)  # the submodules the shards call (no PosEmbedRel call)
    single: list = []
    _record_shapes(model, single)
    with torch.enable_grad(), torch.device("meta"), MetaOnly(ModulePath(model)):
        model(torch.empty(x_shape, dtype=dtype, device="meta"))
    for (where, got), (ref_where, want) in zip(planned, single):
        if where != ref_where or got != want:
            raise PlanMismatch(
                f"bigconv planned outputs of shape {got} for module {where}, but one process gives {want} for "
                f"module {ref_where} on an input of shape {x_shape}; this is a bug in bigconv's op rules: please "
                "report it with the model")
    if len(planned) != len(single):
        raise PlanMismatch(f"the shards ran {len(planned)} module calls, one process {len(single)}, on an input of "
                           f"shape {x_shape}; this is a bug in bigconv: please report it with the model")


def dry_run(meta: nn.Module, grid: tuple[int, ...], x_shape: tuple[int, ...], dtype: torch.dtype,
            training: bool) -> DryRunResult:
    """Run every shard of ``meta`` (a ``meta_copy``) on an input of ``x_shape``; raise what a worker would."""
    coords = list(all_coords(grid))
    # The shards take turns: a shard runs while it holds ``turn`` and lets it go only while it waits for a
    # message (a mailbox's wait releases its lock). As free threads they fought for the GIL, which every
    # op's C++ call releases and retakes: 1.6 million futex calls and 7.4 s for 9 shards of ResNet-50, not
    # 3.5 s when they take turns; the order of their work is the same messages either way.
    turn = threading.RLock()
    mailboxes = [Mailbox(turn) for _ in coords]
    spatial = tuple(x_shape[2:])
    outs: list = [None] * len(coords)
    planned: list = []
    errors: list = [None] * len(coords)

    def shard(index: int) -> None:
        with turn:
            run_shard(index)

    def run_shard(index: int) -> None:
        rt = WorkerRuntime(index=index, workers=len(coords), device=torch.device("meta"), timeout=DRY_RUN_TIMEOUT_S,
                           mailbox=mailboxes[index])
        rt.link = LocalLink(rt, mailboxes)  # delivers into the other shards' mailboxes, in this process
        model = copy.deepcopy(meta).train(training)
        path = ModulePath(model)
        whole.install(model)  # after the path's hooks, as on the workers
        global_attention.install(model)
        if index == 0:
            _record_shapes(model, planned)
        box = shard_box(spatial, grid, coords[index])
        x = mark(torch.empty((*x_shape[:2], *(b - a for a, b in box)), dtype=dtype, device="meta"), spatial)
        try:
            # Tensors the forward builds without a device land on meta too, next to the model's.
            with torch.enable_grad(), torch.device("meta"), MetaOnly(path), ShardMode(ShardExecutor(grid, 0, rt), path):
                out = model(x)
            outs[index] = out
        except BaseException as exc:  # reported by the driver's thread, naming the module
            exc.bigconv_where = path.current
            errors[index] = exc
            for box_ in mailboxes:
                box_.abort(f"shard {index} of the dry run failed")

    threads = [threading.Thread(target=shard, args=(i,), name=f"bigconv-dry-run-{i}", daemon=True)
               for i in range(len(coords))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors if e is not None and not isinstance(e, WorkerFailure)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    check_shapes(meta, planned, x_shape, dtype, training)
    out = outs[0]
    if isinstance(out, torch.Tensor):
        return DryRunResult(*_output_shapes(out, grid))
    # Several outputs (deep supervision, a dict of heads): each a dense map or a replicated vector.
    leaves, spec = pytree.tree_flatten(out)
    if not leaves or not all(isinstance(t, torch.Tensor) for t in leaves):
        kinds = sorted({type(t).__name__ for t in leaves} - {"Tensor"}) or ["nothing"]
        raise ValueError(f"the model returns {type(out).__name__} holding {', '.join(kinds)}; bigconv supports a "
                         "tensor, or a list, tuple or dict of tensors (return only the tensors, e.g. drop None "
                         "entries)")
    return DryRunResult(None, (), tuple(_output_shapes(t, grid) for t in leaves), spec)


def _output_shapes(out: torch.Tensor, grid: tuple[int, ...]) -> tuple:
    shape = global_shape(out)
    if shape is None:
        return None, tuple(out.shape)
    return shape, tuple(global_size(out, len(grid)))
