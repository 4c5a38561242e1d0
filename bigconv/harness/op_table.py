"""Per-op rates measured on the device at hand: what the planner uses instead of a datasheet where one exists.

``calibrate(model, shape)`` trains ``model`` plainly, in this process, on ``shape`` (small: a few hundred
pixels a side is enough), on this machine's GPU (or its CPU), and times every aten op of a step under a
``TorchDispatchMode`` (synchronizing the GPU around each). Ops are grouped as the planner's shard profiles
group them (``shard_profile.op_key``): each convolution by its channels, kernel, stride, dilation, groups and
direction, every other op by name; a group's rate is its work over its time, where work is FLOPs for
convolutions and matmuls and bytes read and written for everything else. Backward ops are grouped by the
forward op they differentiate where that is unambiguous (``convolution_backward`` by its convolution, the
matmuls of a linear layer); every other backward op joins one group, priced against twice its forward
ops' bytes (as the roofline prices it). The step's time outside any op (Python, autograd's engine, the
dispatcher) is spread over the ops as a per-op overhead.

The table travels as JSON (``save``/``load``), so a calibration on one rented GPU plans a cluster of them.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.utils.flop_counter as flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..memory import peak_rss_bytes, reset_rss_peak, rss_bytes
from .shard_profile import FREE, MATMUL, OpRecord, op_key

OTHER_BWD = "backward of other ops"
MIN_TRANSIENT = 256 * 1024
"""Transients below this are page-level noise of the resident-set reading, not an op's workspace."""


@dataclass
class OpTable:
    device: str
    dtype: str
    rates: dict = field(default_factory=dict)
    """``repr(key)`` -> {"forward": work/s, "backward": work/s} (either may be missing)."""
    overhead_s: float = 0.0
    """Per op, forward and backward each: the step's time outside the ops, spread over them."""
    workspace: dict = field(default_factory=dict)
    """``repr(key)`` -> {"forward": transient memory over the op's result bytes, "backward": over its input's}:
    what an op held beyond its operands and results while it ran (oneDNN's reorders and im2col buffers on a
    CPU, cuDNN's workspace on a GPU), its largest over the calibration step."""
    calibration: dict = field(default_factory=dict)
    """How it was measured: model, input, threads, the step time, the torch version."""

    def times(self, op: OpRecord, nbytes: float, dtype: str) -> tuple[float, float] | None:
        """Forward and backward seconds of ``op`` (``nbytes`` its bytes in the compute dtype), or None
        where this table has no rate for its forward."""
        entry = self.rates.get(repr(op.key))
        if op.matmul:
            if entry is None or "forward" not in entry:
                return None
            bwd_entry = entry if "backward" in entry else self.rates.get(repr(("mm", op.key[1])), {})
            if op.bwd_flops and "backward" not in bwd_entry:
                return None
            b = op.bwd_flops / bwd_entry["backward"] + self.overhead_s if op.bwd_flops else 0.0
            return op.flops / entry["forward"] + self.overhead_s, b
        if entry is None:
            entry = self.rates.get(repr(("other", dtype)))
        other_bwd = self.rates.get(repr((OTHER_BWD, dtype)), {})
        if entry is None or "forward" not in entry or "backward" not in other_bwd:
            return None
        return nbytes / entry["forward"] + self.overhead_s, 2 * nbytes / other_bwd["backward"] + self.overhead_s

    def workspace_of(self, op: OpRecord) -> tuple[float, float] | None:
        """Transient bytes of ``op``'s forward and backward (dry-run dtype), or None where not measured."""
        entry = self.workspace.get(repr(op.key))
        if entry is None:
            return None
        return entry.get("forward", 0.0) * op.out_bytes, entry.get("backward", 0.0) * op.in_bytes

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> OpTable:
        data = json.loads(Path(path).read_text())
        return cls(**data)


class _Timer(TorchDispatchMode):
    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.phase = "forward"
        self.rows: list[tuple] = []  # (phase, key, matmul, work, seconds, bytes)
        self.seconds = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        self.seconds += dt
        name = func.overloadpacket.__name__
        if func.is_view or name in FREE:
            return out
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        nbytes = sum(t.numel() * t.element_size() for t in ins + outs)
        matmul = func.overloadpacket in MATMUL
        work = float(flop_counter.flop_registry[func.overloadpacket](*args, **kwargs, out_val=out)) if matmul \
            else float(nbytes)
        self.rows.append((self.phase, _key(func, args, ins), matmul, work, dt, nbytes))
        return out


class _Transients(TorchDispatchMode):
    """Each op's memory beyond what was live before and after it, from the process's resident-set
    high-water mark (reset before every op; Linux) or the CUDA allocator's peak."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.phase = "forward"
        self.found: dict[str, dict[str, float]] = {}

    def _now(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return rss_bytes() or 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        before = self._now()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            reset_rss_peak()
        out = func(*args, **kwargs)
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else peak_rss_bytes()
        transient = peak - max(before, self._now())
        name = func.overloadpacket.__name__
        if self.phase == "optimizer" or func.is_view or name in FREE or transient < MIN_TRANSIENT:
            return out
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if self.phase == "backward" and name != "convolution_backward":
            return out  # other backward ops cannot be told apart from their forward op's name
        base = (ins[1] if name == "convolution_backward" else outs[0] if outs else None)
        if base is None or base.numel() == 0:
            return out
        key = repr(_key(func, args, ins))
        slot = self.found.setdefault(key, {})
        slot[self.phase] = max(slot.get(self.phase, 0.0), transient / (base.numel() * base.element_size()))
        return out


def _key(func, args, ins) -> tuple:
    """The forward op's key for a backward op where it is known (convolution_backward: its convolution)."""
    name = func.overloadpacket.__name__
    if name == "convolution_backward":
        x, w = args[1], args[2]
        stride, _, dilation, transposed, _, groups = args[4:10]
        dtype = str(x.dtype).replace("torch.", "")
        return ("conv", dtype, int(x.shape[1]), int(w.shape[0]), tuple(w.shape[2:]), tuple(stride),
                tuple(dilation), int(groups), bool(transposed))
    if name in ("mm", "addmm", "bmm", "baddbmm"):
        return ("mm", str(ins[0].dtype).replace("torch.", ""))
    return op_key(func, args, ins)


