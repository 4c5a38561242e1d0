"""Per-op rates measured on the device at hand: what the planner uses instead of a datasheet where one exists.

``calibrate(model, shape)`` trains ``model`` plainly, in this process, on ``shape`` and on an input 1.5 times
its edge (small: a few hundred pixels a side is enough), on this machine's GPU (or its CPU), and times every
aten op of a step under a ``TorchDispatchMode`` (synchronizing the GPU around each). Ops are grouped as the planner's shard profiles
group them (``shard_profile.op_key``): each convolution by its channels, kernel, stride, dilation, groups and
direction, every other op by name; a group's rate is its work over its time, where work is FLOPs for
convolutions and matmuls and bytes read and written for everything else. Backward ops are grouped by the
forward op they differentiate where that is unambiguous (``convolution_backward`` by its convolution, the
matmuls of a linear layer); every other backward op joins one group, priced against twice its forward
ops' bytes (as the roofline prices it). Each group's time at the two sizes gives a line, a fixed time per
call plus work over a rate (a convolution of 16 channels on this 2-core host cost 40% more per pixel at 256²
than at 1024²: setup that does not grow with the map); the step's time outside any op (allocation,
autograd's engine) stretches every group alike.

The table travels as JSON (``save``/``load``), so a calibration on one rented GPU plans a cluster of them.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.utils import flop_counter
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
    """``repr(key)`` -> {"forward": work/s, "forward_call_s": seconds per call, "backward": ...,
    "backward_call_s": ...} (either direction may be missing)."""
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

        def t(e: dict, phase: str, work: float) -> float:
            return e.get(f"{phase}_call_s", 0.0) + work / e[phase] + self.overhead_s

        if op.matmul:
            if entry is None or "forward" not in entry:
                return None
            bwd_entry = entry if "backward" in entry else self.rates.get(repr(("mm", op.key[1])), {})
            if op.bwd_flops and "backward" not in bwd_entry:
                return None
            return t(entry, "forward", op.flops), t(bwd_entry, "backward", op.bwd_flops) if op.bwd_flops else 0.0
        if entry is None:
            entry = self.rates.get(repr(("other", dtype)))
        other_bwd = self.rates.get(repr((OTHER_BWD, dtype)), {})
        if entry is None or "forward" not in entry or "backward" not in other_bwd:
            return None
        return t(entry, "forward", nbytes), t(other_bwd, "backward", 2 * nbytes)

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
              steps: int = 3, threads: int | None = None, scale: float = 1.5) -> OpTable:
    """Time ``steps`` plain training steps (SGD with momentum, a mean-square loss) of ``model`` on random inputs
    of ``shape`` and of ``scale`` times its edge; each group's fastest time at each size makes the table."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if threads:
        torch.set_num_threads(threads)
    model = model.to(dev, getattr(torch, dtype)).train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    overhead = dispatch_overhead(dev)
    bigger = (*shape[:2], *(round(n * scale) for n in shape[2:]))
    measured = [_measure(model, opt, s, dev, dtype, steps, overhead) for s in (shape, bigger)]
    (small, plain_small), (large, plain_large) = measured
    probe = _Transients(dev)
    with probe:
        _step(model, torch.randn(bigger, device=dev, dtype=getattr(torch, dtype)), opt, probe)
    rates = _fit(small, large)
    return OpTable(device=str(dev.type), dtype=dtype, rates=rates, overhead_s=overhead, workspace=probe.found,
                   calibration={"input": list(shape), "second_input": list(bigger), "steps": steps,
                                "threads": torch.get_num_threads(), "plain_step_s": [plain_small, plain_large],
                                "torch": torch.__version__,
                                "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"})


def _measure(model, opt, shape, dev, dtype: str, steps: int, overhead: float) -> tuple[dict, float]:
    x = torch.randn(shape, device=dev, dtype=getattr(torch, dtype))
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
    return groups(fastest(timers), dtype, min(plain), overhead), min(plain)


def _fit(small: dict, large: dict) -> dict:
    """Per group, the line through its (work, time) at the two sizes: a rate and a time per call; where the
    two do not make such a line (noise: the larger size ran slower per unit of work; a group of one size), the
    faster of the two sizes' plain rates."""
    rates: dict = {}
    for (key, phase), (w1, t1, calls) in large.items():
        entry = rates.setdefault(key, {})
        w0, t0, _ = small.get((key, phase), (0.0, 0.0, calls))
        if w1 > w0 > 0 and t1 > t0 > 0 and (w1 - w0) / (t1 - t0) > 0:
            rate = (w1 - w0) / (t1 - t0)
            fixed = (t0 - w0 / rate) / calls
            if fixed >= 0:
                entry[phase], entry[f"{phase}_call_s"] = rate, fixed
                continue
        if w1 == w0:
            # The same work at both sizes (the loss on a fixed-size head, a classifier's matmul): nothing says
            # how its time grows, and its rate on a few bytes would price a large map of the same op (a
            # decomposed BatchNorm's pow) hundreds of times too slow. Such a group gets no rate: ops of its key
            # are priced as the table's other ops (or by the roofline, for matmuls).
            continue
        plain = [w / t for w, t in ((w0, t0), (w1, t1)) if w > 0 and t > 0]
        if plain:
            entry[phase] = max(plain)
    return {k: v for k, v in rates.items() if v}


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


def groups(rows: list[tuple], dtype: str, plain_step_s: float, overhead_s: float) -> dict:
    """(repr(key), phase) -> [work, seconds, calls] of timed ``rows``; the time the plain step spent outside
    them beyond ``overhead_s`` per op stretches every group's time alike (allocation, autograd's engine)."""
    found: dict[tuple, list[float]] = {}

    def add(key, phase, w, dt):
        slot = found.setdefault((key, phase), [0.0, 0.0, 0])
        slot[0] += w
        slot[1] += dt
        slot[2] += 1

    timed = 0.0
    n_forward = 0
    for phase, key, matmul, w, dt, nbytes in rows:
        if phase == "optimizer":
            continue
        timed += dt
        if phase == "forward":
            n_forward += 1
            add(repr(key), "forward", w, dt)
            if not matmul:  # the planner prices each such op's backward as twice its bytes: one call each
                add(repr(("other", dtype)), "forward", w, dt)
                slot = found.setdefault((repr((OTHER_BWD, dtype)), "backward"), [0.0, 0.0, 0])
                slot[0] += 2 * nbytes
                slot[2] += 1
        elif matmul:
            add(repr(key), "backward", w, dt)
        else:
            found.setdefault((repr((OTHER_BWD, dtype)), "backward"), [0.0, 0.0, 0])[1] += dt
    optimizer_s = sum(row[4] for row in rows if row[0] == "optimizer")
    stretch = max(1.0, (plain_step_s - optimizer_s - 2 * n_forward * overhead_s) / max(timed, 1e-12))
    return {k: [w, dt * stretch, max(1, n)] for k, (w, dt, n) in found.items()}
