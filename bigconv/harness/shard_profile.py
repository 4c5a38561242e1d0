"""What one shard of a training step computes, holds and exchanges, from the dry run (meta tensors, no memory).

``profile`` runs the front ends' own dry run (``bigconv.planning.Planner``, i.e. ``bigconv.engine.dry_run``:
every shard's forward on meta tensors in its own thread, with the workers' rules and executor) and
instruments each shard's forward from inside it, through hooks on the model's root module that the dry
run copies into every shard:

- a ``TorchDispatchMode`` sees every aten op the shard runs on its local tensors: FLOPs of the matmul
  class (``torch.utils.flop_counter``'s formulas: convolutions, mm, bmm, attention), bytes read and
  written by every other op, the module that ran it, and which storages it allocated and read;
- ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor autograd keeps for backward;
- the executor's link is wrapped, so every exchange (halo or gather) is recorded with its peers, its
  bytes and the ops run between its start and its finish (the compute that hides it).

From that record, ``ShardProfile`` replays the step's memory: the forward's live storages, then a
backward in reverse op order in which each saved storage is freed after the backward of the first op
that saved it and each activation's gradient lives from the backward of its last reader to that of its
producer. Halo buffers (what was sent and received) live from their exchange to its backward, as the
SPMD link (``bigconv.transport.p2p``) keeps them. Parameters, buffers and the input shard are left to
the caller (they are the same on every shard and known without a dry run).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.utils.flop_counter as flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..geometry.boxes import coord_of
from ..ops.mode import active_mode
from ..ops.shards import global_shape
from ..planning import Planner

MATMUL = set(flop_counter.flop_registry)
"""Ops whose cost is their FLOPs (convolution, mm, addmm, bmm, attention kernels)."""
FREE = {"detach", "alias", "lift_fresh", "lift_fresh_copy", "_local_scalar_dense", "empty", "empty_strided",
        "new_empty", "new_empty_strided", "_to_copy"}
"""Ops that move no data here (``_to_copy`` is the dry run's meta-to-meta ``.to``)."""


@dataclass
class OpRecord:
    index: int
    module: str
    """The innermost module running (``'layer1.0.conv1' (Conv2d)``), or ``<root>``."""
    op: str
    """The aten op (``convolution``, ``native_batch_norm``...)."""
    matmul: bool
    flops: float
    """Forward FLOPs (matmul class; 0 otherwise)."""
    bwd_flops: float
    """FLOPs of its backward (gradients of the operands that need them; matmul class)."""
    bytes: int
    """Bytes read and written by the forward op (its operands and results)."""
    key: tuple
    """What an op table (``bigconv.harness.op_table``) knows this op by: its shape class, not its size."""
    halo_copy: bool = False
    """Issued while an exchange started (copies of the parts to send): halo traffic, not compute."""
    in_bytes: int = 0
    """Bytes of its first operand (a convolution's input)."""
    out_bytes: int = 0
    """Bytes of its first result."""


@dataclass
class Exchange:
    start: int
    """Op index when it started."""
    finish: int
    """Op index when it finished: the ops between ran while it was in flight."""
    module: str
    kind: str
    """``halo`` (parts of a map, from the neighbours that hold them) or ``gather`` (every shard's whole
    tensor: statistics, whole-map gathers)."""
    sent: list = field(default_factory=list)
    """(peer shard, bytes) of each message sent."""
    recv: list = field(default_factory=list)
    """(peer shard, bytes) of each message received."""

    @property
    def bytes(self) -> int:
        return sum(b for _, b in self.sent) + sum(b for _, b in self.recv)


@dataclass
class ShardProfile:
    shard: int
    coord: tuple[int, ...]
    grid: tuple[int, ...]
    ops: list[OpRecord]
    exchanges: list[Exchange]
    saved_bytes: int
    """Storages autograd keeps for backward at the end of the forward (parameters and the input aside)."""
    forward_live: list
    """Activation and halo bytes live during each op of the forward (its results included)."""
    backward_live: list
    """Activation, gradient and halo bytes live during each op's backward."""
    halo_bytes: int
    """Every exchange's sent and received buffers, held from the exchange to its backward."""
    output_bytes: int = 0
    output_dense: bool = False
    """The output is a map split over the shards (a per-pixel loss holds its log-probabilities)."""
    param_first_use: dict = field(default_factory=dict)
    """Parameter name -> index of the first op that read it (its gradient is complete after that op's backward)."""
    smallest_map: list | None = None
    """Per spatial dim, the smallest global extent of a map split over the grid."""

    def peaks(self, fwd_extra: list | None = None, bwd_extra: list | None = None, after: int = 0
              ) -> tuple[int, str, int]:
        """(most memory live at once, in which pass, at which op): activations and halo buffers, plus
        ``fwd_extra[i]`` during op i's forward and ``bwd_extra[i]`` during its backward (transient workspace,
        parameter gradients as they appear), and ``after`` once the backward is done."""
        best = (0, "forward", 0)
        for i, (f, b) in enumerate(zip(self.forward_live, self.backward_live)):
            f += fwd_extra[i] if fwd_extra else 0
            b += bwd_extra[i] if bwd_extra else 0
            best = max(best, (int(f), "forward", i), (int(b), "backward", i))
        return max(best, (int(after), "after backward", len(self.ops)))

    @property
    def activation_peak_bytes(self) -> int:
        return self.peaks()[0]

    def flops(self) -> tuple[float, float]:
        return (sum(o.flops for o in self.ops), sum(o.bwd_flops for o in self.ops))


class _Recorder(TorchDispatchMode):
    """One shard's forward, op by op (installed by the root module's pre-hook, in the shard's thread)."""

    def __init__(self, params: dict[int, str], path=None) -> None:
        super().__init__()
        self.params = params  # storage id -> parameter or buffer name
        self.path = path  # a ModulePath naming the module, where no ShardMode runs (a plain profile)
        self.ops: list[OpRecord] = []
        self.alloc: dict[int, tuple[int, int]] = {}  # storage -> (op index, bytes)
        self.last_use: dict[int, int] = {}
        self.grad: set[int] = set()  # storages whose values need a gradient
        self.saved: dict[int, int] = {}  # storage -> first op index that saved it
        self.keep: list = []  # storages stay referenced, so their ids are never reused within the forward
        self.param_first_use: dict[str, int] = {}
        self.in_start = False
        self.halo_storages: set[int] = set()
        self.smallest: list | None = None
        self.output = (0, False)

    def _key(self, t: torch.Tensor) -> int:
        s = t.untyped_storage()
        self.keep.append(s)
        return s._cdata

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        with torch._C.DisableTorchFunction():
            self._record(func, args, kwargs, out)
        return out

    def _record(self, func, args, kwargs, out) -> None:
        index = len(self.ops)
        name = func.overloadpacket.__name__
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        in_keys = [self._key(t) for t in ins]
        needs_grad = any(t.requires_grad for t in ins) or any(k in self.grad for k in in_keys)
        for k in in_keys:
            if k in self.params:
                self.param_first_use.setdefault(self.params[k], index)
            elif k in self.alloc:
                self.last_use[k] = index
        for t in outs:
            k = self._key(t)
            if k in self.params or k in self.alloc or k in in_keys:
                if k in self.alloc:
                    self.last_use[k] = index
                continue
            if not self.in_start and k not in self.halo_storages:
                self.alloc[k] = (index, t.untyped_storage().nbytes())
                if needs_grad and t.dtype.is_floating_point:
                    self.grad.add(k)
            elif self.in_start:
                self.halo_storages.add(k)
        packet = func.overloadpacket
        matmul = packet in MATMUL
        flops = bwd = 0.0
        if matmul:
            flops = float(flop_counter.flop_registry[packet](*args, **kwargs, out_val=out))
            operands = ins[:2] if name != "addmm" else ins[1:3]
            bwd = flops * sum(bool(t.requires_grad) for t in operands)
        view = func.is_view or name in FREE
        nbytes = 0 if view else sum(t.numel() * t.element_size() for t in ins + outs)
        mode = active_mode()
        path = mode.path if mode is not None else self.path
        module = path.stack[-1] if path is not None and path.stack else "<root>"
        for t in ins:
            shape = global_shape(t)
            if shape is not None:
                self.smallest = [min(a, b) for a, b in zip(self.smallest, shape)] if self.smallest else list(shape)
        self.ops.append(OpRecord(index, module, name, matmul, flops, bwd, nbytes, op_key(func, args, ins),
                                 halo_copy=self.in_start,
                                 in_bytes=ins[0].numel() * ins[0].element_size() if ins else 0,
                                 out_bytes=outs[0].numel() * outs[0].element_size() if outs else 0))

    def pack(self, t: torch.Tensor):
        with torch._C.DisableTorchFunction():
            k = self._key(t)
            if k in self.alloc:
                self.saved.setdefault(k, max(0, len(self.ops) - 1))
        return t


def op_key(func, args, ins: list) -> tuple:
    """The class of an op for op tables: convolutions by channels, kernel, stride, dilation, groups and
    direction; other matmuls and every other op by name; all with the dtype."""
    name = func.overloadpacket.__name__
    dtype = str(ins[0].dtype).replace("torch.", "") if ins else "none"
    if name == "convolution" and len(args) >= 9:
        x, w = args[0], args[1]
        stride, _, dilation, transposed, _, groups = args[3:9]
        return ("conv", dtype, int(x.shape[1]), int(w.shape[0]), tuple(w.shape[2:]), tuple(stride),
                tuple(dilation), int(groups), bool(transposed))
    return (name, dtype)


def _numel(shape: tuple[int, ...], index) -> int:
    """Elements of ``x[index]`` for an index of slices and at most one Ellipsis (None: all of ``x``),
    without indexing (which would run ops in the shard being recorded)."""
    if index is None:
        return math.prod(shape)
    index = tuple(index) if isinstance(index, tuple) else (index,)
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (len(shape) - len(index) + 1) + index[at + 1:]
    index = index + (slice(None),) * (len(shape) - len(index))
    return math.prod(len(range(*s.indices(n))) for s, n in zip(index, shape))


class _LinkTap:
    """The executor's link, recording each exchange as it passes."""

    def __init__(self, link, rec: _Recorder, exchanges: list) -> None:
        self.link, self.rec, self.exchanges = link, rec, exchanges

    def start(self, x, key, sends, recvs):
        with torch._C.DisableTorchFunction():
            item = x.element_size()
            sent = [(dst, item * _numel(tuple(x.shape), index)) for dst, index in sends]
            received = [(src, item * math.prod(shape)) for src, shape in recvs]
        mode = active_mode()
        module = mode.path.stack[-1] if mode is not None and mode.path and mode.path.stack else "<root>"
        gather = bool(sends) and all(index is None for _, index in sends)
        ex = Exchange(len(self.rec.ops), len(self.rec.ops), module, "gather" if gather else "halo", sent, received)
        self.rec.in_start = True
        try:
            x, pending = self.link.start(x, key, sends, recvs)
        finally:
            self.rec.in_start = False
        if sends or recvs:
            self.exchanges.append(ex)
        return x, (pending, ex)

    def finish(self, pending, describe):
        inner, ex = pending
        ex.finish = len(self.rec.ops)
        return self.link.finish(inner, describe)


class _Session:
    """Shared by every shard's copy of the root hooks; one record per shard thread."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.records: dict[int, tuple] = {}
        self.lock = threading.Lock()

    def enter(self, module: nn.Module, args) -> None:
        mode = active_mode()
        if mode is None or not threading.current_thread().name.startswith("bigconv-dry-run-"):
            return  # the dry run's one-process shape check, or a forward outside the dry run
        ex = mode.executor
        with torch._C.DisableTorchFunction():
            params = {}
            for name, t in [*module.named_parameters(), *module.named_buffers()]:
                params[t.untyped_storage()._cdata] = name
        rec = _Recorder(params)
        exchanges: list[Exchange] = []
        ex.link = _LinkTap(ex.link, rec, exchanges)
        saved = torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t)
        saved.__enter__()
        rec.__enter__()
        self.local.state = (ex, rec, exchanges, saved)

    def leave(self, module: nn.Module, args, out) -> None:
        """After the root's forward; also where it raised (``out`` None): the shard's thread must end with
        nothing of ``enter`` still pushed."""
        state = getattr(self.local, "state", None)
        if state is None:
            return
        ex, rec, exchanges, saved = state
        if out is not None:
            with torch._C.DisableTorchFunction():
                leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
                rec.output = (sum(t.numel() * t.element_size() for t in leaves),
                              any(global_shape(t) is not None for t in leaves))
        rec.__exit__(None, None, None)
        saved.__exit__(None, None, None)
        ex.link = ex.link.link
        self.local.state = None
        if out is not None:
            with self.lock:
                self.records[ex.rt.index] = (rec, exchanges, ex.grid)


def profile(model: nn.Module, shape: tuple[int, ...], grid: tuple[int, ...], dtype=torch.float32,
            shards: list[int] | None = None) -> list[ShardProfile]:
    """Dry-run ``model`` on an input of ``shape`` over ``grid`` (training mode) and profile ``shards``
    (default: every shard). Raises what the dry run raises (a ``ValueError`` naming the module, the op
    and the fix)."""
    planner = Planner(model, tuple(grid), math.prod(grid), check_finite=False)
    session = _Session()
    # Plain functions, not bound methods: the dry run deep-copies the model per shard, and a function is
    # copied as itself (so every shard's copy reports to this session), a method with its object.
    pre = planner.meta.register_forward_pre_hook(lambda m, a: session.enter(m, a))
    # always_call: a shard whose forward raises (a refusal) leaves too, so that its thread ends with no
    # dispatch mode or saved-tensor hooks pushed (left pushed, their thread-local stacks held Python objects
    # past the interpreter's exit: "terminate called without an active exception", exit 134).
    post = planner.meta.register_forward_hook(lambda m, a, o: session.leave(m, a, o), always_call=True)
    try:
        planner.plan(torch.empty(shape, dtype=dtype, device="meta"), training=True)
    finally:
        pre.remove()
        post.remove()
    wanted = range(math.prod(grid)) if shards is None else shards
    return [_replay(i, *session.records[i]) for i in wanted]


def plain_profile(model: nn.Module, shape: tuple[int, ...], dtype=torch.float32) -> ShardProfile:
    """One process's training forward of ``model`` as PyTorch runs it (no shards, no bigconv rules: its own
    BatchNorm kernels), on meta tensors: the reference a published single-GPU throughput is measured on."""
    from ..engine.dry_run import MetaOnly, copy_model
    from ..ops.shards import ModulePath

    meta = copy_model(model).to("meta").train()
    path = ModulePath(meta)
    with torch._C.DisableTorchFunction():
        params = {t.untyped_storage()._cdata: n for n, t in [*meta.named_parameters(), *meta.named_buffers()]}
    rec = _Recorder(params, path)
    with torch.enable_grad(), torch.device("meta"), MetaOnly(path), \
            torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t), rec:
        out = meta(torch.empty(shape, dtype=dtype, device="meta"))
    leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    rec.output = (sum(t.numel() * t.element_size() for t in leaves), False)
    return _replay(0, rec, [], (1,) * (len(shape) - 2))


def _replay(index: int, rec: _Recorder, exchanges: list[Exchange], grid) -> ShardProfile:
    n = len(rec.ops)
    last = {k: rec.last_use.get(k, a) for k, (a, _) in rec.alloc.items()}
    # Forward: a storage lives from the op that made it to its last reader, or to the end when saved;
    # halo buffers from their exchange on.
    delta = [0] * (n + 2)
    for k, (a, size) in rec.alloc.items():
        delta[a] += size
        delta[(n if k in rec.saved else last[k]) + 1] -= size
    for ex in exchanges:
        delta[min(ex.start, n)] += ex.bytes
    # Backward, op n-1 down to 0: at op i, saved storages first saved at or before i, halo buffers of
    # exchanges started at or before i, and the gradients of values made at or before i and read at or
    # after i are alive.
    grow = [0] * (n + 2)
    for k, first in rec.saved.items():
        grow[first] += rec.alloc[k][1]
    for ex in exchanges:
        grow[min(ex.start, n)] += ex.bytes
    for k in rec.grad:
        a, size = rec.alloc[k]
        grow[a] += size
        grow[last[k] + 1] -= size
    forward, backward, live, held = [], [], 0, 0
    for i in range(max(n, 1)):
        live += delta[i]
        held += grow[i]
        forward.append(live)
        backward.append(held)
    return ShardProfile(
        shard=index, coord=coord_of(index, grid), grid=tuple(grid), ops=rec.ops, exchanges=exchanges,
        saved_bytes=sum(rec.alloc[k][1] for k in rec.saved), forward_live=forward, backward_live=backward,
        halo_bytes=sum(ex.bytes for ex in exchanges), output_bytes=rec.output[0], output_dense=rec.output[1],
        param_first_use=dict(rec.param_first_use), smallest_map=rec.smallest)
