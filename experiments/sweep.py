"""Memory and utilization against input size: each configuration in fresh processes, one JSON line each.

    python -m experiments.sweep --model cnn2d --sizes 512,1024 --workers 1,2,4 --out results/NAME.jsonl
    python -m experiments.sweep --preset fig3_cnn2d --quick        # -> results/fig3_cnn2d_quick.jsonl
    python -m experiments.sweep --preset fig3_cnn2d --quick --mode spmd   # -> results/fig3_cnn2d_spmd_quick.jsonl

- The plain single-process run (``workers`` 0, no RPC) is always included, like the study's blue curves.
- ``--mode spmd`` runs each worker count as that many SPMD ranks (``bigconv.spmd``: no driver, halos
  by point-to-point), ``--replicas R`` as R data-parallel replicas of workers/R shards.
- Each configuration appends one record (``bigconv.harness.records``) with status ``ok``, ``oom`` or
  ``error`` and a message. After an ``oom``, larger sizes of the same worker count are skipped
  (``--keep-going`` runs them anyway) and the sweep goes on.
- A rerun skips every configuration already recorded (``--retry-errors`` reruns ``error`` ones),
  so an interrupted sweep resumes where it stopped.
- Sizes accept suffixes: ``4M`` (2**20), ``2K`` (2**10); budgets ``16GiB``, ``512MiB``.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import time
from dataclasses import asdict

from bigconv import progress
from bigconv.harness import records, registry
from bigconv.harness.runner import RunConfig
from experiments.runs import run_fresh
from experiments import presets
from bigconv.harness import cli

log = logging.getLogger(__name__)

MiB = 2**20
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_amount(text: str) -> int:
    """``4M`` -> 4194304, ``16GiB`` -> 17179869184, ``512`` -> 512."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as an amount (examples: 512, 4M, 16GiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def int_list(text: str) -> list[int]:
    return [parse_amount(t) for t in text.split(",") if t.strip()]


def plan(model: str, sizes: list[int], workers: list[int], *, plain: bool = True, targets: list[int] | None = None,
         mode: str | None = None, replicas: int | None = None, **common) -> list[RunConfig]:
    """Every configuration, smallest size first; the plain run first at each size.

    DSN: ``targets`` (e.g. 1, 4, 7) replaces ``workers``: the plain run is the single-process 1S1T
    DSN, and each K runs domain-parallel on the workers its placement needs.
    """
    if model == "dsn":
        from multidsn.placement import workers_needed

        runs = ([(0, 1)] if plain else []) + [(workers_needed(k, "domain"), k) for k in sorted(set(targets or [1]))]
        return [RunConfig(model=model, size=s, workers=n, targets=k, **common) for s in sorted(sizes)
                for n, k in runs]
    counts = ([0] if plain else []) + sorted(set(workers) - {0})
    # The plain run is the same baseline for both modes (and keeps its record key).
    return [RunConfig(model=model, size=s, workers=n, **common, **({"mode": mode, "replicas": replicas} if n else {}))
            for s in sorted(sizes) for n in counts]


def label(cfg: RunConfig) -> str:
    dims = registry.spec(cfg.model).dims
    who = "single process" if cfg.workers == 0 else f"{cfg.workers} worker{'s' * (cfg.workers > 1)}"
    if cfg.mode == "spmd":
        who = f"{cfg.workers} SPMD rank{'s' * (cfg.workers > 1)}" + (f" ({cfg.replicas} replicas)" if cfg.replicas
                                                                     else "")
    if cfg.targets is not None:
        placement = f" ({cfg.placement} placement)" if cfg.placement else ""
        who = f"1 source + {cfg.targets} target{'s' * (cfg.targets > 1)}, {who}{placement}"
    return f"{cfg.model} {cfg.size}{'^' + str(dims) if dims > 1 else ''} batch {cfg.batch}, {who}"


def summary(rec: dict) -> str:
    if rec["status"] != "ok":
        return f"{rec['status'].upper()}: {(rec.get('message') or '')[:160]}"
    util = rec.get("util_mean_percent")
    return (f"ok, peak/worker {rec['peak_bytes_max'] / MiB:.1f} MiB, util {util:.0f}%" if util is not None else
            f"ok, peak/worker {rec['peak_bytes_max'] / MiB:.1f} MiB") + f", step {rec['step_s']:.2f}s"


def run_sweep(configs: list[RunConfig], out: str, *, retry_errors: bool = False, keep_going: bool = False,
              runner=run_fresh, echo=print, progress=None) -> list[dict]:
    """Run the configurations not yet in ``out``; the records written by this call.

    ``progress``: a tqdm bar (or None) advanced per configuration, showing the current one.
    """
    done = records.recorded_keys(out)
    oom_at: dict[tuple, int] = {}  # (model, workers, mode) -> smallest size that ran out of memory
    for rec in done.values():
        if rec["status"] == "oom":
            key = _oom_key(RunConfig.from_dict(rec["config"]))
            oom_at[key] = min(oom_at.get(key, rec["config"]["size"]), rec["config"]["size"])
    written, t0 = [], time.monotonic()
    for i, cfg in enumerate(configs, 1):
        head = f"[{i}/{len(configs)}] {label(cfg)}"
        if progress is not None:
            progress.set_postfix_str(label(cfg), refresh=True)
        _run_one(cfg, head, out, done, oom_at, written, t0, retry_errors, keep_going, runner, echo)
        if progress is not None:
            progress.update(1)
    return written


def _oom_key(cfg: RunConfig) -> tuple:
    return cfg.model, cfg.workers, cfg.mode, cfg.replicas


