"""``python -m bigconv.check MODEL --input 1x3x4096x4096 --workers 4``: will my model work, and what will it cost?

Before booking a cluster, on any laptop: whether the model decomposes (the dry run the front ends run
before any remote work, on meta tensors: no memory), and if not, the module, the op and the fix; per
windowed layer, the shard size, halo width, whether the map is split or replicated and the receptive
field against the shard; an estimated per-process peak memory on N processes against one process
(two measured small plain runs, scaled: see ``estimate_memory``); and an exactness check
on a small input (forward, input and parameter gradients, weights after a step, against one process
in float64). ``--json`` prints one JSON object for scripts. Exit status: 0 when the model decomposes
(and, where checked, trains exactly), 1 otherwise.

``layer_report``: per windowed layer, from the dry run (meta tensors, no memory): its global input and
output, the output shard of worker 0, the halo width it needs, whether its map is split or replicated,
and the receptive field so far against the shard's size.

``estimate_memory``: per-process peak from two measured small plain runs, scaled. Each run is a fresh
process (the workers' allocator settings, a warm-up step first, as ``bigconv.harness.workload``
measures): peak RSS above the resident set before the model existed, through two SGD-momentum steps.
A line through the two (peak = fixed + per_pixel * pixels) gives one process's peak at the full
input, and ``fixed + per_pixel * pixels / N`` a worker's (halos and the small maps replicated on every
worker are left out). How far this is off is measured in ``docs/check.md``.

With ``--gpus N --gpu NAME`` it plans a cluster instead (``bigconv.harness.plan_report``): per process, the
parameters, gradients, optimizer state, the largest shard's peak activations and halo buffers; per step,
each layer's compute, halo messages and bytes, the gradient allreduce and what of it the engine hides; the
grid it would choose, the fewest GPUs that fit and, with ``--max-size``, the largest image for N GPUs. All
from dry runs on meta tensors and a device table (``bigconv.harness.devices``): no GPU needed, no process
started. Exit status 0 when the plan fits, 1 when it does not (or the model does not decompose).
"""

from __future__ import annotations

import argparse
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

from .geometry.boxes import (
    TransposedWindow, Window, balanced_bounds, check_positive_int, choose_grid, shard_box, validate_grid,
)
from .harness import cli, devices
from .harness.model_spec import FORMS, OPTIMIZER_FORMS, OPTIMIZERS, build_model, build_optimizer
from .ops.shards import (
    GATHER_ATTR, WHOLE_WINDOWS_ATTR, WindowGrid, global_shape, is_replicated, lead, positions, prefix, spatial_dims,
    trail, tree_flatten,
)
from .ops import global_attention
from .ops.mode import active_mode
from .ops.window import conv_windows
from .ops.whole import HOLD_ATTR
from .planning import Planner
from .runtime.world import WORKER_ENV

MiB = 2 ** 20
ROOT = Path(__file__).resolve().parents[1]
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
    macs: int = 0
    """Multiply-adds of the layer on the whole image (weights times output positions)."""
    elements: int = 0
    """Elements of its output on the whole image (what it adds to the activations)."""


def _ntuple(value, n: int) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * n


def windows(module: nn.Module, n: int) -> list | None:
    """The per-dim receptive-field arithmetic of a windowed layer over the grid's ``n`` spatial dims; None for
    any other (a Conv1d across the channels of a 2D model: ECA's gate). Convolutions' windows are the run's
    own (``bigconv.ops.window.conv_windows``: 'same' padding computed once)."""
    if not isinstance(module, WINDOWED):
        return None
    rank = len(module.kernel_size) if isinstance(module.kernel_size, (tuple, list)) else n
    if rank != n:
        return None
    k, s = _ntuple(module.kernel_size, n), _ntuple(module.stride or module.kernel_size, n)
    d = _ntuple(getattr(module, "dilation", 1), n)
    if isinstance(module, nn.modules.conv._ConvTransposeNd):
        p, op = _ntuple(module.padding, n), _ntuple(module.output_padding, n)
        return [TransposedWindow(k[i], s[i], d[i], p[i], op[i]) for i in range(n)]
    if isinstance(module, nn.modules.conv._ConvNd):
        return conv_windows(k, s, module.padding, d)
    p = _ntuple(getattr(module, "padding", 0), n)
    ceil = bool(getattr(module, "ceil_mode", False))
    return [Window(k[i], s[i], d[i], p[i], p[i], ceil) for i in range(n)]


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


def _is_attention(module: nn.Module) -> bool:
    kind = type(module).__name__.lower()
    return "attention" in kind or "attn" in kind


def _bytes(n: int) -> str:
    return _mib(n) if n >= MiB else f"{n / 1024:,.0f} KiB"


