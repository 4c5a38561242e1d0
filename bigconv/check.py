"""``python -m bigconv.check MODEL --input 1x3x4096x4096 --workers 4``: will my model work, and what will it cost?

Before booking a cluster, on any laptop: whether the model decomposes (the dry run the front ends run
before any remote work, on meta tensors: no memory), and if not, the module, the op and the fix; per
windowed layer, the shard size, halo width, whether the map is split or replicated and the receptive
field against the shard; an estimated per-process peak memory on N processes against one process
(two measured small plain runs, scaled: see ``bigconv.harness.inspection``); and an exactness check
on a small input (forward, input and parameter gradients, weights after a step, against one process
in float64). ``--json`` prints one JSON object for scripts. Exit status: 0 when the model decomposes
(and, where checked, trains exactly), 1 otherwise.

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
import os
import sys

import torch

from .geometry.boxes import check_positive_int, choose_grid, validate_grid
from .harness import devices
from .harness.inspection import as_dict, estimate_memory, layer_report
from .harness.model_spec import FORMS, build_model

MiB = 2 ** 20


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(v) for v in text.lower().split("x"))
    except ValueError:
        shape = ()
    if len(shape) < 3 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a shape like 1x3x4096x4096 (batch x channels x spatial)")
    return shape


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bigconv.check",
        description="Will this model train with bigconv on this input, and what will each process need? "
                    "Runs the dry run (no memory), reports every windowed layer's shard and halo, estimates "
                    "the per-process peak from two small measured runs, and checks exactness on a small input.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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
    p.add_argument("--exact-workers", type=int, default=None,
                   help="local workers of the exactness check (default: --workers, at most 4)")
    g = p.add_argument_group("cluster planning (with --gpus; docs/check.md#planning-a-cluster)")
    g.add_argument("--gpus", type=int, default=None,
                   help="plan for this many GPUs, one process each, instead of checking on local workers")
    g.add_argument("--gpu", default=None,
                   help=f"the GPU: {', '.join(devices.GPUS)}; NAME:key=value,... overrides figures "
                        "(h100-80gb:memory_gib=64), a JSON file gives your own")
    g.add_argument("--link", default=None, help=f"link between the GPUs of a node: {', '.join(devices.LINKS)} "
                                                 "(default: the GPU's usual one)")
    g.add_argument("--nodes", type=int, default=None,
                   help="nodes the GPUs sit on (default: as many as the GPU's usual node size needs)")
    g.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (default: the GPU's usual node)")
    g.add_argument("--inter", default=None, help="link between nodes (default: the GPU's usual one)")
    g.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"],
                   help="the model's and the activations' dtype")
    g.add_argument("--amp", default=None, choices=["bfloat16", "float16"],
                   help="autocast dtype: activations and convolutions in it, parameters in --dtype")
    g.add_argument("--optimizer", default="momentum", choices=["sgd", "momentum", "adam", "adamw"],
                   help="what the optimizer keeps per parameter")
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


def exactness(spec: str, shape: tuple[int, ...], workers: int) -> dict:
    """``compare_training`` on a small float64 input: one process against ``workers`` local ones.

    The model is built as the user has it (training mode: dropout and stochastic depth on); both sides
    draw the same masks (``bigconv.ops.random``). Where the verdict is ``ill-conditioned at this size``,
    ``rerun_at`` is an input shape at which one process's run is well conditioned (or None)."""
    from .engine.dry_run import copy_model
    from .runtime.world import World
    from .verify import compare_training, conditioned_size

    torch.manual_seed(0)
    model = build_model(spec).double()
    x = torch.randn(*shape, dtype=torch.float64)

    def target(inp: torch.Tensor) -> torch.Tensor:  # MSE against a random target of the output's shape
        with torch.no_grad():
            return torch.randn_like(copy_model(model).eval()(inp))

    y = target(x)
    grid = choose_grid(shape[2:], workers)
    untouched = copy_model(model)  # compare_training hands ``model`` to the workers
    with World(workers=workers) as world:
        r = compare_training(model, world, x, y, torch.nn.MSELoss(), grid=grid, steps=1)
    rerun = conditioned_size(untouched, x, target, torch.nn.MSELoss(), steps=1) \
        if r["verdict"] == "ill-conditioned at this size" else None
    keys = ("forward", "input_grad", "param_grads", "loss", "weights")
    return {"input": list(shape), "dtype": "float64", "workers": workers, "grid": list(grid), "exact": r["exact"],
            "verdict": r["verdict"], "relative_errors": {k: r[k] for k in keys}, "worst": {k: r["worst"][k] for k in keys},
            "ill_conditioned": [{k: t[k] for k in ("category", "tensor", "error", "scale", "noise")}
                                for t in r["ill_conditioned"]],
            "wrong": [{k: t[k] for k in ("category", "tensor", "error", "scale", "noise", "status")}
                      for t in r["wrong"]],
            "residues": len(r["residues"]), "rerun_at": list(rerun) if rerun else None, "tolerance": r.get("tol")}


