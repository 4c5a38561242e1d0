"""``net.capture``: the outputs of named modules and the gradients reaching them, whole on the driver.

    got = net.capture(["layer4", "fc"], x, target=3)          # the gradient of class 3's score
    got["layer4"].output, got["layer4"].grad                  # as one process would have them
    got = net.capture(["layer4"], x, y, loss_fn=nn.CrossEntropyLoss())   # the gradient of the loss

Each worker hooks the named modules of its copy of the model (``bigconv.engine.capture``), runs its
shard, and sends back its part; the driver joins the parts of a sharded map and takes a tensor every
shard holds whole (a head's vector) from worker 0, with its gradient summed over the copies. Nothing
changes in the model: no gradient is left on a weight, no optimizer steps. ``capture_local`` is the same
on one process, with plain hooks: the reference the tests compare with.

With ``out=`` the workers write their regions into a zarr group instead, for captures the size of a
slide (``_write``); on SPMD ranks each rank writes its own (``capture_spmd``, ``_write_spmd``).

Gradients: of an output score (``target``: a class index, or one per image: the sum of that logit over
the map for a dense output) built on each shard, one message per worker; or of a loss
(``y`` and ``loss_fn``) taken on the gathered output by the driver, two messages, as ``net.gradients``
does. Either needs the ``p2p`` transport.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable, Sequence

import torch
import torch.nn as nn

from .data import outputs
from .engine.capture import Captured, Recorder, call_names, cam_map, channel_sums, join, score_gradient

__all__ = ["Captured", "capture", "capture_local", "gradcam", "gradcam_local"]


def check_layers(model: nn.Module, layers) -> list[str]:
    names = [layers] if isinstance(layers, str) else list(layers) if isinstance(layers, (list, tuple)) else None
    if not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"layers must be a module name or a list of them (names of model.named_modules()), "
                         f"got {layers!r}")
    known = dict(model.named_modules())
    missing = [n for n in names if n not in known or n == ""]
    if missing:
        some = ", ".join(list(n for n in known if n)[:8])
        raise ValueError(f"no module named {', '.join(map(repr, missing))} in the model; names are those of "
                         f"model.named_modules(), e.g. {some}")
    return list(dict.fromkeys(names))


def check_targets(target, batch: int, classes: int) -> list[int]:
    """``target`` as one class index per image, each in [0, classes)."""
    items = [target] * batch if isinstance(target, int) and not isinstance(target, bool) else \
        [int(t) for t in target] if isinstance(target, (list, tuple, torch.Tensor)) else None
    if items is None or len(items) != batch or any(not 0 <= t < classes for t in items):
        raise ValueError(f"target must be a class index in [0, {classes}) or one per image ({batch}), got {target!r}")
    return items


def _check_what(y, loss_fn, target) -> bool:
    if target is not None and (y is not None or loss_fn is not None):
        raise ValueError("give target= (the gradient of an output score) or y= and loss_fn= (of a loss), not both")
    if (y is None) != (loss_fn is None):
        raise ValueError("the gradient of a loss needs both y= and loss_fn=")
    return target is not None or loss_fn is not None


def _edges(spatial: Sequence[int], grid: Sequence[int], max_chunk: int) -> tuple[int, ...]:
    """Chunk edges dividing every shard boundary of a map (no chunk has two writers)."""
    import math

    from .geometry.boxes import balanced_bounds

    out = []
    for n, g in zip(spatial, grid):
        starts = [lo for lo, _ in balanced_bounds(n, g)][1:]
        common = math.gcd(*starts) if starts else n
        out.append(max(d for d in range(1, min(common, max_chunk, n) + 1) if common % d == 0))
    return tuple(out)


def _make_arrays(tmp: str, layout: dict, grid: Sequence[int], max_chunk: int) -> None:
    """The group ``tmp``'s arrays for ``layout`` (``ModelPart.capture_layout_of``): ``KEY/output`` and
    ``KEY/grad``, chunks never crossing a shard boundary."""
    import zarr

    root = zarr.open_group(tmp, mode="r+")
    for name, calls in layout.items():
        for key, (shape, dtype, sharded, has_grad) in zip(call_names(name, len(calls)), calls):
            lead = len(shape) - len(grid)
            chunks = (1, *shape[1:lead], *_edges(shape[lead:], grid, max_chunk)) if sharded else shape
            for part in ("output", "grad") if has_grad else ("output",):
                root.create_array(f"{key}/{part}", shape=shape, chunks=chunks, dtype=dtype)
            root[key].attrs["sharded"] = sharded


def _write_whole_grads(tmp: str, whole: list[dict]) -> None:
    """The gradients of the tensors every shard holds whole: the sum of the shards' copies (in shard order)."""
    import zarr

    for key in whole[0]:
        grads = [w[key] for w in whole if w[key] is not None]
        if grads:
            zarr.open_array(f"{tmp}/{key}/grad", mode="r+")[...] = sum(grads[1:], grads[0].clone()).numpy()