def _run_one(cfg, head, out, done, oom_at, written, t0, retry_errors, keep_going, runner, echo) -> None:
    key = records.config_key(asdict(cfg))
    prev = done.get(key)
    if prev is not None and not (retry_errors and prev["status"] == "error"):
        echo(f"{head}: already recorded ({prev['status']})")
        return
    if not keep_going and oom_at.get(_oom_key(cfg), float("inf")) < cfg.size:
        echo(f"{head}: skipped, size {oom_at[_oom_key(cfg)]} already ran out of memory")
        return
    echo(f"{head} ...")
    rec = runner(cfg)
    records.append(out, rec)
    written.append(rec)
    done[key] = rec
    if rec["status"] == "oom":
        oom_at[_oom_key(cfg)] = min(oom_at.get(_oom_key(cfg), cfg.size), cfg.size)
    line = f"{head}: {summary(rec)} ({rec.get('run_s', 0):.0f}s; {time.monotonic() - t0:.0f}s so far)"
    if rec["status"] == "error":
        log.warning(line)
    echo(line)


def main(argv=None) -> None:
    parser = cli.parser("experiments.sweep", __doc__)
    parser.add_argument("--preset", choices=sorted(presets.PRESETS), help="a study figure's configurations")
    parser.add_argument("--quick", action="store_true", help="the preset's 2-core CPU scale")
    parser.add_argument("--model", choices=sorted(registry.MODELS), help="a benchmark model (instead of --preset)")
    parser.add_argument("--sizes", type=int_list, help="input edges, e.g. 512,1K,2K (1D: lengths, e.g. 1M,4M)")
    parser.add_argument("--workers", type=int_list, help="worker counts, e.g. 1,2,4,8 (plain run always added)")
    parser.add_argument("--targets", type=int_list, default=None,
                        help="dsn: target domains per run, e.g. 1,4,7 (workers follow from the placement)")
    parser.add_argument("--mode", choices=["driver", "spmd"], default="driver",
                        help="how the worker counts run: a driver and RPC workers, or SPMD ranks (bigconv.spmd)")
    parser.add_argument("--replicas", type=int, default=None,
                        help="spmd: data-parallel replicas; each worker count must be a multiple (batch >= replicas)")
    parser.add_argument("--out", help="results file (default results/<preset>[_spmd][_quick].jsonl)")
    parser.add_argument("--batch", type=int, default=None, help="images per step (default: the preset's, else 1)")
    parser.add_argument("--width", type=int, default=None, help="conv channels (default 16; dsn 8)")
    parser.add_argument("--depth", type=int, default=3, help="conv blocks")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"], help="parameter and input dtype")
    parser.add_argument("--steps", type=int, default=1, help="measured steps after one unmeasured step")
    parser.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda if available")
    parser.add_argument("--budget", type=parse_amount, default=None,
                        help="enforced per-process memory cap, e.g. 16GiB (GPU: memory fraction; CPU: RLIMIT_DATA)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration")
    parser.add_argument("--no-plain", action="store_true", help="leave out the plain single-process baseline")
    parser.add_argument("--no-record", action="store_true", help="recorder off (memory peaks only)")
    parser.add_argument("--retry-errors", action="store_true", help="rerun configurations recorded as error")
    parser.add_argument("--keep-going", action="store_true", help="run larger sizes after an oom too")
    progress.add_arguments(parser)
    args = parser.parse_args(argv)
    progress.setup(args)
    if args.preset:
        p = presets.preset(args.preset)
        scale = p.scale(args.quick)
        model, sizes, workers = p.model, args.sizes or scale.sizes, args.workers or scale.workers
        targets = args.targets or p.extra.get("targets")
        batch, device = args.batch or scale.batch, args.device or scale.device
        out = args.out or f"results/{p.name}{'_spmd' if args.mode == 'spmd' else ''}{'_quick' if args.quick else ''}.jsonl"
    else:
        if not (args.model and args.sizes and (args.workers or args.model == "dsn") and args.out):
            parser.error("give --preset, or all of --model, --sizes, --workers (dsn: --targets) and --out")
        model, sizes, workers, batch, out = args.model, args.sizes, args.workers or [], args.batch or 1, args.out
        targets = args.targets
        import torch

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    spec = registry.spec(model)
    if args.mode == "spmd" and model == "dsn":
        parser.error("--mode spmd runs the bigconv models; the DSN's domain parallelism has its own (driver) mode")
    if args.replicas and args.mode != "spmd":
        parser.error("--replicas is for --mode spmd")
    sizes = sorted({spec.round_size(s, args.depth) for s in sizes})
    configs = plan(model, sizes, workers, plain=not args.no_plain, targets=targets, batch=batch,
                   width=args.width or (8 if model == "dsn" else 16), depth=args.depth,
                   dtype=args.dtype, steps=args.steps, device=device, budget_bytes=args.budget,
                   record=not args.no_record, timeout_s=args.timeout,
                   mode="spmd" if args.mode == "spmd" else None, replicas=args.replicas)
    log.info("%d configurations -> %s", len(configs), out)
    with progress.bars_and_logs(), progress.bar(len(configs), "sweep", args, unit="config") as pb:
        written = run_sweep(configs, out, retry_errors=args.retry_errors, keep_going=args.keep_going,
                            echo=log.debug if pb.disable is False else log.info, progress=pb)
    bad = [r for r in written if r["status"] == "error"]
    print(f"done: {len(written)} new records ({len(bad)} errors) in {out}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
