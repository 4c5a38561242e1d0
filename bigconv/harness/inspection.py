"""What ``python -m bigconv.check`` reports about a model on an input and a grid, without training it.

``layer_report``: per windowed layer, from the dry run (meta tensors, no memory): its global input and
output, the output shard of worker 0, the halo width it needs, whether its map is split or replicated,
and the receptive field so far against the shard's size.

``estimate_memory``: per-process peak from two measured small plain runs, scaled. Each run is a fresh
process (the workers' allocator settings, a warm-up step first, as ``bigconv.harness.workload``
measures): peak RSS above the resident set before the model existed, through two SGD-momentum steps.
A line through the two (peak = fixed + per_pixel * pixels) gives one process's peak at the full
input, and ``fixed + per_pixel * pixels / N`` a worker's (halos and the small maps replicated on every
worker are left out). How far this is off is measured in ``docs/check.md``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn

from ..geometry.boxes import TransposedWindow, Window, balanced_bounds
from ..ops.shards import global_shape, is_replicated
from ..planning import Planner
from ..runtime.world import WORKER_ENV

ROOT = Path(__file__).resolve().parents[2]
WINDOWED = (nn.modules.conv._ConvNd, nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd)


@dataclass
class LayerRow:
    module: str
    kind: str
    input: list
    """Global spatial shape of the layer's input."""
    output: list
    """Global spatial shape of its output."""
    shard: list
    """Worker 0's part of the output (the whole output when replicated)."""
    halo: list
    """Per spatial dim, the widest halo any shard receives from its neighbours (input positions)."""
    split: bool
    """False when the map is whole on every worker (smaller than the grid, or a head)."""
    receptive_field: int
    """Input pixels one output position sees (an upper bound: the sum over the windowed layers run so far)."""
    shard_input: list
    """Worker 0's part of the image, to hold the receptive field against."""


def _ntuple(value, n: int) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * n