def _opened(path: str) -> dict[str, Captured]:
    """The captures of the group at ``path``, as zarr arrays."""
    import zarr

    group = zarr.open_group(path, mode="r")
    return {key: Captured(group[f"{key}/output"], group[f"{key}/grad"] if "grad" in group[key] else None)
            for key in group.group_keys()}


def _write(net, plan, layout: dict, path: str, max_chunk: int) -> dict[str, Captured]:
    """The captures written by the workers into a zarr group at ``path`` (a temporary sibling first)."""
    from .data import outputs
    from .geometry.boxes import all_coords

    tmp = outputs.begin_group(path)
    _make_arrays(tmp, layout, plan.grid, max_chunk)
    try:
        whole = net._wait(net._launch("capture_write", [(tmp, plan.grid, c) for c in all_coords(plan.grid)]),
                          "writing the captures")
        _write_whole_grads(tmp, whole)
    except BaseException:
        if not net.world.broken:
            outputs.abandon(tmp)
        raise
    outputs.finish(tmp, path)
    return _opened(path)


@outputs.releasing_claims
def capture(net, layers, x, y=None, loss_fn: Callable | None = None, target=None, out=None, overwrite: bool = False,
            max_chunk: int = 1024) -> dict[str, Captured]:
    """The driver mode's ``ParallelModel.capture`` (see the module doc)."""
    from .data import outputs
    from .data.sources import is_source_batch

    names = check_layers(net.planner.meta, layers)
    grads = _check_what(y, loss_fn, target)
    if grads and net.transport != "p2p":
        raise ValueError("capture with gradients runs on the p2p transport; parallelize(..., transport='p2p')")
    plan = net.plan(x)
    if plan.several and target is not None:
        raise ValueError("target= scores a model with one output tensor; use y= and loss_fn= for several outputs")
    targets = check_targets(target, plan.out_full_shape[0], plan.out_full_shape[1]) if target is not None else None
    if loss_fn is not None:
        net.planner.check_loss(plan, x, y, loss_fn)
    path = outputs.check_out(out, [s.path for s in x] if is_source_batch(x) else [], overwrite) if out else None
    shards = net._shard_calls(plan, x)
    call = f"capture {shards[0].call}"
    net._wait(net._launch("capture_begin", [(names, grads)] * len(shards)), call)
    try:
        if targets is not None:
            net._wait(net._launch("capture_score", [(s, targets) for s in shards]), call)
        elif loss_fn is not None:
            net._loss_on_driver(plan, shards, y, loss_fn, grad="input", gradients=True)
        else:
            net._wait(net._launch("capture_forward", [(s,) for s in shards]), call)
        if path is not None:
            layout = net._wait(net._launch("capture_layout", [()] * len(shards)), f"{call} (layout)")[0]
            return _write(net, plan, layout, path, max_chunk)
    finally:
        if not net.world.broken:
            parts = net._wait(net._launch("capture_end", [()] * len(shards)), f"{call} (reading)")
    return join(parts, plan.grid)


def capture_local(model: nn.Module, layers, x: torch.Tensor, y=None, loss_fn: Callable | None = None,
                  target=None) -> dict[str, Captured]:
    """``capture`` on one process, with plain forward hooks: the reference. Leaves no gradient on the
    model's weights."""
    names = check_layers(model, layers)
    grads = _check_what(y, loss_fn, target)
    recorder = Recorder(model, names, grads)
    try:
        with torch.set_grad_enabled(grads):
            out = model(x)
            if target is not None:
                g = score_gradient(out, check_targets(target, out.shape[0], out.shape[1]), True)
                out.backward(g)
            elif loss_fn is not None:
                loss_fn(out, y).backward()
    finally:
        recorder.close()
        model.zero_grad(set_to_none=True)
    return {key: Captured(p.value, p.grad) for name, pieces in recorder.calls.items()
            for key, p in zip(call_names(name, len(pieces)), pieces)}