def attention_strategy(module: nn.Module, args, out, grid: tuple[int, ...] = (), setting=None, notes=()) -> str:
    """How the shards computed an attention module's call (``bigconv.ops.windows``, ``positions``, ``whole``);
    ``setting``: the global attention setting that decides for it (``global_attention.setting_in``); ``notes``:
    what the attention rules did inside the call (``ops.shards.AttentionNote``), which decide where given."""
    if getattr(module, HOLD_ATTR, False):
        return "held whole (bigconv.hold_whole): the whole map on every worker"
    named = _from_notes(module, args, grid, setting, notes)
    if named:
        return named
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    ins = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
    if any(WHOLE_WINDOWS_ATTR in t.__dict__ for t in outs):
        return "windows held whole (fewer windows than workers): the whole map on every worker"
    flat = [positions(t)[0] for t in ins if positions(t) is not None]
    if (flat and not any(isinstance(s, WindowGrid) for s in flat) and any(positions(t) is not None for t in outs)):
        # Tokens flattened from a map stayed split through the module: its SDPA ran by ring passes
        total, whole = math.prod(flat[0]), prefix(flat[0])
        strategy, extra = tokens_attention(module, ins, grid, setting)
        tokens = (f", and {whole} whole token{'s' if whole > 1 else ''} in front (class/register: on every worker, "
                  "their keys seen once)") if whole else ""
        if strategy == "gathered":
            held = f" ({_bytes(extra)} per worker for them and the scores)" if extra else ""
            return f"gathered: keys and values of all {total} positions on every worker{tokens}{held}"
        held = f" (ring buffers and score tiles {_bytes(extra)} per worker)" if extra else ""
        return (f"ring: keys and values of all {total} positions passed round the workers, one block at a time"
                f"{tokens}{held}")
    if (flat and not any(isinstance(s, WindowGrid) for s in flat) and getattr(module, "latent", None) is not None
            and outs and all(positions(t) is None for t in outs)):
        # A pooling head's latent queries, whole on every worker, over split tokens (timm's AttentionPoolLatent)
        total, whole = math.prod(flat[0]), prefix(flat[0])
        tokens = f" and {whole} whole token{'s' if whole > 1 else ''}" if whole else ""
        return (f"ring: whole latent queries over the keys and values of all {total} positions{tokens}, passed "
                "round the workers one block at a time")
    if any(positions(t) is not None and GATHER_ATTR in t.__dict__ for t in ins):
        return "gathered whole (attention between all positions): every token on every worker"
    if global_attention.is_bottleneck(module) and ins and global_shape(ins[0]) is not None:
        return _global_strategy(module, ins[0], grid, setting)
    if any(global_shape(t) is not None or positions(t) is not None for t in outs):
        return "split: each worker its own windows (no keys from other workers)"
    return "replicated: its input was already whole on every worker (tokens gathered before it, or a small map)"


def _from_notes(module: nn.Module, args, grid: tuple[int, ...], setting, notes) -> str | None:
    """The strategy the attention rules recorded for a call (the run's own choice, whatever the module's inputs
    look like: FastViT's attention flattens its map inside; MaxViT's grid attention rings over grid cells)."""
    kinds = {n.kind for n in notes}
    ring = [n for n in notes if n.kind in ("ring", "gathered")]
    if ring:
        note, plural = ring[0], "s" if ring[0].whole > 1 else ""
        if note.whole_queries:  # a pooling head's latent queries (timm's AttentionPoolLatent)
            tokens = f" and {note.whole} whole token{plural}" if note.whole else ""
            how = "passed round the workers one block at a time" if note.kind == "ring" else "gathered on every worker"
            return (f"{note.kind}: whole latent queries over the keys and values of all {note.positions} "
                    f"positions{tokens}, {how}")
        tokens = (f", and {note.whole} whole token{plural} in front (class/register: on every worker, their keys "
                  "seen once)") if note.whole else ""
        ins = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
        extra = tokens_attention(module, ins, grid, setting)[1]
        if note.kind == "gathered":
            held = f" ({_bytes(extra)} per worker for them and the scores)" if extra else ""
            return f"gathered: keys and values of all {note.positions} positions on every worker{tokens}{held}"
        held = f" (ring buffers and score tiles {_bytes(extra)} per worker)" if extra else ""
        return (f"ring: keys and values of all {note.positions} positions passed round the workers, one block at a "
                f"time{tokens}{held}")
    if kinds == {"local"}:
        return "split: each worker its own queries over whole keys and values (no keys from other workers)"
    return None


def _bottleneck_sizes(module: nn.Module, x: torch.Tensor, grid: tuple[int, ...]) -> tuple:
    """``extra_bytes``'s sizes (after its strategy) for a ``BottleneckAttn`` call on worker 0 (the largest)."""
    shape = global_shape(x)
    block = math.prod(b - a for a, b in shard_box(shape, grid, (0,) * len(grid)))
    return (x.shape[0] * module.num_heads, block, math.prod(shape), block, module.dim_head_qk, module.dim_head_v,
            x.element_size())


