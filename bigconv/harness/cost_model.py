"""Per-process memory and step time of an SPMD training step, from the shard profiles and a named cluster.

``estimate(model, shape, cluster, grid)`` profiles the shards of a *proxy* grid (``proxy``: at most 3
shards per axis, each the size of the real grid's largest shard, so the middle one has every neighbour an
interior shard of the real grid has) with the front ends' dry run (``bigconv.harness.shard_profile``),
and prices each shard's step on ``cluster``:

- memory: parameters, their gradients, the gradient buckets (``bigconv.engine.buckets`` concatenates
  each bucket into a flat tensor that the summed gradients then live in), optimizer state, the
  activations' peak (the profile's forward/backward replay, with the device's convolution workspace),
  halo buffers, the input shard, a dense loss's log-probabilities and gradient, and the device's reserve;
- time: every op's forward and backward at the device's sustained rate (FLOPs for convolutions and
  matmuls, bytes for everything else: a roofline), or at an op table's measured rate
  (``bigconv.harness.op_table``); every exchange twice (forward and its adjoint) at latency + bytes /
  bandwidth on the link its messages take (the ranks of a node are consecutive, replica-major as
  ``bigconv.spmd`` lays them out), hidden up to the compute its shard runs while it is in flight; the
  gradient allreduce as a ring over every rank, bucket by bucket as backward completes them; the
  optimizer's update as memory traffic.

The slowest and the largest of the profiled shards stand for every rank. What the model leaves out is
listed in ``docs/check.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..engine.buckets import GradBuckets
from ..geometry.boxes import all_coords, coord_of, index_of
from ..planning import InputRejected
from .devices import Device, Link
from .shard_profile import ShardProfile, plain_profile, profile

OPTIMIZER_STATES = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}
"""Tensors of a parameter's size each optimizer keeps."""
OPTIMIZER_TRAFFIC = {"sgd": 3, "momentum": 5, "adam": 7, "adamw": 7}
"""Parameter-sized tensors an update reads and writes (SGD: p, g in, p out; momentum adds the buffer in
and out; Adam both moments)."""
ITEM = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(kw_only=True)
class Cluster:
    """Where the step runs: ``gpus`` processes of ``device``, ``nodes`` nodes, ``intra``/``inter`` links."""

    device: Device
    gpus: int
    intra: Link
    inter: Link | None = None
    nodes: int | None = None
    """Default: as many as ``gpus_per_node`` needs."""
    gpus_per_node: int | None = None
    """Default: ``gpus / nodes`` when ``nodes`` is given, else the device's usual node."""
    dtype: str = "float32"
    """The model's and the activations' dtype (``model.to(dtype)``)."""
    amp: str | None = None
    """Autocast dtype (``bfloat16``/``float16``): activations and convolutions in it, parameters in ``dtype``."""
    optimizer: str = "momentum"
    op_table: object = None
    """A ``bigconv.harness.op_table.OpTable`` measured on this device: its rates replace the roofline's."""
    headroom: float = 0.1
    """Fraction of the device's memory a plan leaves free for the caching allocator's fragmentation (this
    project's H100 probe of a MONAI U-Net at 7168² failed with 2.30 of 16 GiB reserved but unallocated,
    14%; CNN2D's uniform maps left 3 MiB): a plan fits when its peak is within the rest."""

    def __post_init__(self) -> None:
        if self.gpus_per_node is None:
            self.gpus_per_node = -(-self.gpus // self.nodes) if self.nodes else self.device.gpus_per_node
        if self.nodes is None:
            self.nodes = -(-self.gpus // self.gpus_per_node)
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZER_STATES)}, got {self.optimizer!r}")
        if self.dtype not in ITEM or (self.amp is not None and self.amp not in ("bfloat16", "float16")):
            raise ValueError(f"dtype must be one of {', '.join(ITEM)} and amp bfloat16 or float16")
        if not 0 <= self.headroom < 1:
            raise ValueError(f"headroom is a fraction of the memory in [0, 1), got {self.headroom}")
        if self.gpus < 1 or self.nodes < 1 or self.gpus < self.nodes:
            raise ValueError(f"{self.gpus} GPUs on {self.nodes} nodes: need at least one GPU per node")
        if self.nodes > 1 and self.inter is None:
            raise ValueError("several nodes need an inter-node link (--inter)")

    @property
    def per_node(self) -> int:
        """Processes per node (the last node may hold fewer)."""
        return min(self.gpus, -(-self.gpus // self.nodes))

    @property
    def compute_dtype(self) -> str:
        return self.amp or self.dtype

    @property
    def act_scale(self) -> float:
        """Activation bytes of the compute dtype against the dtype the dry run ran in."""
        return ITEM[self.compute_dtype] / ITEM[self.dtype]

    def on_host(self) -> int:
        """Processes sharing one CPU host (1 on an accelerator)."""
        return self.per_node if self.device.cores else 1


class ProxyMismatch(ValueError):
    """The model decomposes but cannot take the proxy's input, and the real grid is too large to dry-run."""


REAL_GRID_LIMIT = 16
"""Grids of at most this many shards are priced on themselves when the model cannot take the proxy's input."""


def proxy(shape: tuple[int, ...], grid: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(spatial shape, grid) of the proxy: an axis cut in more than 3 shards becomes 3 shards of the real
    grid's largest extent ``ceil(n / g)``, so the middle one is an interior shard of the real grid. The
    extent is rounded up to a multiple of the power of two that divides ``n`` (at most 64, and at most the
    extent's own largest power of two), so a model that needs its input divisible by its strides (FCN2D: by
    8) takes the proxy as it takes the real image; this overstates a shard by less than 64 positions a side
    and by less than half."""
    spatial, sub = [], []
    for n, g in zip(shape, grid):
        if g <= 3:
            spatial.append(n)
            sub.append(g)
        else:
            c = -(-n // g)
            m = min(n & -n, 64, 1 << (c.bit_length() - 1))
            spatial.append(3 * -(-c // m) * m)
            sub.append(3)
    return tuple(spatial), tuple(sub)


@dataclass
class LayerRow:
    module: str
    flops: float
    bwd_flops: float
    forward_s: float
    backward_s: float
    messages: int
    """Messages this rank sends in the forward (the backward sends as many back)."""
    sent_bytes: int
    """Bytes this rank sends in the forward (as many again in the backward)."""
    comm_s: float
    """Time of this layer's exchanges, forward and backward."""
    hidden_s: float
    """Of ``comm_s``, what runs while the layer's own compute does."""


@dataclass
class Estimate:
    grid: tuple[int, ...]
    replicas: int
    shard: tuple[int, ...]
    """The largest shard's spatial extent (of the input)."""
    proxy_grid: tuple[int, ...]
    memory: dict
    """Bytes per process, by part (``total`` and ``budget`` included)."""
    time: dict
    """Seconds per step, by part (``step`` the total)."""
    layers: list[LayerRow]
    buckets: list[int]
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self.memory["budget"]


# -- profiles --------------------------------------------------------------------------------------------

class Profiler:
    """Profiles by (proxy grid, proxy input shape), each dry run once; ``model`` stays as given."""

    def __init__(self, model: nn.Module, dtype: str = "float32", plain: bool = False) -> None:
        """``plain``: profile one process's forward as PyTorch runs it (its own BatchNorm kernels, no shards;
        one-shard grids only), as published single-GPU throughputs were measured."""
        self.plain = plain
        self.model = model if dtype == "float32" else _cast(model, dtype)
        self.dtype = getattr(torch, dtype)
        self.cache: dict[tuple, list[ShardProfile]] = {}
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.names = {id(p): n for n, p in self.model.named_parameters()}

    def __call__(self, shape: tuple[int, ...], grid: tuple[int, ...]) -> list[ShardProfile]:
        key = (tuple(shape), tuple(grid))
        if key not in self.cache:
            if self.plain:
                if math.prod(grid) != 1:
                    raise ValueError("a plain profile is one process's: grid 1 x ... x 1 only")
                self.cache[key] = [plain_profile(self.model, tuple(shape), self.dtype)]
            else:
                self.cache[key] = profile(self.model, tuple(shape), tuple(grid), self.dtype)
        return self.cache[key]


def _cast(model: nn.Module, dtype: str) -> nn.Module:
    from ..engine.dry_run import copy_model

    return copy_model(model).to(getattr(torch, dtype))


def estimate(profiler: Profiler, shape: tuple[int, ...], cluster: Cluster, grid: tuple[int, ...],
             replicas: int = 1) -> Estimate:
    """Price one training step of an input of ``shape`` (N, C, *spatial) on ``grid`` x ``replicas`` ranks."""
    spatial, batch = tuple(shape[2:]), shape[0]
    ranks = math.prod(grid) * replicas
    if ranks != cluster.gpus:
        raise ValueError(f"grid {grid} x {replicas} replicas is {ranks} ranks, but the cluster has {cluster.gpus}")
    if replicas > batch:
        raise ValueError(f"{replicas} replicas need at least {replicas} images per step, the batch has {batch}")
    proxy_shape, proxy_grid = proxy(spatial, grid)
    per_replica = -(-batch // replicas)
    try:
        profiles = profiler((per_replica, shape[1], *proxy_shape), proxy_grid)
    except ValueError as exc:
        if proxy_shape == spatial or not isinstance(exc, InputRejected):
            raise  # a refusal (an op that does not decompose) holds at every size
        # A model that takes only some input sizes (a Flatten before a Linear of fixed width) cannot run on
        # the proxy's smaller image: price the real grid itself where its dry run is affordable.
        if math.prod(grid) > REAL_GRID_LIMIT:
            raise ProxyMismatch(
                f"the model runs on the input {tuple(shape)} but not on {(per_replica, shape[1], *proxy_shape)}, the "
                f"smaller image of 3 shards a side on which the planner prices grid {grid} (a model that takes only "
                f"some sizes, e.g. a Flatten before a Linear of fixed width; {exc.__cause__}); plan it on at most "
                f"{REAL_GRID_LIMIT} GPUs, which are priced on the grid itself, or make its head size-independent "
                "(nn.AdaptiveAvgPool2d before the Linear)") from exc
        proxy_shape, proxy_grid = spatial, tuple(grid)
        profiles = profiler((per_replica, shape[1], *proxy_shape), proxy_grid)
    dev = cluster.device
    notes: list[str] = []
    shard = tuple(-(-n // g) for n, g in zip(spatial, grid))

    # memory ------------------------------------------------------------------------------------------
    param_item = ITEM[cluster.dtype]
    n_params = sum(p.numel() for p in profiler.params)
    param_bytes = n_params * param_item
    buckets, bucket_of = _buckets(profiler, cluster)
    scale = cluster.act_scale
    peaks = [_peak(p_, profiler, cluster, buckets, bucket_of) for p_ in profiles]
    worst_i = max(range(len(profiles)), key=lambda i: peaks[i][0])
    worst, (peak, where, at, grads, flats) = profiles[worst_i], peaks[worst_i]
    out_bytes = worst.output_bytes if worst.output_dense else 0
    input_bytes = per_replica * shape[1] * math.prod(shard) * ITEM[cluster.dtype]
    halo_bytes = int(sum(e.bytes for e in worst.exchanges if e.start <= at) * scale)
    memory = {
        "parameters": param_bytes,
        "optimizer": OPTIMIZER_STATES[cluster.optimizer] * n_params * param_item,
        "autocast_weights": n_params * ITEM[cluster.amp] if cluster.amp else 0,
        "activations": int(peak - grads - flats) - halo_bytes,
        "halo_buffers": halo_bytes,
        "gradients": int(grads),
        "gradient_buckets": int(flats),
        "input": input_bytes,
        "loss": int(2 * out_bytes * scale),
        "reserve": dev.reserve_bytes,
    }
    memory["total"] = sum(memory.values())
    memory["budget"] = int(dev.memory_bytes * (1 - cluster.headroom))
    memory["capacity"] = dev.memory_bytes
    memory["peak_at"] = where
    notes += _small_maps(worst, spatial, proxy_shape, grid)

    # time --------------------------------------------------------------------------------------------
    slow = dev.co_run_slowdown.get(str(cluster.on_host()), 1.0) if dev.cores else 1.0
    timed = [_op_times(p_, cluster, slow) for p_ in profiles]
    placement = _Placement(grid, replicas, cluster)
    per_shard = []
    for p_, (fwd, bwd) in zip(profiles, timed):
        comm = _exchange_times(p_, placement, fwd, bwd)
        per_shard.append((p_, fwd, bwd, comm))
    slowest = max(per_shard, key=lambda s: sum(s[1]) + sum(s[2]) + sum(c[0] * 2 - c[1] - c[2] for c in s[3]))
    p_, fwd, bwd, comm = slowest
    allreduce, exposed_ar = _allreduce(buckets, bucket_of, profiler, p_, bwd, cluster)
    halo = sum(c[0] * 2 for c, e in zip(comm, p_.exchanges) if e.kind == "halo")
    gather = sum(c[0] * 2 for c, e in zip(comm, p_.exchanges) if e.kind == "gather")
    hidden = sum(c[1] + c[2] for c in comm)
    opt_s = OPTIMIZER_TRAFFIC[cluster.optimizer] * param_bytes / (dev.hbm_bytes_s * dev.hbm_efficiency) * slow
    time = {"forward": sum(fwd), "backward": sum(bwd), "halo": halo, "gather": gather, "hidden": hidden,
            "exposed_comm": halo + gather - hidden, "allreduce": allreduce, "allreduce_exposed": exposed_ar,
            "optimizer": opt_s, "co_run_slowdown": slow}
    time["step"] = time["forward"] + time["backward"] + time["exposed_comm"] + exposed_ar + opt_s
    return Estimate(grid=tuple(grid), replicas=replicas, shard=shard, proxy_grid=proxy_grid, memory=memory, time=time,
                    layers=_layers(p_, fwd, bwd, comm, placement), buckets=buckets, notes=notes)


def _peak(p_: ShardProfile, profiler: Profiler, cluster: Cluster, buckets: list[int], bucket_of: dict
          ) -> tuple[float, str, int, float, float]:
    """(the shard's peak of activations, halo buffers, parameter gradients and gradient buckets, where it
    falls, at which op, the gradients and the buckets live then). A parameter's gradient appears at the backward of the
    first op that read it; a bucket's flat copy once its last gradient has (``GradBuckets`` concatenates it
    then, and the summed gradients live in it after the step's ``finish``)."""
    item = ITEM[cluster.dtype]
    n = len(p_.ops)
    grad_at = [0.0] * (n + 1)  # bytes that appear at op i's backward
    flat_at = [0.0] * (n + 1)
    ready = [n] * len(buckets)
    for p in profiler.params:
        i = p_.param_first_use.get(profiler.names[id(p)], 0)
        grad_at[i] += p.numel() * item
        b = bucket_of[id(p)]
        ready[b] = min(ready[b], i)
    for b, i in enumerate(ready):
        flat_at[min(i, n)] += buckets[b]
    grads, flats = [0.0] * n, [0.0] * n
    g = f = 0.0
    for i in range(n - 1, -1, -1):
        g += grad_at[i]
        f += flat_at[i]
        grads[i], flats[i] = g, f
    scale = cluster.act_scale
    fwd_ws, bwd_ws = workspace(p_, cluster)
    extra = [w + (a + b) / scale for w, a, b in zip(bwd_ws, grads, flats)]
    total = sum(grad_at) + sum(flat_at)
    peak, where, at = p_.peaks(fwd_ws, extra, after=total / scale)
    if where == "backward":
        return peak * scale, f"backward of {p_.ops[at].module}", at, grads[at], flats[at]
    if where == "forward":
        return peak * scale, f"forward of {p_.ops[at].module}", at, 0.0, 0.0
    return peak * scale, where, -1, sum(grad_at), sum(flat_at)


def workspace(p_: ShardProfile, cluster: Cluster) -> tuple[list[float], list[float]]:
    """Each op's transient memory beyond its operands and result, forward and backward (in the dry run's
    dtype): the op table's measurement for its class where there is one, else the device's convolution
    rule (``Device.conv_workspace``)."""
    table = cluster.op_table
    f_ws, b_in, b_out = cluster.device.conv_workspace
    fwd, bwd = [], []
    for op in p_.ops:
        measured = table.workspace_of(op) if table is not None else None
        conv = op.key[0] == "conv"
        if measured is not None:
            f, b = measured
        else:
            f = f_ws * op.out_bytes if conv else 0.0
            b = (b_in * op.in_bytes + b_out * op.out_bytes) if conv and op.bwd_flops else 0.0
        fwd.append(f)
        bwd.append(b if op.bwd_flops or not op.matmul else 0.0)
    return fwd, bwd


def _small_maps(p_: ShardProfile, spatial, proxy_shape, grid) -> list[str]:
    notes = []
    for axis, (n, n_proxy, g) in enumerate(zip(spatial, proxy_shape, grid)):
        smallest = p_.smallest_map[axis] if p_.smallest_map else None
        if smallest is not None and g > 3 and smallest * n / n_proxy < g:
            notes.append(f"maps of about {smallest * n // n_proxy} positions along spatial dim {axis} are smaller than "
                         f"the grid's {g} shards there: the run holds them whole on every rank, which this estimate "
                         "(a 3-shard proxy along that dim) does not price")
    return notes


# -- compute ---------------------------------------------------------------------------------------------

def _op_times(p_: ShardProfile, cluster: Cluster, slow: float) -> tuple[list[float], list[float]]:
    """Forward and backward seconds of each op of a shard."""
    dev, table, dtype, scale = cluster.device, cluster.op_table, cluster.compute_dtype, cluster.act_scale
    bw = dev.hbm_bytes_s * dev.hbm_efficiency
    fwd, bwd = [], []
    for op in p_.ops:
        if op.bytes == 0 and not op.matmul:
            fwd.append(0.0)
            bwd.append(0.0)
            continue
        nbytes = op.bytes * scale
        measured = table.times(op, nbytes, dtype) if table is not None else None
        if measured is not None:
            f, b = measured
        elif op.matmul:
            rate = dev.rate(dtype, conv=op.key[0] == "conv")
            f = max(op.flops / rate, nbytes / bw) + dev.op_overhead_s
            b = (max(op.bwd_flops / rate, 2 * nbytes / bw) + dev.op_overhead_s) if op.bwd_flops else 0.0
        else:
            f = nbytes / bw + dev.op_overhead_s
            b = 2 * nbytes / bw + dev.op_overhead_s
        fwd.append(f * slow)
        bwd.append(b * slow)
    return fwd, bwd


# -- communication ---------------------------------------------------------------------------------------

class _Placement:
    """Where each rank of the real grid sits: ranks are replica-major and nodes hold consecutive ranks."""

    def __init__(self, grid: tuple[int, ...], replicas: int, cluster: Cluster) -> None:
        self.grid, self.replicas, self.cluster = grid, replicas, cluster
        self.shards = math.prod(grid)
        self.per_node = cluster.per_node

    def node(self, rank: int) -> int:
        return rank // self.per_node

    def link_classes(self, proxy_grid: tuple[int, ...], proxy_coord: tuple[int, ...], offsets: list[tuple]
                     ) -> list[tuple[set, int]]:
        """For the real shards a proxy shard stands for: which ``offsets`` (grid coordinate differences)
        cross a node boundary, and how many ranks of that node send across at once; distinct cases only."""
        ranges = []
        for c, g_proxy, g in zip(proxy_coord, proxy_grid, self.grid):
            if g_proxy == g:
                ranges.append([c])
            else:  # proxy axis of 3: first, interior, last
                ranges.append([0] if c == 0 else [g - 1] if c == 2 else list(range(1, g - 1)))
        if self.cluster.nodes == 1:
            return [(set(), 0)]
        crossing_by_node: dict[int, int] = {}
        cases: dict[frozenset, int] = {}
        coords = list(_product(ranges))
        if len(coords) > 4096:  # the interior of a huge grid: every position along it, sampled evenly
            coords = coords[:: len(coords) // 4096 + 1]
        for r in range(self.replicas):
            for coord in coords:
                rank = r * self.shards + index_of(coord, self.grid)
                inter = frozenset(o for o in offsets if self._peer_node(coord, o, r) not in (None, self.node(rank)))
                if inter:
                    crossing_by_node[self.node(rank)] = crossing_by_node.get(self.node(rank), 0) + 1
                cases.setdefault(inter, 0)
        senders = self._senders_per_node()
        return [(set(k), senders) for k in cases]

    def _peer_node(self, coord, offset, replica):
        peer = tuple(c + o for c, o in zip(coord, offset))
        if any(not 0 <= c < g for c, g in zip(peer, self.grid)):
            return None
        return self.node(replica * self.shards + index_of(peer, self.grid))

    def _senders_per_node(self) -> int:
        """Ranks of one node with a neighbour on another node (at most), over the whole grid."""
        neighbours = [tuple(1 if i == a else 0 for i in range(len(self.grid))) for a in range(len(self.grid))]
        counts: dict[int, int] = {}
        for r in range(self.replicas):
            for index, coord in enumerate(all_coords(self.grid)):
                rank = r * self.shards + index
                for o in neighbours + [tuple(-v for v in n) for n in neighbours]:
                    node = self._peer_node(coord, o, r)
                    if node is not None and node != self.node(rank):
                        counts[self.node(rank)] = counts.get(self.node(rank), 0) + 1
                        break
        return max(counts.values(), default=1)

    def inter_bytes_s(self, senders: int, efficiency: str) -> float:
        c = self.cluster
        ports = c.device.nics_per_node
        share = c.inter.bytes_s * ports / max(1, senders)
        return min(c.inter.bytes_s, share) * getattr(c.inter, efficiency)


def _product(ranges):
    if not ranges:
        yield ()
        return
    for head in ranges[0]:
        for tail in _product(ranges[1:]):
            yield (head,) + tail


def _message_time(link: Link, messages: int, nbytes: float, bytes_s: float) -> float:
    if messages == 0:
        return 0.0
    return link.latency_s + (messages - 1) * link.message_overhead_s + nbytes / bytes_s


def _exchange_times(p_: ShardProfile, place: _Placement, fwd: list[float], bwd: list[float]) -> list[tuple]:
    """Per exchange of the shard: (time of one direction, hidden in the forward, hidden in the backward)."""
    c = place.cluster
    proxy_grid = p_.grid
    me = p_.coord
    offsets = sorted({tuple(a - b for a, b in zip(coord_of(peer, proxy_grid), me))
                      for e in p_.exchanges if e.kind == "halo" for peer, _ in e.sent + e.recv})
    cases = place.link_classes(proxy_grid, me, offsets)
    scale = c.act_scale
    real_others = place.shards - 1
    out = []
    for e in p_.exchanges:
        compute_f = sum(fwd[i] for i in range(e.start, e.finish) if not p_.ops[i].halo_copy)
        compute_b = sum(bwd[i] for i in range(e.start, e.finish) if not p_.ops[i].halo_copy)
        worst = 0.0
        if e.kind == "gather":
            # every other shard of the real grid sends its part (statistics, a whole small map)
            each = max([b for _, b in e.recv] + [b for _, b in e.sent] + [0]) * scale
            same_node = min(real_others, c.per_node - 1) if c.nodes > 1 else real_others
            across = real_others - same_node
            t_in = _message_time(c.intra, same_node, same_node * each, c.intra.bytes_s * c.intra.p2p_efficiency)
            t_out = _message_time(c.inter, across, across * each, place.inter_bytes_s(c.per_node, "p2p_efficiency")) \
                if across else 0.0
            worst = max(t_in, t_out)
        else:
            for inter, senders in cases:
                parts = {"intra": [0, 0.0, 0.0], "inter": [0, 0.0, 0.0]}  # messages, sent, received bytes
                for peer, b in e.sent:
                    o = tuple(x - y for x, y in zip(coord_of(peer, proxy_grid), me))
                    k = parts["inter" if o in inter else "intra"]
                    k[0] += 1
                    k[1] += b * scale
                for peer, b in e.recv:
                    o = tuple(x - y for x, y in zip(coord_of(peer, proxy_grid), me))
                    parts["inter" if o in inter else "intra"][2] += b * scale
                t_in = _message_time(c.intra, parts["intra"][0], max(parts["intra"][1:]),
                                     c.intra.bytes_s * c.intra.p2p_efficiency)
                t_out = _message_time(c.inter, parts["inter"][0], max(parts["inter"][1:]),
                                      place.inter_bytes_s(senders, "p2p_efficiency")) if parts["inter"][0] else 0.0
                worst = max(worst, t_in, t_out)
        worst += c.intra.sync_s
        out.append((worst, min(worst - c.intra.sync_s, compute_f), min(worst - c.intra.sync_s, compute_b)))
    return out


def _buckets(profiler: Profiler, cluster: Cluster) -> tuple[list[int], dict[int, int]]:
    """The engine's own buckets (``GradBuckets`` on meta stand-ins, hooks removed at once): each one's bytes
    in ``cluster.dtype``, and the bucket of each parameter (by ``id``)."""
    with torch.device("meta"):
        metas = [nn.Parameter(torch.empty(p.shape, dtype=getattr(torch, cluster.dtype))) for p in profiler.params]
    buckets = GradBuckets(metas, None, 1.0)
    buckets.remove()
    sizes = [sum(m.numel() * m.element_size() for m in b) for b in buckets.buckets]
    return sizes, {id(p): buckets.bucket_of[m] for p, m in zip(profiler.params, metas)}


def _ring(cluster: Cluster, ranks: int, nbytes: float) -> float:
    if ranks == 1:
        return 0.0
    intra, inter = cluster.intra, cluster.inter
    bus = intra.bytes_s * intra.collective_efficiency
    latency = intra.latency_s
    if cluster.nodes > 1:
        bus = min(bus, inter.bytes_s * cluster.device.nics_per_node * inter.collective_efficiency)
        latency = inter.latency_s
    return 2 * (ranks - 1) * latency + 2 * (ranks - 1) / ranks * nbytes / bus


def _allreduce(buckets: list[int], bucket_of: dict, profiler: Profiler, p_: ShardProfile, bwd: list[float],
               cluster: Cluster) -> tuple[float, float]:
    """Total allreduce time and what of it outlasts the backward: buckets start in order, each once the
    backward has passed the first op that read every parameter in it."""
    ranks = cluster.gpus
    total_bwd = sum(bwd)
    after = [0.0] * (len(bwd) + 1)  # backward time elapsed once op i's backward is done
    for i in range(len(bwd) - 1, -1, -1):
        after[i] = after[i + 1] + bwd[i]
    ready = [0.0] * len(buckets)
    for p in profiler.params:
        i = p_.param_first_use.get(profiler.names[id(p)])
        when = after[i] if i is not None else total_bwd
        ready[bucket_of[id(p)]] = max(ready[bucket_of[id(p)]], when)
    clock, total = 0.0, 0.0
    for size, r in zip(buckets, ready):
        t = _ring(cluster, ranks, size)
        clock = max(clock, r) + t
        total += t
    return total, max(0.0, clock - total_bwd)


def _layers(p_: ShardProfile, fwd, bwd, comm, place: _Placement) -> list[LayerRow]:
    rows: dict[str, LayerRow] = {}
    for op, f, b in zip(p_.ops, fwd, bwd):
        row = rows.setdefault(op.module, LayerRow(op.module, 0.0, 0.0, 0.0, 0.0, 0, 0, 0.0, 0.0))
        row.flops += op.flops
        row.bwd_flops += op.bwd_flops
        row.forward_s += f
        row.backward_s += b
    for e, (t, hf, hb) in zip(p_.exchanges, comm):
        row = rows.setdefault(e.module, LayerRow(e.module, 0.0, 0.0, 0.0, 0.0, 0, 0, 0.0, 0.0))
        n = len(e.sent) if e.kind == "halo" else place.shards - 1
        row.messages += n
        row.sent_bytes += sum(b for _, b in e.sent) if e.kind == "halo" else n * max([b for _, b in e.sent] + [0])
        row.comm_s += 2 * t
        row.hidden_s += hf + hb
    return list(rows.values())