def names_of(model: nn.Module) -> Sequence[str]:
    return [n for n, _ in model.named_modules() if n]


METHODS = ("gradcam", "saliency")


@outputs.releasing_claims
def gradcam(net, x, layer: str | None = None, target=None, *, method: str = "gradcam", out=None,
            overwrite: bool = False, levels: int | None = None, mpp: float | None = None,
            max_chunk: int = 1024):
    """Grad-CAM of ``target`` (a class, or one per image) at ``layer``, on the input's grid: ReLU of the
    layer's channels weighted by the mean gradient of the target's score over each channel, upsampled
    (bilinear) by the workers; or, with ``method="saliency"``, the input-gradient saliency (the largest
    |d score / d input| over the input's channels). (N, 1, *input spatial) float, whole on the driver,
    or, with ``out=``, written by the workers: ``NAME.zarr`` (one array) or ``NAME.ome.zarr`` (a
    pyramid, as ``predict`` writes one; ``levels``, ``mpp`` as there). Exact against ``gradcam_local``."""
    from .data import outputs, pyramid
    from .data.sources import is_source_batch
    from .engine.executor import join_shards
    from .geometry.boxes import all_coords, box_index, shard_box
    from .prediction import output_format, pixel_size

    if getattr(net, "mesh", None) is not None:  # an SPMD model: every rank calls this
        return gradcam_spmd(net, x, layer, target, method=method, out=out, overwrite=overwrite, levels=levels,
                            mpp=mpp, max_chunk=max_chunk)
    _check_method(net, method, layer)
    if net.transport != "p2p":
        raise ValueError(f"{method} runs on the p2p transport; parallelize(..., transport='p2p')")
    plan = net.plan(x)
    if plan.several:
        raise ValueError(f"{method} scores a model with one output tensor")
    targets = check_targets(target, plan.out_full_shape[0], plan.out_full_shape[1])
    shards = net._shard_calls(plan, x)
    coords = list(all_coords(plan.grid))
    batch, spatial = plan.out_full_shape[0], tuple(plan.in_shape)
    dtype = str(x.dtype if isinstance(x, torch.Tensor) else torch.float32).replace("torch.", "")
    regions: list = [None] * len(shards)
    tmp = path = None
    if out is not None:
        fmt = output_format(out)
        path = outputs.check_out(out, [s.path for s in x] if is_source_batch(x) else [], overwrite)
        if fmt == "zarr":
            tmp = outputs.begin(path, (batch, 1, *spatial), outputs.aligned_chunks(spatial, plan.grid, max_chunk), dtype)
            regions = [("zarr", tmp, box_index(shard_box(spatial, plan.grid, c), len(spatial) + 2)) for c in coords]
        elif fmt == "ome.zarr" and batch == 1:
            pixel, unit = pixel_size(SimpleNamespace(in_shape=spatial, out_shape=spatial), x, mpp)  # the input's grid
            spec = pyramid.spec_for(("float",), 1, dtype, spatial, plan.grid, levels, max_chunk, ome=True)
            tmp = outputs.begin_group(path)
            pyramid.create(tmp, spec, pixel, unit, None, f"{method} of class {targets[0]}")
            regions = [("ome", tmp, spec, c) for c in coords]
        else:
            raise ValueError(f"{method} writes a .zarr, or an .ome.zarr of one image; got out={out!r} for a batch of "
                             f"{batch}")
    call = f"{method} {shards[0].call}"
    names = [layer] if method == "gradcam" else []
    try:
        net._wait(net._launch("capture_begin", [(names, True)] * len(shards)), call)
        net._wait(net._launch("capture_score", [(s, targets) for s in shards]), call)
        if method == "gradcam":
            sums = net._wait(net._launch("gradcam_sums", [(layer,)] * len(shards)), call)
            shape = sums[0][1]
            weights = sum(s for s, _ in sums[1:]) + sums[0][0]
            weights = weights / float(torch.tensor(shape).prod())
            step = next(net._calls)
            maps = net._wait(net._launch("gradcam_map", [(layer, weights, plan.grid, step, spatial, r)
                                                         for r in regions]), call)
        else:
            maps = net._wait(net._launch("saliency_map", [(r,) for r in regions]), call)
        if regions[0] is not None and regions[0][0] == "ome":
            for k in range(1, regions[0][2].levels):
                net._wait(net._launch("pyramid_level", [(k,)] * len(shards)), f"{call} (level {k})")
    except BaseException:
        if not net.world.broken:
            try:
                net._wait(net._launch("capture_end", [()] * len(shards)), f"{call} (clearing its hooks)")
            except Exception:  # the first error is the one to report
                pass
            if tmp is not None:
                outputs.abandon(tmp)
        raise
    if out is None:
        return join_shards(maps, plan.grid)
    return outputs.finish(tmp, path)