def global_attention_bytes(module: nn.Module, x: torch.Tensor, grid: tuple[int, ...], setting=None) -> int:
    """What worker 0 holds for a global attention module's call beyond its activations (ring buffers and score
    tiles, or gathered keys and scores: ``bigconv.ops.global_attention.extra_bytes``), under ``setting``
    (``global_attention.use``'s, ``setting_in``)."""
    sizes = _bottleneck_sizes(module, x, grid)
    return global_attention.extra_bytes(global_attention.choose(setting, *sizes), *sizes)


def tokens_attention(module: nn.Module, ins: list, grid: tuple[int, ...], setting=None) -> tuple[str, int]:
    """The strategy (``global_attention.choose`` under ``setting``) and extra bytes on worker 0 for an attention
    module over tokens flattened from a map (timm's ``Attention``: ``num_heads`` and ``head_dim``); the setting's
    strategy and 0 bytes when the module does not say its heads."""
    heads, dim = getattr(module, "num_heads", None), getattr(module, "head_dim", None)
    x = next((t for t in ins if positions(t) is not None), None)
    if not isinstance(heads, int) or not isinstance(dim, int) or x is None:
        return (setting or ("ring",))[0], 0
    shape = positions(x)[0]
    block = math.prod(b - a for a, b in shard_box(shape, grid, (0,) * len(grid)))
    batch = x.size(0) if positions(x)[1] % x.dim() != 0 else 1
    whole = prefix(shape)  # a class token's queries see every block too; its own keys stay put
    sizes = (batch * heads, block + whole, math.prod(shape) + whole, block, dim, dim, x.element_size())
    strategy = global_attention.choose(setting, *sizes)
    return strategy, global_attention.extra_bytes(strategy, *sizes)


def tokens_attention_bytes(module: nn.Module, ins: list, grid: tuple[int, ...], setting=None) -> int:
    """``tokens_attention``'s bytes."""
    return tokens_attention(module, ins, grid, setting)[1]


def _global_strategy(module: nn.Module, x: torch.Tensor, grid: tuple[int, ...], setting=None) -> str:
    """Ring or gathered attention over every position (``bigconv.ops.global_attention``), with what it holds."""
    strategy = global_attention.choose(setting, *_bottleneck_sizes(module, x, grid))
    total, extra = math.prod(global_shape(x)), global_attention_bytes(module, x, grid, setting)
    if strategy == "gathered":
        return (f"gathered: keys and values of all {total} positions on every worker ({_bytes(extra)} per worker for "
                "them and the scores)")
    return (f"ring: keys and values of all {total} positions passed round the workers, one block at a time "
            f"(ring buffers and score tiles {_bytes(extra)} per worker)")


def layer_report(model: nn.Module, shape: tuple[int, ...], grid: tuple[int, ...], dtype=torch.float32,
                 attention: list | None = None, attention_bytes: list | None = None
                 ) -> tuple[list[LayerRow], BaseException | None]:
    """Dry-run ``model`` on ``shape`` over ``grid``; the windowed layers it ran, and the error it raised.
    ``attention``, if given, receives ``(module name, strategy)`` for every attention module called
    (a module whose class name says Attention or Attn)."""
    planner = Planner(model, grid, math.prod(grid), check_finite=False)
    n = len(grid)
    seen: list[tuple[str, nn.Module, tuple, tuple, bool]] = []
    handles = []
    for name, module in planner.meta.named_modules():
        if attention is not None and _is_attention(module) and not any(
                _is_attention(m) for m in list(module.modules())[1:]):  # a block holding one: its attention is named
            def attn_hook(mod, args, out, name=name):
                if threading.current_thread().name == "bigconv-dry-run-0":
                    setting = global_attention.setting_in(planner.meta, name)
                    mode, label = active_mode(), f"'{name or '<root>'}' ({type(mod).__name__})"
                    notes = [n for stack, n in mode.path.notes if label in stack] if mode and mode.path else []
                    attention.append((name, type(mod).__name__, attention_strategy(mod, args, out, grid, setting,
                                                                                   notes)))
                    if attention_bytes is not None and args and global_attention.is_bottleneck(mod):
                        if global_shape(args[0]) is not None:
                            attention_bytes.append(global_attention_bytes(mod, args[0], grid, setting))
                    elif attention_bytes is not None and attention[-1][2].startswith(("ring", "gathered:")):
                        ins = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
                        attention_bytes.append(tokens_attention_bytes(mod, ins, grid, setting))
            handles.append(module.register_forward_hook(attn_hook))
        if windows(module, n) is not None or isinstance(module, nn.Linear):
            def hook(mod, args, out, name=name):
                if threading.current_thread().name != "bigconv-dry-run-0" or not args:
                    return
                # Windows or tokens flattened from a map are split too (bigconv.ops.windows/positions)
                split = not is_replicated(out) and (global_shape(out) is not None or positions(out) is not None)
                seen.append((name, mod, _spatial(args[0]), _spatial(out), split, _work(mod, out, n)))
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


