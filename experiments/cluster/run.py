"""One configuration on a world started by a cluster launcher; every rank runs this module.

    torchrun --standalone --nproc-per-node 5 -m experiments.cluster.run --model cnn2d --size 4096 --out R.jsonl
    srun -n 5 python -m experiments.cluster.run ...      # SLURM
    jsrun -n 5 -a 1 -g 1 python -m experiments.cluster.run ...   # LSF (Summit style)
    python -m experiments.cluster.run --plain ...         # the plain single-process baseline, one process

``World.from_env()`` reads the launcher's variables: rank 0 drives, every other rank is a worker
that serves inside ``from_env`` and exits when the driver is done, so N+1 processes give N workers.
Rank 0 appends one record (``bigconv.harness.runner``'s format, plus the launcher) to ``--out``,
unless that configuration is already recorded. Launch once per configuration: fresh processes
each time, as on a laptop.
"""

from __future__ import annotations

import sys
from dataclasses import asdict

from bigconv.harness import records, registry
from bigconv.harness.runner import RunConfig
from experiments.runs import run_here
from experiments.sweep import parse_amount, summary
from bigconv.harness import cli


def main(argv=None) -> None:
    parser = cli.parser("experiments.cluster.run", __doc__)
    parser.add_argument("--model", default="cnn2d", choices=sorted(registry.MODELS), help="a benchmark model")
    parser.add_argument("--size", type=parse_amount, required=True, help="input edge (1D: length, e.g. 8M)")
    parser.add_argument("--out", required=True, help="results file (JSON lines, appended by rank 0)")
    parser.add_argument("--plain", action="store_true", help="plain single process, no RPC (launch 1 process)")
    parser.add_argument("--batch", type=int, default=1, help="images per step")
    parser.add_argument("--width", type=int, default=16, help="conv channels")
    parser.add_argument("--depth", type=int, default=3, help="conv blocks")
    parser.add_argument("--steps", type=int, default=1, help="measured training steps")
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"], help="where each worker runs")
    parser.add_argument("--budget", type=parse_amount, default=None, help="per-process cap, e.g. 16GiB")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds any wait of a step may take")
    args = parser.parse_args(argv)
    common = dict(model=args.model, size=registry.spec(args.model).round_size(args.size, args.depth),
                  batch=args.batch, width=args.width, depth=args.depth, steps=args.steps, device=args.device,
                  budget_bytes=args.budget, timeout_s=args.timeout)
    if args.plain:
        cfg, world, launcher = RunConfig(workers=0, **common), None, "none"
    else:
        import bigconv
        from bigconv.runtime import launch_env

        launcher = launch_env.detect().launcher
        world = bigconv.World.from_env(device=args.device, timeout=args.timeout)  # workers serve, then exit
        cfg = RunConfig(workers=world.workers, **common)
    if records.config_key(asdict(cfg)) in records.recorded_keys(args.out):
        print(f"already recorded in {args.out}: {cfg}")
        if world is not None:
            world.close()
        return
    if world is None:
        rec = run_here(cfg)
    else:
        with world:
            rec = run_here(cfg, world)
    rec["launcher"] = launcher
    records.append(args.out, rec)
    print(f"{args.model} {cfg.size}, {cfg.workers or 'single process'}: {summary(rec)} -> {args.out}", flush=True)
    sys.exit(0 if rec["status"] in ("ok", "oom") else 1)


if __name__ == "__main__":
    main()