def _check_method(net, method: str, layer) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method == "gradcam":
        if not isinstance(layer, str):
            raise ValueError("Grad-CAM needs layer= the name of one module (e.g. 'layer4' of a ResNet)")
        check_layers(net.planner.meta, layer)


@outputs.releasing_claims
def gradcam_spmd(net, x, layer: str | None = None, target=None, *, method: str = "gradcam", out=None,
                 overwrite: bool = False, levels: int | None = None, mpp: float | None = None,
                 max_chunk: int = 1024):
    """``bigconv.gradcam`` on an SPMD world (``replicas=1``): every rank calls it with the same arguments.
    Each rank scores its shard, the per-channel gradient sums are summed over the ranks (one all-reduce of
    N × K numbers), each rank upsamples its part of the map under the op rules (the halos from its
    neighbours), and the map is gathered on every rank; with ``out=``, rank 0 checks ``out`` and makes the
    store, every rank writes its region (and its part of each pyramid level), rank 0 moves it into place."""
    import torch.distributed as dist

    from .data import outputs, pyramid
    from .data.sources import is_source_batch
    from .engine import step as shard_step
    from .engine.step import OutputGradients, StepCommand
    from .geometry.boxes import box_index, coord_of, shard_box
    from .prediction import output_format, pixel_size
    from .runtime import spmd_outputs

    _check_method(net, method, layer)
    if net.replicas != 1:
        raise ValueError(f"{method} on an SPMD world needs replicas=1 (one copy of the grid over the whole batch)")
    plan = net.plan(x)
    if plan.several:
        raise ValueError(f"{method} scores a model with one output tensor")
    targets = check_targets(target, plan.out_full_shape[0], plan.out_full_shape[1])
    batch, spatial = plan.out_full_shape[0], tuple(plan.in_shape)
    dtype = str(x.dtype if isinstance(x, torch.Tensor) else torch.float32).replace("torch.", "")
    coord = coord_of(net.mesh.shard, plan.grid)
    fmt = output_format(out) if out is not None else None
    if fmt is not None and not (fmt == "zarr" or (fmt == "ome.zarr" and batch == 1)):
        raise ValueError(f"{method} writes a .zarr, or an .ome.zarr of one image; got out={out!r} for a batch of "
                         f"{batch}")
    spec = None
    if fmt == "ome.zarr":
        pixel, unit = pixel_size(SimpleNamespace(in_shape=spatial, out_shape=spatial), x, mpp)  # the input's grid
        spec = pyramid.spec_for(("float",), 1, dtype, spatial, plan.grid, levels, max_chunk, ome=True)

    def make() -> tuple[str, str]:  # on rank 0 only; every rank gets its answer
        path = outputs.check_out(out, [s.path for s in x] if is_source_batch(x) else [], overwrite)
        if fmt == "zarr":
            return path, outputs.begin(path, (batch, 1, *spatial), outputs.aligned_chunks(spatial, plan.grid, max_chunk),
                                       dtype)
        tmp = outputs.begin_group(path)
        pyramid.create(tmp, spec, pixel, unit, None, f"{method} of class {targets[0]}")
        return path, tmp

    path = tmp = None
    if fmt is not None:
        path, tmp = spmd_outputs.made_by_rank_zero(net.world, net.engine, make, method)

    engine = net.engine
    names = [layer] if method == "gradcam" else []
    failure = None
    up = None
    try:
        recorder = Recorder(engine.model, names, True)
        try:
            shard = net._shard_call(plan, x)
            score = shard_step.forward(engine, shard, "input")
            gradient = score_gradient(score, targets, net.mesh.shard == 0)
            shard_step.run(engine, StepCommand(shard, OutputGradients(gradient), grad="input", gradients=True), score)
        finally:
            recorder.close()
            engine.model.zero_grad(set_to_none=True)
        if method == "gradcam":
            piece = recorder.calls[layer][0]
            sums, shape = channel_sums(piece)
        else:
            g = engine.last_input.grad if engine.last_input is not None else None
            up = (g if g is not None else torch.zeros_like(engine.last_input)).detach().abs().amax(1, keepdim=True).cpu()
    except Exception as exc:  # every rank learns of a failure before the next collective
        failure = f"{type(exc).__name__}: {exc}"
    spmd_outputs.agree(net.world, net.engine, failure, method, tmp)
    if method == "gradcam":
        with engine.naming_lost_ranks("Grad-CAM's channel sums"):  # a rank gone is named, not waited for
            dist.all_reduce(sums)  # replicas=1: the world is the grid
        net._call += 1
        up = cam_map(engine, tuple(plan.grid), net._call, piece, sums / float(torch.tensor(shape).prod()), spatial)
    if fmt is None:
        return shard_step.gather_dense(engine, tuple(plan.grid), up)
    writer = pyramid.LevelWriter(spec, tmp, coord) if spec is not None else None

    def first() -> None:
        if writer is None:
            outputs.write(tmp, box_index(shard_box(spatial, plan.grid, coord), len(spatial) + 2), up.numpy())
        else:
            writer.first(up)

    spmd_outputs.together(net.world, net.engine, first, f"{method} (level 0)", tmp)
    for k in range(1, spec.levels if spec is not None else 1):
        spmd_outputs.together(net.world, net.engine, lambda k=k: writer.next(k), f"{method} (level {k})", tmp)
    if net.world.rank == 0:
        outputs.finish(tmp, path)
    net.world.barrier()  # every rank returns once the output is in place
    return path