def _step(model: nn.Module, x: torch.Tensor, opt, timer: _Timer | None) -> None:
    opt.zero_grad(set_to_none=True)
    if timer is not None:
        timer.phase = "forward"
    out = model(x)
    loss = out.float().square().mean()
    if timer is not None:
        timer.phase = "backward"
    loss.backward()
    if timer is not None:
        timer.phase = "optimizer"
    opt.step()


def calibrate(model: nn.Module, shape: tuple[int, ...], device: str | None = None, dtype: str = "float32",
              steps: int = 3, threads: int | None = None) -> OpTable:
    """Time ``steps`` plain training steps (SGD with momentum, a mean-square loss) of ``model`` on a random
    input of ``shape``; the fastest step's ops make the table."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if threads:
        torch.set_num_threads(threads)
    model = model.to(dev, getattr(torch, dtype)).train()
    x = torch.randn(shape, device=dev, dtype=getattr(torch, dtype))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    _step(model, x, opt, None)  # warm-up: kernels chosen, memory grown
    plain = []
    for _ in range(steps):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        _step(model, x, opt, None)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        plain.append(time.perf_counter() - t0)
    timers = []
    for _ in range(steps):
        timer = _Timer(dev)
        with timer:
            _step(model, x, opt, timer)
        timers.append(timer)
    probe = _Transients(dev)
    with probe:
        _step(model, x, opt, probe)
    table = table_from(fastest(timers), dev, dtype, min(plain), dispatch_overhead(dev), {
        "input": list(shape), "steps": steps, "threads": torch.get_num_threads(), "plain_step_s": min(plain),
        "timed_ops_s": min(t.seconds for t in timers), "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"})
    table.workspace = probe.found
    return table


def fastest(timers: list[_Timer]) -> list[tuple]:
    """The rows of the first step with each group's time the least any step took (a shared host's
    neighbours slow some ops of some steps; each group's best is the machine's own speed)."""
    best: dict[tuple, float] = {}
    for timer in timers:
        sums: dict[tuple, float] = {}
        for phase, key, *_, dt, _ in timer.rows:
            sums[(phase, key)] = sums.get((phase, key), 0.0) + dt
        for k, v in sums.items():
            best[k] = min(best.get(k, v), v)
    first = timers[0].rows
    totals: dict[tuple, float] = {}
    for phase, key, *_, dt, _ in first:
        totals[(phase, key)] = totals.get((phase, key), 0.0) + dt
    return [(phase, key, matmul, work, dt * best[(phase, key)] / totals[(phase, key)] if totals[(phase, key)] else dt,
             nbytes) for phase, key, matmul, work, dt, nbytes in first]


def dispatch_overhead(dev: torch.device, ops: int = 400) -> float:
    """Seconds per op of launching tiny ops from Python (framework dispatch, a kernel launch on a GPU)."""
    x = torch.zeros(8, device=dev)
    best = float("inf")
    for _ in range(3):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(ops):
            torch.add(x, x)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        best = min(best, (time.perf_counter() - t0) / ops)
    return best


def table_from(rows: list[tuple], dev: torch.device, dtype: str, plain_step_s: float, overhead_s: float,
               calibration: dict) -> OpTable:
    """Rates from timed ``rows``; the time the plain step spent outside them beyond ``overhead_s`` per op
    stretches every rate alike (allocation, autograd's engine: work that grows with the ops' size)."""
    work: dict[tuple, list[float]] = {}
    fwd_other_bytes = bwd_other_s = 0.0
    timed = 0.0
    n_forward = 0
    for phase, key, matmul, w, dt, nbytes in rows:
        if phase == "optimizer":
            continue
        timed += dt
        if phase == "forward":
            n_forward += 1
            slot = work.setdefault((repr(key), "forward"), [0.0, 0.0])
            slot[0] += w
            slot[1] += dt
            if not matmul:
                other = work.setdefault((repr(("other", dtype)), "forward"), [0.0, 0.0])
                other[0] += w
                other[1] += dt
                fwd_other_bytes += nbytes
        elif matmul:
            slot = work.setdefault((repr(key), "backward"), [0.0, 0.0])
            slot[0] += w
            slot[1] += dt
        else:
            bwd_other_s += dt
    optimizer_s = sum(row[4] for row in rows if row[0] == "optimizer")
    # The planner adds the overhead to each forward op's forward and backward time.
    stretch = max(1.0, (plain_step_s - optimizer_s - 2 * n_forward * overhead_s) / max(timed, 1e-12))
    rates: dict = {}
    for (key, phase), (w, dt) in work.items():
        if dt > 0 and w > 0:
            rates.setdefault(key, {})[phase] = w / (dt * stretch)
    if bwd_other_s > 0 and fwd_other_bytes > 0:
        rates[repr((OTHER_BWD, dtype))] = {"backward": 2 * fwd_other_bytes / (bwd_other_s * stretch)}
    return OpTable(device=str(dev.type), dtype=dtype, rates=rates, overhead_s=overhead_s,
                   calibration={**calibration, "optimizer_s": optimizer_s, "stretch": stretch})