def _work(module: nn.Module, out, n: int) -> tuple[int, int]:
    """(multiply-adds, output elements) of a layer on the whole image; under the mode a split tensor's
    ``numel`` is the whole image's."""
    if not isinstance(out, torch.Tensor):
        return 0, 0
    with torch._C.DisableTorchFunction():  # the local tensor's own sizes
        size = list(out.shape)
    if global_shape(out) is not None:
        for d, g in zip(spatial_dims(out, n), global_shape(out)):
            size[d] = g
    elif positions(out) is not None:
        grid, dim = positions(out)
        size[dim] = lead(grid) * math.prod(grid) * trail(grid) + prefix(grid)  # whole items round the windows
    elements = math.prod(size)
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() == 0:
        return 0, elements
    channels = weight.shape[0] if not isinstance(module, nn.modules.conv._ConvTransposeNd) else weight.shape[1]
    channels *= getattr(module, "groups", 1) if isinstance(module, nn.modules.conv._ConvTransposeNd) else 1
    return weight.numel() * elements // max(channels, 1), elements


def split_share(rows: list[LayerRow]) -> dict:
    """How much of the layers' compute and output activations is split over the workers, not replicated."""
    macs = sum(r.macs for r in rows)
    elements = sum(r.elements for r in rows)
    return {"compute": sum(r.macs for r in rows if r.split) / macs if macs else 1.0,
            "activations": sum(r.elements for r in rows if r.split) / elements if elements else 1.0,
            "replicated_layers": sum(not r.split for r in rows), "layers": len(rows)}


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
    for name, module, x_shape, out_shape, split, (macs, elements) in seen:
        if x_shape is None or out_shape is None:  # a head on a pooled vector
            rows.append(LayerRow(name, type(module).__name__, [], [], [], [0] * n, split, field, shard_input, macs,
                                 elements))
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
                             field, shard_input, macs, elements))
    return rows