def gradcam_local(model: nn.Module, x: torch.Tensor, layer: str | None = None, target=None, *,
                  method: str = "gradcam") -> torch.Tensor:
    """``gradcam`` on one process (plain hooks, ``F.interpolate``): the reference."""
    if method == "saliency":
        x = x.detach().clone().requires_grad_(True)
        out = model(x)
        out.backward(score_gradient(out, check_targets(target, out.shape[0], out.shape[1]), True))
        model.zero_grad(set_to_none=True)
        return x.grad.abs().amax(1, keepdim=True)
    got = capture_local(model, layer, x, target=target)[layer]
    a, g = got.output, got.grad
    weights = g.double().flatten(2).mean(2).to(a.dtype)
    cam = torch.relu((a * weights.reshape(*weights.shape, *[1] * (a.dim() - 2))).sum(1, keepdim=True))
    mode = "bilinear" if a.dim() == 4 else "trilinear"
    return torch.nn.functional.interpolate(cam, size=tuple(x.shape[2:]), mode=mode, align_corners=False)


@outputs.releasing_claims
def capture_spmd(net, layers, x, y=None, loss_fn: Callable | None = None, target=None, *, out=None,
                 overwrite: bool = False, max_chunk: int = 1024) -> dict[str, Captured]:
    """``SpmdModel.capture``: every rank calls it with the same arguments and gets the whole captures;
    each rank hooks its own shard, and the parts are gathered on every rank (one collective). With
    ``out=`` nothing is gathered but the whole tensors' gradients: rank 0 checks ``out`` and makes the
    group before any work, every rank writes its own parts (``ModelPart.capture_write_parts``), rank 0
    moves the group into place; a failure on any rank is raised on every rank, naming it, and the partial
    group is removed (``bigconv.runtime.spmd_outputs``). Returns what the driver mode's ``out=`` does."""
    import torch.distributed as dist

    from .data import outputs
    from .data.sources import is_source_batch
    from .runtime import spmd_outputs

    names = check_layers(net.planner.meta, layers)
    grads = _check_what(y, loss_fn, target)
    if net.replicas != 1:
        raise ValueError("capture on an SPMD world needs replicas=1 (one copy of the grid over the whole batch)")
    plan = net.plan(x, loss_fn)
    if plan.several and target is not None:
        raise ValueError("target= scores a model with one output tensor; use y= and loss_fn= for several outputs")
    targets = check_targets(target, plan.out_full_shape[0], plan.out_full_shape[1]) if target is not None else None
    if loss_fn is not None:
        net.planner.check_loss(plan, x, y, loss_fn)
    if out is None:
        recorder = Recorder(net.engine.model, names, grads)
        try:
            _run_spmd(net, plan, x, y, loss_fn, targets)
        finally:
            recorder.close()
        parts: list = [None] * net.world.size
        dist.all_gather_object(parts, recorder.result())
        return join(parts, plan.grid)

    def make() -> tuple[str, str]:  # on rank 0 only, before any work; every rank gets its answer
        path = outputs.check_out(out, [s.path for s in x] if is_source_batch(x) else [], overwrite)
        return path, outputs.begin_group(path)

    path, tmp = spmd_outputs.made_by_rank_zero(net.world, net.engine, make, "capture")
    failure = None
    try:
        recorder = Recorder(net.engine.model, names, grads)
        try:
            _run_spmd(net, plan, x, y, loss_fn, targets)
        finally:
            recorder.close()
    except Exception as exc:  # every rank learns of a failure before the next collective
        failure = f"{type(exc).__name__}: {exc}"
    after = f"; {out!r} is as it was"
    spmd_outputs.agree(net.world, net.engine, failure, "capture", tmp, after)
    return _write_spmd(net, plan, recorder.calls, path, tmp, max_chunk, after)