def windows(module: nn.Module, n: int) -> list | None:
    """The per-dim receptive-field arithmetic of a windowed layer; None for any other."""
    if not isinstance(module, WINDOWED):
        return None
    k, s = _ntuple(module.kernel_size, n), _ntuple(module.stride or module.kernel_size, n)
    d = _ntuple(getattr(module, "dilation", 1), n)
    if isinstance(module, nn.modules.conv._ConvTransposeNd):
        p, op = _ntuple(module.padding, n), _ntuple(module.output_padding, n)
        return [TransposedWindow(k[i], s[i], d[i], p[i], op[i]) for i in range(n)]
    pad = getattr(module, "padding", 0)
    if isinstance(module, nn.modules.conv._ConvNd) and isinstance(pad, str):
        total = [0 if pad == "valid" else d[i] * (k[i] - 1) for i in range(n)]
        lo_hi = [(t // 2, t - t // 2) for t in total]
    else:
        lo_hi = [(p, p) for p in _ntuple(pad, n)]
    ceil = bool(getattr(module, "ceil_mode", False))
    return [Window(k[i], s[i], d[i], lo_hi[i][0], lo_hi[i][1], ceil) for i in range(n)]


def halo_width(window, n_in: int, n_out: int, parts: int) -> int:
    """The widest halo any of ``parts`` shards of one dim needs from its neighbours."""
    if parts == 1:
        return 0
    widest = 0
    for (o0, o1), (i0, i1) in zip(balanced_bounds(n_out, parts), balanced_bounds(n_in, parts)):
        if o1 <= o0:
            continue
        lo, hi = window.input_interval((o0, o1))
        widest = max(widest, i0 - max(lo, 0), min(hi, n_in) - i1)
    return max(widest, 0)


def layer_report(model: nn.Module, shape: tuple[int, ...], grid: tuple[int, ...], dtype=torch.float32
                 ) -> tuple[list[LayerRow], BaseException | None]:
    """Dry-run ``model`` on ``shape`` over ``grid``; the windowed layers it ran, and the error it raised."""
    planner = Planner(model, grid, math.prod(grid), check_finite=False)
    n = len(grid)
    seen: list[tuple[str, nn.Module, tuple, tuple, bool]] = []
    handles = []
    for name, module in planner.meta.named_modules():
        if windows(module, n) is not None or isinstance(module, nn.Linear):
            def hook(mod, args, out, name=name):
                if threading.current_thread().name != "bigconv-dry-run-0" or not args:
                    return
                split = not is_replicated(out) and global_shape(out) is not None
                seen.append((name, mod, _spatial(args[0]), _spatial(out), split))
            handles.append(module.register_forward_hook(hook))
    error = None
    try:
        planner.plan(torch.empty(shape, dtype=dtype, device="meta"), training=True)
    except ValueError as exc:
        error = exc
    finally:
        for h in handles:
            h.remove()
    return _rows(seen, shape, grid), error


def _spatial(t) -> tuple[int, ...] | None:
    """A map's global spatial shape: marked on a split map, its own on a whole one; None for a vector."""
    if global_shape(t) is not None:
        return global_shape(t)
    with torch._C.DisableTorchFunction():  # the tensor's own shape, not the one the mode answers
        return tuple(t.shape[2:]) if isinstance(t, torch.Tensor) and t.dim() > 2 else None


def _rows(seen, shape, grid) -> list[LayerRow]:
    n, image = len(grid), tuple(shape[2:])
    shard_input = [hi - lo for lo, hi in (balanced_bounds(s, g)[0] for s, g in zip(image, grid))]
    rows, field = [], 1
    for name, module, x_shape, out_shape, split in seen:
        if x_shape is None:  # a head on a pooled vector
            rows.append(LayerRow(name, type(module).__name__, [], [], [], [0] * n, False, field, shard_input))
            continue
        ws = windows(module, n)
        if ws is not None:
            jump = max(i / s for i, s in zip(image, x_shape))  # image pixels per input position
            field += round(max(w.span - 1 for w in ws) * jump)
        halo = [halo_width(w, i, o, g) if split else 0 for w, i, o, g in zip(ws, x_shape, out_shape, grid)] \
            if ws else [0] * n
        shard = [hi - lo for lo, hi in (balanced_bounds(o, g)[0] for o, g in zip(out_shape, grid))] \
            if split else list(out_shape)
        rows.append(LayerRow(name, type(module).__name__, list(x_shape), list(out_shape), shard, halo, split,
                             field, shard_input))
    return rows


def measure_plain(spec: str, shapes: list[tuple[int, ...]], steps: int = 2, timeout_s: float = 600) -> list[int]:
    """Peak bytes of a plain training run of ``spec`` on each of ``shapes``, each in a fresh process. The
    processes run at once: each peak is its own process's, so they do not disturb one another's figure,
    and the wait is one run's rather than their sum."""
    env = {**WORKER_ENV, **os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    code = ("import json, sys; from bigconv.harness.inspection import _plain_peak; "
            "print(json.dumps(_plain_peak(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]))))")
    procs = [subprocess.Popen([sys.executable, "-c", code, spec, json.dumps(list(shape)), str(steps)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for shape in shapes]
    peaks = []
    try:
        for shape, proc in zip(shapes, procs):
            out, err = proc.communicate(timeout=timeout_s)
            if proc.returncode != 0:
                raise RuntimeError(f"the plain run of {spec} on {shape} failed: {err.strip()[-1500:]}")
            peaks.append(int(json.loads(out.strip().splitlines()[-1])))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return peaks


def _plain_peak(spec: str, shape: list, steps: int) -> int:
    from ..memory import PeakMeter
    from .model_spec import build_model

    torch.manual_seed(0)
    _plain_steps(build_model(spec), shape, 1)  # warm-up: kernels and thread pools paged in before the meter
    meter = PeakMeter("cpu")
    _plain_steps(build_model(spec), shape, steps)
    return int(meter.read()["peak_bytes"])


def _plain_steps(model: nn.Module, shape, steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(*shape)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()


@dataclass
class MemoryEstimate:
    method: str
    single_bytes: int
    per_process_bytes: int
    ideal_per_process_bytes: int
    """single / N: what a perfect split would give."""
    fixed_bytes: int
    per_pixel_bytes: float
    measured: dict
    """The small runs: edge -> peak bytes."""


def estimate_memory(spec: str, shape: tuple[int, ...], workers: int, edges: tuple[int, int] = (128, 256)
                    ) -> MemoryEstimate:
    pixels = [e ** (len(shape) - 2) for e in edges]
    peaks = measure_plain(spec, [(*shape[:2], *[e] * (len(shape) - 2)) for e in edges])
    per_pixel = max(0.0, (peaks[1] - peaks[0]) / (pixels[1] - pixels[0]))
    fixed = max(0.0, peaks[0] - per_pixel * pixels[0])
    total = math.prod(shape[2:])
    single = fixed + per_pixel * total
    return MemoryEstimate(
        method=f"two plain runs at {edges[0]} and {edges[1]} px per side (fresh processes, batch {shape[0]}), "
               "a line through their peaks scaled to the input; per process: the fixed part plus 1/N of the rest",
        single_bytes=int(single), per_process_bytes=int(fixed + per_pixel * total / workers),
        ideal_per_process_bytes=int(single / workers), fixed_bytes=int(fixed), per_pixel_bytes=per_pixel,
        measured={str(e): p for e, p in zip(edges, peaks)})


def as_dict(obj) -> dict:
    return asdict(obj)