def measure_plain(spec: str, shapes: list[tuple[int, ...]], steps: int = 2, timeout_s: float = 600) -> list[int]:
    """Peak bytes of a plain training run of ``spec`` on each of ``shapes``, each in a fresh process. The
    processes run at once: each peak is its own process's, so they do not disturb one another's figure,
    and the wait is one run's rather than their sum."""
    env = {**WORKER_ENV, **os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    code = ("import json, sys; from bigconv.check import _plain_peak; "
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
    from .memory import PeakMeter

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


def memory_hint(error: str, edges) -> str:
    """What to do when a small plain run of the memory estimate failed: a model built for one input size (timm's
    img_size assertion) takes no other, larger edges would not help; other failures (BatchNorm on 1x1 maps) may."""
    if "AssertionError" in error and ("doesn't match model" in error or "img_size" in error):
        return (f"the model takes only the input size it was built for, so the estimate's plain runs at "
                f"{' and '.join(str(e) for e in edges)} px cannot run: build it for any size (timm: "
                "dynamic_img_size=True) or pass --no-memory")
    return "try larger --memory-edges"


def as_dict(obj) -> dict:
    return asdict(obj)


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(v) for v in text.lower().split("x"))
    except ValueError:
        shape = ()
    if len(shape) < 3 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a shape like 1x3x4096x4096 (batch x channels x spatial)")
    return shape


class HelpFormatter(cli.HelpFormatter):
    """``bigconv.harness.cli``'s defaults (appended only where the help names none), the description wrapped."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return argparse.HelpFormatter._fill_text(self, text, width, indent)


def check_input_dims(model: nn.Module, shape: tuple[int, ...]) -> None:
    """Raise a ``ValueError`` naming ``--input`` where its spatial dims are not those of every convolution of
    the model (a forgotten batch dim: 3x1024x1024 for a 2-D model reads as batch 3, 1024 channels, one
    spatial dim), before a dry run would refuse the convolution instead."""
    kinds = {len(m.kernel_size) for m in model.modules() if isinstance(m, nn.modules.conv._ConvNd)}
    dims = len(shape) - 2
    if len(kinds) != 1 or dims in kinds:
        return
    (d,) = kinds
    given = "x".join(map(str, shape))
    example = f"; if the batch dim is missing: 1x{given}" if dims + 1 == d else ""
    raise ValueError(f"--input {given} is batch {shape[0]} x {shape[1]} channels x {dims} spatial dim(s), but the "
                     f"model's convolutions are {d}-D: give batch x channels x {d} spatial dims (N,C,spatial...)"
                     f"{example}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bigconv.check",
        description="Will this model train with bigconv on this input, and what will each process need? "
                    "Runs the dry run (no memory), reports every windowed layer's shard and halo, estimates "
                    "the per-process peak from two small measured runs, and checks exactness on a small input.",
        formatter_class=HelpFormatter)
    p.add_argument("model", help=f"the model: {FORMS}")
    p.add_argument("--input", type=parse_shape, required=True, help="input shape, batch x channels x spatial")
    p.add_argument("--workers", type=int, default=4, help="processes the input is split over")
    p.add_argument("--grid", type=lambda t: tuple(int(v) for v in t.split("x")), default=None,
                   help="shards per spatial dim, e.g. 2x2 (default: the balanced grid bigconv would choose)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    p.add_argument("--no-memory", action="store_true", help="skip the memory estimate (two small plain runs)")
    p.add_argument("--memory-edges", type=lambda t: tuple(int(v) for v in t.split(",")), default=(128, 256),
                   help="the two edges of the small plain runs the memory estimate is scaled from")
    p.add_argument("--no-exact", action="store_true", help="skip the exactness check (it starts local workers)")
    p.add_argument("--exact-size", type=int, default=64, help="edge of the exactness check's float64 input")
    p.add_argument("--exact-steps", type=int, default=EXACT_STEPS,
                   help="optimizer steps of the exactness check (at least 3: optimizer state made at step 1 acts "
                        "from step 2, an error in its update shows at step 3)")
    p.add_argument("--optimizer", default="momentum",
                   help=f"the optimizer the exactness check trains with (and whose state per parameter the planner "
                        f"counts, one of {', '.join(OPTIMIZERS)} there): {OPTIMIZER_FORMS}")
    p.add_argument("--exact-workers", type=int, default=None,
                   help="local workers of the exactness check (default: --workers, at most 4)")
    g = p.add_argument_group("cluster planning (with --gpus; docs/check.md#planning-a-cluster)")
    g.add_argument("--gpus", type=int, default=None,
                   help="plan for this many GPUs, one process each, instead of checking on local workers")
    g.add_argument("--gpu", default=None,
                   help=f"the GPU: {', '.join(devices.GPUS)}; NAME:key=value,... overrides figures "
                        "(h100-80gb:memory_gib=64), a JSON file gives your own")
    g.add_argument("--link", default=None, help=f"link between the GPUs of a node: {', '.join(devices.INTRA_LINKS)} "
                                                 "(default: the GPU's usual one)")
    g.add_argument("--nodes", type=int, default=None,
                   help="nodes the GPUs sit on (default: as many as the GPU's usual node size needs)")
    g.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (default: the GPU's usual node)")
    g.add_argument("--inter", default=None, help=f"link between nodes: {', '.join(devices.INTER_LINKS)} "
                                                  "(default: the GPU's usual one)")
    g.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"],
                   help="the model's and the activations' dtype")
    g.add_argument("--amp", default=None, choices=["bfloat16", "float16"],
                   help="autocast dtype: activations and convolutions in it, parameters in --dtype")
    g.add_argument("--memory", type=float, default=None, help="GiB per GPU, instead of the device table's")
    g.add_argument("--headroom", type=float, default=0.1,
                   help="fraction of each GPU's memory a plan leaves free for the allocator's fragmentation")
    g.add_argument("--replicas", type=int, default=None,
                   help="data-parallel replicas (default: the fastest the batch allows)")
    g.add_argument("--max-size", action="store_true", help="also find the largest input of this shape's proportions "
                                                           "that fits --gpus GPUs")
    g.add_argument("--size-multiple", type=int, default=8, help="--max-size's sizes are multiples of this")
    g.add_argument("--no-search", action="store_true", help="skip the search for the fewest GPUs that fit")
    g.add_argument("--op-table", default=None, help="per-op rates measured with --calibrate-ops (JSON), instead of "
                                                    "the device table's")
    g.add_argument("--calibrate-ops", default=None, metavar="FILE",
                   help="measure per-op rates of MODEL on this machine's GPU (or CPU) at --input, write them to FILE "
                        "and exit")
    g.add_argument("--layers", action="store_true", help="print the per-layer table")
    return p


class OutputsMSE(nn.Module):
    """MSE summed over every output tensor (a list, tuple or dict of them, or one): the exactness check's loss,
    so that a model with several outputs is checked on each."""

    def forward(self, out, target):
        from .verify import output_leaves

        got, want = output_leaves(out), output_leaves(target)
        return sum(torch.nn.functional.mse_loss(got[k], want[k]) for k in sorted(got))


EXACT_STEPS = 3
"""Optimizer steps of the exactness check: optimizer state (a momentum buffer, Adam's moments) made at step 1
acts on the weights from step 2, and an error in its update at step 2 reaches them at step 3."""


def exactness(spec: str, shape: tuple[int, ...], workers: int, optimizer: str = "momentum",
              steps: int = EXACT_STEPS) -> dict:
    """``compare_training`` on a small float64 input: one process against ``workers`` local ones, ``steps``
    steps of ``optimizer`` (``model_spec.build_optimizer``), the optimizer state judged too.

    The model is built as the user has it (training mode: dropout and stochastic depth on); both sides
    draw the same masks (``bigconv.ops.random``). The loss is the MSE against a random target of each
    output's shape (``OutputsMSE``: every output of a model with several). Where the verdict is
    ``ill-conditioned at this size``, ``rerun_at`` is an input shape at which one process's run is well
    conditioned (or None)."""
    from .engine.dry_run import copy_model
    from .runtime.world import World
    from .verify import ERROR_KEYS, compare_training, conditioned_size, map_output

    cls, opt_kwargs = build_optimizer(optimizer)
    torch.manual_seed(0)
    model = build_model(spec).double()
    x = torch.randn(*shape, dtype=torch.float64)

    def target(inp: torch.Tensor):  # a random target of each output's shape
        with torch.no_grad():
            return map_output(copy_model(model).eval()(inp), torch.randn_like)

    y = target(x)
    grid = choose_grid(shape[2:], workers)
    untouched = copy_model(model)  # compare_training hands ``model`` to the workers
    with World(workers=workers) as world:
        r = compare_training(model, world, x, y, OutputsMSE(), grid=grid, steps=steps, optimizer=cls, **opt_kwargs)
    rerun = conditioned_size(untouched, x, target, OutputsMSE(), steps=steps, optimizer=cls, opt_kwargs=opt_kwargs) \
        if r["verdict"] == "ill-conditioned at this size" else None
    keys = ERROR_KEYS
    return {"input": list(shape), "dtype": "float64", "workers": workers, "grid": list(grid), "exact": r["exact"],
            "verdict": r["verdict"], "steps": steps, "optimizer": f"{cls.__name__}({_kwargs(opt_kwargs)})",
            "relative_errors": {k: r[k] for k in keys}, "worst": {k: r["worst"][k] for k in keys},
            "ill_conditioned": [{k: t[k] for k in ("category", "tensor", "error", "scale", "noise")}
                                for t in r["ill_conditioned"]],
            "wrong": [{k: t[k] for k in ("category", "tensor", "error", "scale", "noise", "status", "workers")
                       if k in t} for t in r["wrong"]],
            "residues": len(r["residues"]), "rerun_at": list(rerun) if rerun else None, "tolerance": r.get("tol"),
            "reorderings": r["reorderings"]}


def _kwargs(kwargs: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in kwargs.items())


def check(args) -> dict:
    shape = args.input
    dims = len(shape) - 2
    check_positive_int(args.workers, "--workers")
    if args.exact_steps < EXACT_STEPS:
        raise ValueError(f"--exact-steps {args.exact_steps}: the exactness check needs at least {EXACT_STEPS} steps "
                         "(optimizer state made at step 1 acts from step 2; an error in its update shows at step 3)")
    build_optimizer(args.optimizer)  # a bad --optimizer is named before any work
    grid = validate_grid(args.grid, args.workers) if args.grid else choose_grid(shape[2:], args.workers)
    if len(grid) != dims:
        raise ValueError(f"--grid {grid} has {len(grid)} entries but the input has {dims} spatial dims")
    result = {"model": args.model, "input": list(shape), "workers": args.workers, "grid": list(grid)}
    model = build_model(args.model)
    check_input_dims(model, shape)
    try:
        attention, attention_bytes = [], []
        rows, error = layer_report(model, shape, grid, attention=attention, attention_bytes=attention_bytes)
    except ValueError as exc:
        rows, error = [], exc
    result["attention"] = [{"module": m, "type": t, "strategy": s} for m, t, s in attention]
    # Global attention's ring buffers or gathered keys (worker 0, the largest of them): the plain runs' line
    # through two small sizes does not see them (their scores grow with the square of the positions)
    result["attention_bytes"] = max(attention_bytes, default=0)
    result["decomposable"] = error is None
    result["refusal"] = None if error is None else {"error": type(error).__name__, "message": str(error)}
    result["layers"] = [as_dict(r) for r in rows]
    result["split"] = split_share(rows) if rows else None
    result["memory"] = None
    if not (args.no_memory or error):
        try:
            result["memory"] = as_dict(estimate_memory(args.model, shape, args.workers, args.memory_edges))
            result["memory"]["per_process_bytes"] += result["attention_bytes"]
        except RuntimeError as exc:  # a small run the model cannot take (BatchNorm on 1x1 maps of one image)
            result["memory"] = {"error": f"{exc}; {memory_hint(str(exc), args.memory_edges)}"}
    if args.no_exact or error:
        result["exactness"] = None
    else:
        small = (2, shape[1], *[args.exact_size] * dims)  # batch 2: BatchNorm needs two values per channel
        small, why = exact_input(model, small, shape)
        result["exactness"] = {"error": why} if small is None else exactness(
            args.model, small, args.exact_workers or min(args.workers, 4), args.optimizer, args.exact_steps)
    return result


EXACT_MAX_PIXELS = 512 * 512
"""The largest input per image (pixels) the exactness check falls back to when the model takes no smaller one."""


def exact_input(model: nn.Module, small: tuple[int, ...], given: tuple[int, ...]
                ) -> tuple[tuple[int, ...] | None, str | None]:
    """The exactness check's input: ``small``, or the given size (batch 2) for a model that takes only some
    sizes (a Flatten before a Linear of fixed width) if that is at most ``EXACT_MAX_PIXELS``; else None and
    why. Judged by one process's forward on meta tensors (no memory)."""
    from .engine.dry_run import copy_model

    def takes(shape) -> str | None:
        meta = copy_model(model).to("meta")
        try:
            with torch.no_grad():
                meta(torch.empty(shape, device="meta"))
        except (RuntimeError, TypeError, IndexError, ValueError) as exc:
            return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return None

    refused = takes(small)
    if refused is None:
        return small, None
    at_given = (2, *given[1:])
    fits = math.prod(given[2:]) <= EXACT_MAX_PIXELS
    if fits and takes(at_given) is None:
        return at_given, None
    return None, (f"the model does not take the exactness check's input {'x'.join(map(str, small))} ({refused}); "
                  f"give --exact-size the edge of an input it takes" + (
                      "" if fits else f" (the given input, {math.prod(given[2:]):,} pixels an image, is over the "
                                      f"{EXACT_MAX_PIXELS:,} the check runs at in float64 by itself)"))


def _mib(n: int) -> str:
    return f"{n / MiB:,.0f} MiB" if n < 10 * 2 ** 30 else f"{n / 2 ** 30:,.1f} GiB"


def _x(v) -> str:
    return "x".join(str(i) for i in v) if v else "-"


def report(r: dict) -> str:
    lines = [f"bigconv check: {r['model']} on {_x(r['input'])}, {r['workers']} workers, grid {_x(r['grid'])}", ""]
    if not r["decomposable"]:
        lines += ["Decomposable: NO (found by the dry run, before any remote work)", "", r["refusal"]["message"]]
        return "\n".join(lines)
    lines += ["Decomposable: yes (dry run on meta tensors: every shard's forward, no memory used)", "",
              f"{'layer':32} {'type':16} {'output':>11} {'shard':>11} {'halo':>6}  {'map':10} receptive field"]
    for row in r["layers"]:
        fov = f"{row['receptive_field']} px (shard {_x(row['shard_input'])})"
        lines.append(f"{row['module'][:32]:32} {row['kind'][:16]:16} {_x(row['output']):>11} {_x(row['shard']):>11} "
                     f"{max(row['halo'] or [0]):>6}  {'split' if row['split'] else 'replicated':10} {fov}")
    lines.append("(halo: widest, in input positions; receptive field: an upper bound, summed over the windowed "
                 "layers so far)")
    share = r.get("split")
    if share:
        lines += ["", f"Split over the workers: {share['compute']:.0%} of the layers' compute, {share['activations']:.0%} "
                  f"of their output activations ({share['replicated_layers']} of {share['layers']} layers replicated: "
                  "whole on every worker)"]
        for a in r.get("attention") or []:
            lines.append(f"  attention {a['module']} ({a['type']}): {a['strategy']}")
        if r.get("attention_bytes"):
            lines.append(f"  global attention holds up to {_bytes(r['attention_bytes'])} per worker beyond its "
                         "activations (ring buffers or gathered keys; counted in the memory estimate below)")
        if share["compute"] < 0.5 or share["activations"] < 0.5:
            lines.append("WARNING: most of this model runs replicated on every worker (maps smaller than the grid, "
                         "tokens gathered whole for attention between all positions): more workers will not make it "
                         "fit or run faster; see docs/models.md")
            if any(a["strategy"].startswith("replicated") for a in r.get("attention") or []):
                lines.append("  (tokens gathered whole before attention: an op on a ViT's patch tokens that bigconv "
                             "does not split, named by docs/models.md's ViT section; a timm ViT as it ships, with "
                             "class and register tokens, attends over split tokens by ring attention)")
    m = r["memory"]
    if m and "error" in m:
        lines += ["", f"Memory: not estimated: {m['error'][-600:]}"]
    elif m:
        lines += ["", f"Memory, estimated ({m['method']}):",
                  f"  one process: {_mib(m['single_bytes'])}; each of {r['workers']} processes: "
                  f"{_mib(m['per_process_bytes'])} (single / {r['workers']}: {_mib(m['ideal_per_process_bytes'])})"]
    e = r["exactness"]
    if e and "error" in e:
        lines += ["", f"Exactness: NOT CHECKED: {e['error']}"]
    elif e:
        errs = ", ".join(f"{k} {v:.1e}" for k, v in e["relative_errors"].items())
        lines += ["", f"Exactness on {_x(e['input'])} float64, {e['workers']} workers, grid {_x(e['grid'])}, "
                  f"{e['steps']} steps of {e['optimizer']}: {e['verdict'].upper()} (worst relative errors: {errs}; "
                  f"{e['residues']} residues)",
                  "  (each tensor against one process within "
                  f"{e['tolerance']:.0e} of its own size; rounding's effect measured by reordered one-process runs: "
                  f"{', '.join(e['reorderings']) or 'none applied'}; a residue is a tensor those runs leave without a "
                  "significant digit (a sum that cancels, zero in exact arithmetic), allowed 10x their movement; "
                  "no other floor; outputs, input gradients and losses never floored; docs/testing.md)"]
        apart = [t for t in e["wrong"] if t["category"] == "replicas"]  # first: where copies went apart
        against = [t for t in e["wrong"] if t["category"] != "replicas"]
        for t in apart[:6]:
            lines.append(f"  workers disagree: {t['tensor']} on worker(s) {', '.join(map(str, t['workers']))} "
                         f"differs from worker 0's by {t['error']:.1e} (size {t['scale']:.1e})")
        for t in against[:10]:
            lines.append(f"  {t['status']}: {t['category']} {t['tensor']}: error {t['error']:.1e}, size "
                         f"{t['scale']:.1e}, rounding noise {t['noise']:.1e}")
        if len(apart) > 6 or len(against) > 10:
            lines.append(f"  ... {max(len(apart) - 6, 0) + max(len(against) - 10, 0)} more (--json lists them all)")
        if e["verdict"] == "ill-conditioned at this size":
            lines.append(f"  rounding alone moves {len(e['ill_conditioned'])} tensors by more than "
                         f"{e['tolerance']:.0e} of their size in one process, so no comparison can call them exact:")
            lines += [f"    {t['category']} {t['tensor']}: noise {t['noise']:.1e} of size {t['scale']:.1e}"
                      for t in e["ill_conditioned"][:10]]
            lines.append(f"  rerun with --exact-size {e['rerun_at'][2]} (one process is well conditioned at "
                         f"{_x(e['rerun_at'])})" if e["rerun_at"] else
                         "  no input up to 8x larger per side makes one process well conditioned")
    return "\n".join(lines)


def planning(args) -> int:
    from .harness import plan_report

    check_positive_int(args.gpus, "--gpus")
    if args.optimizer not in OPTIMIZERS:
        raise ValueError(f"--optimizer {args.optimizer}: the planner counts optimizer state by name; give one of "
                         f"{', '.join(OPTIMIZERS)} (the closest to yours in state per parameter)")
    if args.gpu is None:
        raise ValueError(f"--gpus needs --gpu: one of {', '.join(devices.GPUS)}, NAME:key=value,... or a JSON file")
    if args.grid and len(args.grid) != len(args.input) - 2:
        raise ValueError(f"--grid {args.grid} has {len(args.grid)} entries but the input has "
                         f"{len(args.input) - 2} spatial dims")
    model = build_model(args.model)
    check_input_dims(model, tuple(args.input))
    r = plan_report.plan(args, model)
    print(json.dumps(r, indent=1) if args.json else plan_report.report(r, layers=args.layers))
    return 0 if r["plan"] is not None and r["plan"]["fits"] else 1


def calibrating(args) -> int:
    from .harness.op_table import calibrate

    table = calibrate(build_model(args.model), tuple(args.input))
    table.save(args.calibrate_ops)
    steps = ", ".join(f"{t:.3f}" for t in table.calibration["plain_step_s"])
    sizes = " and ".join("x".join(map(str, s)) for s in (table.calibration["input"], table.calibration["second_input"]))
    print(f"per-op rates of {args.model} at {sizes} on {table.calibration['device_name']} written to "
          f"{args.calibrate_ops} (plain steps {steps} s)")
    if table.device == "cpu" and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        print("note: on a CPU, run it under the workers' allocator settings (eval \"$(python -m "
              "experiments.cluster.env)\") for its transient-memory figures to read what bigconv's ranks hold")
    return 0


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.calibrate_ops:
            return calibrating(args)
        if args.gpus is not None:
            return planning(args)
        r = check(args)
    except ValueError as exc:
        print(f"bigconv check: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(r, indent=1) if args.json else report(r))
    ok = r["decomposable"] and (r["exactness"] is None or r["exactness"].get("exact", False))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