def _run_spmd(net, plan, x, y, loss_fn, targets) -> None:
    """This rank's forward (and backward) of a capture; the recorder's hooks keep what they need."""
    from .engine import step as shard_step
    from .engine.step import OutputGradients, StepCommand

    engine = net.engine
    if targets is not None:
        shard = net._shard_call(plan, x)
        out = shard_step.forward(engine, shard, "input")
        gradient = score_gradient(out, targets, net.mesh.shard == 0)
        shard_step.run(engine, StepCommand(shard, OutputGradients(gradient), grad="input", gradients=True), out)
    elif loss_fn is not None:
        shard_step.run(engine, net._command(plan, x, y, loss_fn, grad="input", gradients=True))
    else:
        shard_step.forward(engine, net._shard_call(plan, x), False)


def _write_spmd(net, plan, calls: dict, path: str, tmp: str, max_chunk: int, after: str) -> dict[str, Captured]:
    """Every rank's parts of ``calls`` written into the group ``tmp`` that rank 0 made, then moved to ``path``:
    rank 0 makes the arrays from its layout, every rank writes its parts, the whole tensors' gradients are
    gathered and summed on rank 0 (in rank order, as the driver sums them), rank 0 moves the group into
    place; an agreement after each stage."""
    import torch.distributed as dist

    from .data import outputs
    from .geometry.boxes import coord_of
    from .runtime import spmd_outputs
    from .runtime.model_part import ModelPart

    world, engine = net.world, net.engine
    coord = coord_of(net.mesh.shard, plan.grid)

    def together(work, what: str, partial: str | None = tmp) -> None:
        spmd_outputs.together(world, engine, work, f"capture ({what})", partial, after)

    def arrays() -> None:
        if world.rank == 0:
            _make_arrays(tmp, ModelPart.capture_layout_of(calls), plan.grid, max_chunk)

    together(arrays, "making its arrays")
    whole: dict = {}
    together(lambda: whole.update(ModelPart.capture_write_parts(calls, tmp, plan.grid, coord, net.mesh.shard == 0)),
             "writing")
    copies: list = [None] * world.size
    with engine.naming_lost_ranks("capture: the whole tensors' gradients"):
        dist.all_gather_object(copies, whole)
    together(lambda: world.rank == 0 and _write_whole_grads(tmp, copies), "the whole tensors' gradients")
    together(lambda: world.rank == 0 and outputs.finish(tmp, path), "moving it into place", None)  # kept on failure
    return _opened(path)