def check(args) -> dict:
    shape = args.input
    dims = len(shape) - 2
    check_positive_int(args.workers, "--workers")
    grid = validate_grid(args.grid, args.workers) if args.grid else choose_grid(shape[2:], args.workers)
    if len(grid) != dims:
        raise ValueError(f"--grid {grid} has {len(grid)} entries but the input has {dims} spatial dims")
    result = {"model": args.model, "input": list(shape), "workers": args.workers, "grid": list(grid)}
    model = build_model(args.model)
    try:
        rows, error = layer_report(model, shape, grid)
    except ValueError as exc:
        rows, error = [], exc
    result["decomposable"] = error is None
    result["refusal"] = None if error is None else {"error": type(error).__name__, "message": str(error)}
    result["layers"] = [as_dict(r) for r in rows]
    result["memory"] = None
    if not (args.no_memory or error):
        try:
            result["memory"] = as_dict(estimate_memory(args.model, shape, args.workers, args.memory_edges))
        except RuntimeError as exc:  # a small run the model cannot take (BatchNorm on 1x1 maps of one image)
            result["memory"] = {"error": f"{exc}; try larger --memory-edges"}
    if args.no_exact or error:
        result["exactness"] = None
    else:
        small = (2, shape[1], *[args.exact_size] * dims)  # batch 2: BatchNorm needs two values per channel
        result["exactness"] = exactness(args.model, small, args.exact_workers or min(args.workers, 4))
    return result


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
    m = r["memory"]
    if m and "error" in m:
        lines += ["", f"Memory: not estimated: {m['error'][-600:]}"]
    elif m:
        lines += ["", f"Memory, estimated ({m['method']}):",
                  f"  one process: {_mib(m['single_bytes'])}; each of {r['workers']} processes: "
                  f"{_mib(m['per_process_bytes'])} (single / {r['workers']}: {_mib(m['ideal_per_process_bytes'])})"]
    e = r["exactness"]
    if e:
        errs = ", ".join(f"{k} {v:.1e}" for k, v in e["relative_errors"].items())
        lines += ["", f"Exactness on {_x(e['input'])} float64, {e['workers']} workers, grid {_x(e['grid'])}: "
                  f"{e['verdict'].upper()} (worst relative errors: {errs}; {e['residues']} residues, tensors "
                  "that are zero in exact arithmetic, within 10x their rounding noise)"]
        for t in e["wrong"][:10]:
            lines.append(f"  {t['status']}: {t['category']} {t['tensor']}: error {t['error']:.1e}, size "
                         f"{t['scale']:.1e}, rounding noise {t['noise']:.1e}")
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
    if args.gpu is None:
        raise ValueError(f"--gpus needs --gpu: one of {', '.join(devices.GPUS)}, NAME:key=value,... or a JSON file")
    if args.grid and len(args.grid) != len(args.input) - 2:
        raise ValueError(f"--grid {args.grid} has {len(args.grid)} entries but the input has "
                         f"{len(args.input) - 2} spatial dims")
    model = build_model(args.model)
    r = plan_report.plan(args, model)
    print(json.dumps(r, indent=1) if args.json else plan_report.report(r, layers=args.layers))
    return 0 if r["decomposable"] and r["plan"]["fits"] else 1


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
    ok = r["decomposable"] and (r["exactness"] is None or r["exactness"]["exact"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
