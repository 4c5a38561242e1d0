"""The GPU check: on a node with 1, 2, 4 or 8 GPUs, the CUDA path of both modes, tested and measured.

    python -m experiments.gpu_check            # every case the node's GPUs allow -> results/gpu_*.jsonl
    python -m experiments.gpu_check --quick    # the same with a short benchmark
    python -m experiments.gpu_check --dry      # on any machine: print and check the plan, run nothing

Every rank gets a GPU of its own (NCCL refuses two ranks on one GPU), so each case names how many GPUs
it needs; a case needing more than the node has is skipped by name (``"skipped"`` records), the rest run.

1. Equivalence on CUDA (float64, against one process on the same GPU; tolerance 1e-9):
   - ``driver/...``: ``World(workers=2, device="cuda")`` (2 GPUs) on CNN2D and a U-Net-like model with
     BatchNorm, host batches;
   - ``spmd/<ranks>/...``: 1, 2, 4 and 8 ranks (NCCL point-to-point halos, gradient sums on their own
     communicator), spatial grids and hybrid replicas.
   -> ``results/gpu_equivalence.jsonl``, one line per case, with ``ok``.
2. Benchmark (``bench/...``): each rank capped with ``set_per_process_memory_fraction`` to emulate a
   ``--card-gib`` card. The cap holds PyTorch's caching allocator only: the CUDA context, NCCL's buffers
   and library workspaces come on top, so a real card of that size holds less (each record says so, and
   carries NVML's per-process figure beside the allocator's). The largest CNN2D and UNet edge that trains
   on 1 rank and on 2/4/8 ranks (doubling, then bisection), the step time at that edge, memory (allocator
   peak and NVML) per rank, and on 4 ranks the fraction of halo time hidden behind compute,
   ``(t_blocking - t_overlap) / (t_blocking - t_compute)`` (``BIGCONV_P2P_BLOCKING=1`` waits for every
   exchange as soon as it is posted; ``t_compute`` is one rank on one shard's share of the image).
   -> ``results/gpu_bench.jsonl``.

Every probe runs in fresh processes with a timeout, so an out-of-memory probe or a hang costs its
timeout, never the run. Each record is written as soon as it is measured.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import time
import traceback
from dataclasses import dataclass, field

import torch

from bigconv.harness import cli

MiB = 2**20


def append(path: str, record: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")


# -- the plan: every case with the GPUs it needs ------------------------------------------------------
@dataclass(frozen=True)
class Case:
    name: str
    gpus: int
    """GPUs the case needs (one per rank or worker)."""
    kind: str
    """``driver``/``spmd`` (equivalence) or ``largest``/``overlap``/``driver_bench`` (benchmark)."""
    params: dict = field(default_factory=dict)


SPMD_CASES = {1: [("cnn2d", (1, 1), 1)],
              2: [("cnn2d", (2, 1), 1), ("unet_like-bn", (1, 2), 1)],
              4: [("cnn2d", (2, 2), 1), ("unet_like-bn", (2, 1), 2), ("cnn2d", (1, 2), 2)],
              8: [("cnn2d", (2, 2), 2), ("unet_like-bn", (4, 2), 1)]}
"""Equivalence cases per rank count: (model, grid, replicas)."""


def _x(grid) -> str:
    return "x".join(map(str, grid))


def plan(bench: bool = True) -> list[Case]:
    cases = [Case(f"driver/{name}/{_x(grid)}", 2, "driver", {"model": name, "grid": grid})
             for name, grid in (("cnn2d", (2, 1)), ("unet_like-bn", (1, 2)))]
    cases += [Case(f"spmd/{ranks}/{name}/{_x(grid)}/R{replicas}", ranks, "spmd",
                   {"ranks": ranks, "model": name, "grid": grid, "replicas": replicas})
              for ranks, runs in SPMD_CASES.items() for name, grid, replicas in runs]
    if bench:
        for model in ("cnn2d", "unet"):
            cases += [Case(f"bench/{model}/largest/{ranks}", ranks, "largest", {"model": model, "ranks": ranks})
                      for ranks in (1, 2, 4, 8)]
            cases += [Case(f"bench/{model}/overlap/4", 4, "overlap", {"model": model, "ranks": 4, "grid": (2, 2)}),
                      Case(f"bench/{model}/driver/4", 4, "driver_bench", {"model": model, "workers": 4,
                                                                          "grid": (2, 2)})]
    return cases


def schedule(cases: list[Case], gpus: int) -> tuple[list[Case], list[tuple[Case, str]]]:
    """(cases to run, (case, why skipped)) on a node with ``gpus`` GPUs."""
    run = [c for c in cases if c.gpus <= gpus]
    skipped = [(c, f"needs {c.gpus} GPUs, the node has {gpus}") for c in cases if c.gpus > gpus]
    return run, skipped


def check_plan(cases: list[Case]) -> list[str]:
    """What is wrong with a plan (empty: nothing): duplicate names, a layout that does not use exactly its
    GPUs, a model or batch that cannot be built."""
    problems = [f"duplicate case {n}" for n in {c.name for c in cases} if sum(c.name == n for c in cases) > 1]
    models = _cases()
    for c in cases:
        p = c.params
        if c.kind == "spmd" and math.prod(p["grid"]) * p["replicas"] != p["ranks"]:
            problems.append(f"{c.name}: grid {p['grid']} × replicas {p['replicas']} is not {p['ranks']} ranks")
        if c.kind == "driver" and math.prod(p["grid"]) != c.gpus:
            problems.append(f"{c.name}: grid {p['grid']} does not use its {c.gpus} workers")
        if c.kind in ("overlap", "driver_bench") and math.prod(p["grid"]) != c.gpus:
            problems.append(f"{c.name}: grid {p['grid']} does not use its {c.gpus} GPUs")
        if c.kind in ("largest", "overlap", "driver_bench"):
            problems += _bench_model_problem(c)
        if c.kind in ("driver", "spmd"):
            factory, shape, _ = models[p["model"]]
            if len(shape) - 2 != len(p["grid"]) or any(n < g for n, g in zip(shape[2:], p["grid"])):
                problems.append(f"{c.name}: input {shape} cannot be cut into grid {p['grid']}")
            if c.kind == "spmd" and shape[0] % p["replicas"]:
                problems.append(f"{c.name}: batch {shape[0]} does not split into {p['replicas']} replicas")
            with torch.device("meta"):
                factory()
    return problems


def _bench_model_problem(case: Case) -> list[str]:
    """A benchmark model that cannot be built here (a missing package) is named before anything runs:
    otherwise every probe fails alike and the largest-edge search reads the failures as out-of-memory."""
    from bigconv.harness.registry import spec

    try:
        with torch.device("meta"):
            spec(case.params["model"]).build(1, 2, 4, 3)
    except ImportError as exc:
        return [f"{case.name}: its model needs a package this Python lacks ({exc}); install it (pip install "
                f"'bigconv[monai]' for unet) or leave the case out with --cases"]
    return []


def select(cases: list[Case], patterns: list[str] | None) -> list[Case]:
    """The cases whose names match one of the shell-style ``patterns`` (all of them without patterns)."""
    if not patterns:
        return cases
    chosen = [c for c in cases if any(fnmatch.fnmatchcase(c.name, p) for p in patterns)]
    if not chosen:
        raise SystemExit(f"--cases {' '.join(patterns)} matches no case; --dry lists them")
    return chosen


def is_out_of_memory(error: str) -> bool:
    """Whether a probe's error is the allocator running out (the search's signal), not a broken run."""
    return "out of memory" in error.lower() or "OutOfMemoryError" in error


def dry(gpus_list: list[int], bench: bool, patterns: list[str] | None = None) -> int:
    """Print, for each GPU count, what would run and what would be skipped; check the plan."""
    cases = select(plan(bench), patterns)
    problems = check_plan(cases)
    for gpus in gpus_list:
        run, skipped = schedule(cases, gpus)
        print(json.dumps({"gpus": gpus, "run": [c.name for c in run],
                          "skipped": {c.name: why for c, why in skipped}}))
    for problem in problems:
        print(f"plan problem: {problem}")
    return 1 if problems else 0


# -- 1. equivalence ------------------------------------------------------------------------------------
def _cases():
    import torch.nn as nn

    from bigconv.models import CNN2D

    def unet_like():
        return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.ConvTranspose2d(8, 4, 2, stride=2),
                             nn.Conv2d(4, 3, 1))

    return {
        "cnn2d": (lambda: CNN2D(in_channels=1, num_classes=3), (4, 1, 37, 29), "class"),
        "unet_like-bn": (unet_like, (4, 1, 32, 24), "pixel"),
    }


def _compare(world, name: str, grid, replicas: int = 1, on_gpu: bool = True) -> dict:
    """The SPMD mode takes the model and batch on its GPU; the driver mode takes them on the host
    (its workers move their copies and shards to their GPUs)."""
    import torch.nn as nn

    from bigconv.verify import compare_training

    factory, shape, kind = _cases()[name]
    torch.manual_seed(0)
    dev = "cuda" if on_gpu else "cpu"
    model = factory().double().to(dev)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=g, dtype=torch.float64).to(dev)
    y = (torch.randint(0, 3, (shape[0],), generator=g) if kind == "class"
         else torch.randint(0, 3, (shape[0], *shape[2:]), generator=g)).to(dev)
    kw = {"replicas": replicas} if replicas > 1 else {}
    r = compare_training(model, world, x, y, nn.CrossEntropyLoss(), grid=grid, **kw)
    r.pop("net")
    r["ok"] = r["keys_match"] and r["replicas_equal"] and all(
        r[k] <= 1e-9 for k in ("forward", "input_grad", "param_grads", "loss", "weights"))
    return r


def spmd_equivalence_rank(cases: list) -> list:
    import bigconv

    out = []
    with bigconv.World.from_env(mode="spmd", device="cuda", timeout=120) as world:
        for name, grid, replicas in cases:
            try:
                out.append({"case": name, "grid": grid, "replicas": replicas, **_compare(world, name, grid, replicas)})
            except Exception as exc:
                out.append({"case": name, "grid": grid, "replicas": replicas, "ok": False,
                            "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
    return out


def equivalence(out: str, base: dict, cases: list[Case]) -> int:
    """The equivalence cases of ``cases`` (those the node can run)."""
    import bigconv
    from bigconv.runtime import spmd_launch as launch

    failures = 0

    def record(r):
        nonlocal failures
        failures += not r.get("ok")
        append(out, {**base, **{k: v for k, v in r.items() if k != "traceback"}})
        print(f"{r['mode']:6} {r['case']:14} grid={r['grid']} R={r.get('replicas', 1)}: "
              f"{'ok' if r.get('ok') else 'FAILED ' + str(r.get('error', r))}", flush=True)

    driver = [c for c in cases if c.kind == "driver"]
    if driver:
        try:
            with bigconv.World(workers=2, device="cuda", timeout=120) as world:
                for c in driver:
                    name, grid = c.params["model"], c.params["grid"]
                    try:
                        record({"mode": "driver", "case": name, "grid": grid,
                                **_compare(world, name, grid, on_gpu=False)})
                    except Exception as exc:
                        record({"mode": "driver", "case": name, "grid": grid, "ok": False, "error": f"{exc}"})
        except Exception as exc:
            record({"mode": "driver", "case": "world", "grid": None, "ok": False, "error": f"{exc}"})
    for ranks in sorted({c.params["ranks"] for c in cases if c.kind == "spmd"}):
        runs = [(c.params["model"], c.params["grid"], c.params["replicas"])
                for c in cases if c.kind == "spmd" and c.params["ranks"] == ranks]
        try:
            for r in launch.run(spmd_equivalence_rank, ranks, (runs,), timeout=600)[0]:
                record({"mode": "spmd", "ranks": ranks, **r})
        except Exception as exc:
            record({"mode": "spmd", "ranks": ranks, "case": "launch", "grid": None, "ok": False, "error": f"{exc}"})
    return failures


# -- 2. benchmark ------------------------------------------------------------------------------------------
def _probe(model: str, size: int, ranks: int, fraction: float, blocking: bool = False, steps: int = 3,
           grid=None) -> dict | None:
    from bigconv.harness.spmd_workload import train_spmd
    from bigconv.harness.workload import Workload

    depth = 3
    w = Workload(model=model, size=size, steps=steps, depth=depth)
    env_before = os.environ.get("BIGCONV_P2P_BLOCKING")
    os.environ["BIGCONV_P2P_BLOCKING"] = "1" if blocking else "0"
    try:
        return train_spmd(w, ranks, grid=grid, device="cuda", memory_fraction=fraction, timeout=300, record=True)
    except Exception as exc:
        return {"error": str(exc)[:2000]}
    finally:
        if env_before is None:
            os.environ.pop("BIGCONV_P2P_BLOCKING", None)
        else:
            os.environ["BIGCONV_P2P_BLOCKING"] = env_before


def largest(model: str, ranks: int, fraction: float, start: int, multiple: int, out: str, base: dict,
            max_probes: int) -> tuple[int, dict | None, str | None]:
    """Largest edge (a multiple of ``multiple``) that trains: doubling from ``start``, then bisection.
    Returns (edge, the record at that edge, None) or, when a probe fails for another reason than memory
    (an import, a timeout, a bug), (edge so far, its record, that error): the search stops there."""
    good, bad, best = 0, None, None
    size = start
    for _ in range(max_probes):
        r = _probe(model, size, ranks, fraction, steps=1)
        ok = r is not None and "error" not in r
        append(out, {**base, "kind": "probe", "model": model, "ranks": ranks, "size": size, "ok": ok,
                     "error": None if ok else r.get("error", "")[:500],
                     "step_s": r.get("step_s") if ok else None})
        print(f"  {model} ranks={ranks} edge={size}: {'fits' if ok else 'fails'}", flush=True)
        if not ok and not is_out_of_memory(r.get("error", "")):
            return good, best, r.get("error", "")
        if ok:
            good, best = size, r
        else:
            bad = size
        if bad is None:
            size *= 2
        else:
            nxt = (good + bad) // 2 // multiple * multiple
            if nxt <= good or bad - good <= max(multiple, good // 32):
                break
            size = nxt
    return good, best, None


def _memory(r: dict | None) -> dict:
    """Per-rank memory beside the times: the allocator's peak and NVML's per-process peak."""
    if not r or "per_rank" not in r:
        return {}
    return {"cuda_max_allocated_bytes": [p.get("cuda_max_allocated_bytes") for p in r["per_rank"]],
            "cuda_max_reserved_bytes": [p.get("cuda_max_reserved_bytes") for p in r["per_rank"]],
            "nvml_peak_used_bytes": [p.get("nvml_peak_used_bytes") for p in r["per_rank"]],
            "memory_missing": [p.get("missing") for p in r["per_rank"]]}


def bench(out: str, base: dict, card_gib: float, quick: bool, cases: list[Case]) -> int:
    """Runs the benchmark cases; returns how many broke (for a reason other than running out of memory)."""
    from bigconv.harness.spmd_workload import memory_cap_note

    total = torch.cuda.get_device_properties(0).total_memory
    fraction = min(1.0, card_gib * 2**30 / total)
    base = {**base, "card_gib": card_gib, "memory_cap": memory_cap_note(fraction)}
    print(f"GPU {torch.cuda.get_device_name(0)}: {total / 2**30:.0f} GiB; cap per process {fraction:.3f} "
          f"(~{card_gib:g} GiB of allocator memory; the CUDA context and NCCL's buffers come on top)", flush=True)
    multiple = 8
    found: dict[tuple[str, int], int] = {}
    errors = 0
    for c in cases:
        model = c.params["model"]
        if c.kind == "largest":
            ranks = c.params["ranks"]
            edge, rec, error = largest(model, ranks, fraction, 2048, multiple, out, base,
                                       max_probes=4 if quick else 9)
            found[model, ranks] = edge
            append(out, {**base, "kind": "largest", "case": c.name, "model": model, "ranks": ranks, "edge": edge,
                         "step_s": rec["step_s"] if rec else None, **_memory(rec),
                         **({"error": error[:2000]} if error else {})})
            if error:
                errors += 1
                print(f"{c.name}: FAILED (not out of memory), the search stopped: {error[:500]}", flush=True)
            else:
                print(f"{c.name}: largest edge on {ranks} rank(s) capped at {card_gib:g} GiB each: {edge}",
                      flush=True)
            continue
        edge = found.get((model, 4), 0) // 2 // multiple * multiple or 1024  # a size both modes comfortably train
        if c.kind == "overlap":
            overlap = _probe(model, edge, 4, fraction, grid=c.params["grid"])
            blocking = _probe(model, edge, 4, fraction, blocking=True, grid=c.params["grid"])
            compute = _probe(model, edge // 2, 1, fraction)  # one shard's share, no halos
            rec = {**base, "kind": "overlap", "case": c.name, "model": model, "edge": edge, "ranks": 4}
            if all(r and "error" not in r for r in (overlap, blocking, compute)):
                t_o, t_b, t_c = overlap["step_s"], blocking["step_s"], compute["step_s"]
                hidden = (t_b - t_o) / (t_b - t_c) if t_b > t_c else None
                rec.update(step_overlap_s=t_o, step_blocking_s=t_b, step_compute_only_s=t_c, hidden_fraction=hidden,
                           halo_wait_s=[p["stats"]["wait_s"] for p in overlap["per_rank"]], **_memory(overlap))
                print(f"{model} {edge}²: step {t_o:.3f}s (blocking {t_b:.3f}s, compute only {t_c:.3f}s): "
                      f"{'n/a' if hidden is None else f'{hidden:.0%}'} of halo time hidden", flush=True)
            else:
                rec["error"] = [r.get("error") if r else None for r in (overlap, blocking, compute)]
                errors += 1
                print(f"{c.name}: FAILED {rec['error']}", flush=True)
            append(out, rec)
        elif c.kind == "driver_bench":
            try:  # the driver mode at the same edge, side by side
                import bigconv
                from bigconv.harness.workload import Workload, train_distributed

                with bigconv.World(workers=c.params["workers"], device="cuda", timeout=300) as world:
                    r = train_distributed(Workload(model=model, size=edge, steps=3), world, grid=c.params["grid"],
                                          record=True)
                append(out, {**base, "kind": "driver_mode", "case": c.name, "model": model, "edge": edge,
                             "workers": c.params["workers"], "step_s": r["step_s"],
                             **{k: r[k] for k in ("per_worker", "memory") if k in r}})
                print(f"{model} {edge}² driver mode, 4 workers: step {r['step_s']:.3f}s", flush=True)
            except Exception as exc:
                append(out, {**base, "kind": "driver_mode", "case": c.name, "model": model, "edge": edge,
                             "error": str(exc)[:2000]})
                errors += 1
                print(f"driver mode at {edge}²: FAILED {exc}", flush=True)
    return errors


def main(argv=None) -> None:
    parser = cli.parser("experiments.gpu_check", __doc__)
    parser.add_argument("--quick", action="store_true",
                        help="a short benchmark: at most 4 probes per largest-edge search instead of 9")
    parser.add_argument("--card-gib", type=float, default=16.0,
                        help="the card each rank emulates, in GiB of PyTorch allocator memory "
                             "(set_per_process_memory_fraction; the CUDA context and NCCL's buffers come on top)")
    parser.add_argument("--skip-bench", action="store_true", help="the equivalence cases only")
    parser.add_argument("--out-dir", default="results", help="where gpu_equivalence.jsonl and gpu_bench.jsonl go")
    parser.add_argument("--dry", action="store_true",
                        help="run nothing: print, for each GPU count of --gpus, the cases that would run and those "
                             "skipped (by name), check the plan, and exit non-zero if it is wrong; needs no GPU")
    parser.add_argument("--cases", nargs="+", default=None, metavar="PATTERN",
                        help="only the cases whose names match one of these shell-style patterns, e.g. "
                             "'bench/unet/*' 'spmd/2/*' (default: every case; --dry lists the names)")
    parser.add_argument("--gpus", type=int, nargs="+", default=None,
                        help="the GPU counts to plan for with --dry (default: 1 2 4 8); without --dry the node's")
    args = parser.parse_args(argv)
    if args.dry:
        raise SystemExit(dry(args.gpus or [1, 2, 4, 8], not args.skip_bench, args.cases))
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check needs a CUDA GPU; on CPU the same paths run in the test suite (gloo), "
                         "and --dry prints the plan")
    from bigconv.harness.workload import environment

    gpus = torch.cuda.device_count()
    run, skipped = schedule(select(plan(not args.skip_bench), args.cases), gpus)
    problems = check_plan(run)
    if problems:  # before any process starts: a missing package must not read as out-of-memory probes
        raise SystemExit("gpu_check cannot run its plan:\n" + "\n".join(problems))
    base = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "env": environment(), "gpus": gpus}
    eq_out, bench_out = (os.path.join(args.out_dir, f"gpu_{n}.jsonl") for n in ("equivalence", "bench"))
    for c, why in skipped:
        append(eq_out if c.kind in ("driver", "spmd") else bench_out, {**base, "case": c.name, "skipped": why})
        print(f"skipped {c.name}: {why}", flush=True)
    failures = equivalence(eq_out, {**base, "bench": "gpu_equivalence"},
                           [c for c in run if c.kind in ("driver", "spmd")])
    print(f"equivalence: {failures} failure(s)", flush=True)
    bench_cases = [c for c in run if c.kind not in ("driver", "spmd")]
    errors = bench(bench_out, {**base, "bench": "gpu"}, args.card_gib, args.quick, bench_cases) if bench_cases else 0
    print(f"benchmark: {errors} case(s) broke", flush=True)
    raise SystemExit(1 if failures or errors else 0)


if __name__ == "__main__":
    main()
