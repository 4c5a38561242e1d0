"""The study's Figure 7 for DSN, both halves: peak memory per worker against image size, and the largest
image that trains within a per-worker budget, for 1 source + 1 target (1S1T) in one process and for 1S1T,
1S4T and 1S7T distributed, in each placement.

    python -m experiments.fig7 --quick     # 2-core CPU scale -> results/fig7_dsn_quick{,_maxsize}.jsonl
    python -m experiments.fig7             # the study's scale (GPUs; 16 GiB budget)

Placements (``multidsn.placement``): ``domain`` puts one domain (its private encoder, a shared-encoder
replica and a decoder replica) on each worker, K + 2 workers; ``encoder`` is the ORNL Multi-DSN layout, every
shared-encoder replica and every private encoder (with a decoder replica) on a worker of its own, 2K + 3
workers. The targets: the distributed per-worker peak stays within 10% from K = 1 to 7, and the largest
image is at least 2x the single-process 1S1T one in area. Both tables are printed at the end.

Every configuration is one run in fresh processes (``experiments.runs``), appended as it ends, so an
interrupted study resumes where it stopped.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from bigconv import progress
from bigconv.harness import records
from bigconv.harness.runner import RunConfig
from experiments import presets
from experiments.maxsize import search
from experiments.sweep import int_list, parse_amount, plan, run_sweep
from multidsn.placement import workers_needed
from bigconv.harness import cli

log = logging.getLogger(__name__)

MiB = 2**20
PLACEMENTS = ("domain", "encoder")


def case_label(cfg: RunConfig) -> str:
    if cfg.workers == 0:
        return "1S1T single process"
    return f"1S{cfg.targets}T {cfg.placement or 'domain'} placement, {cfg.workers} workers"


def distributed(base: RunConfig, targets: list[int], placements: list[str]) -> list[RunConfig]:
    """One configuration per (placement, K). ``placement`` stays None for ``domain``, so these runs share
    their identity with ``sweep --preset fig7_dsn`` records and are not run twice."""
    return [replace(base, workers=workers_needed(k, p), targets=k, placement=None if p == "domain" else p)
            for p in placements for k in sorted(set(targets))]


def sweep_configs(sizes: list[int], targets: list[int], placements: list[str], **common) -> list[RunConfig]:
    configs = plan("dsn", sizes, [], plain=True, targets=[1], **common)
    singles = [c for c in configs if c.workers == 0]
    return [c for s in singles for c in [s] + distributed(s, targets, placements)]


def spread_table(recs: list[dict]) -> list[str]:
    """Per-worker peak by size and case; the spread over K per placement (target: within 10%)."""
    ok = [r for r in recs if r.get("kind") == "run" and r["status"] == "ok" and r.get("purpose") != "maxsize"]
    rows = ["| size | placement | 1S1T single | 1S1T | 1S4T | 1S7T | spread over K |", "|---|---|---|---|---|---|---|"]
    for size in sorted({r["size"] for r in ok}):
        at = [r for r in ok if r["size"] == size]
        single = next((r["peak_bytes_max"] for r in at if r["workers"] == 0), None)
        for p in PLACEMENTS:
            peaks = {r["config"]["targets"]: r["peak_bytes_max"] for r in at
                     if r["workers"] and (r["config"].get("placement") or "domain") == p}
            if not peaks:
                continue
            cells = [f"{peaks[k] / MiB:.1f}" if k in peaks else "" for k in (1, 4, 7)]
            spread = max(peaks.values()) / min(peaks.values()) - 1
            rows.append(f"| {size}² | {p} | {'' if single is None else f'{single / MiB:.1f}'} | "
                        + " | ".join(cells) + f" | {100 * spread:.1f}% |")
    return rows


def maxsize_table(results: list[dict]) -> list[str]:
    """Largest edge per case; area against the single-process 1S1T (target: at least 2x)."""
    single = next((r for r in results if r["workers"] == 0 and r["max_elements"]), None)
    rows = ["| case | largest edge | area x single process | meets 2x |", "|---|---|---|---|"]
    for r in results:
        cfg = RunConfig.from_dict(r["config"])
        if not r["max_elements"]:
            rows.append(f"| {case_label(cfg)} | none fits | | |")
            continue
        ratio = r["max_elements"] / single["max_elements"] if single else None
        meets = "" if ratio is None or cfg.workers == 0 else ("yes" if ratio >= 2 else "no")
        rows.append(f"| {case_label(cfg)} | {r['max_size']}² | {'' if ratio is None else f'{ratio:.2f}'} | {meets} |")
    return rows


def main(argv=None) -> None:
    parser = cli.parser("experiments.fig7", __doc__)
    parser.add_argument("--quick", action="store_true", help="the 2-core CPU scale")
    parser.add_argument("--sizes", type=int_list, default=None, help="sweep edges (default: the preset's)")
    parser.add_argument("--targets", type=int_list, default=None, help="K values (default 1,4,7)")
    parser.add_argument("--placements", default=",".join(PLACEMENTS), help="comma-separated: domain,encoder")
    parser.add_argument("--budget", type=parse_amount, default=None, help="per-worker budget (default: the preset's)")
    parser.add_argument("--no-sweep", action="store_true", help="only the largest-size search")
    parser.add_argument("--no-maxsize", action="store_true", help="only the memory sweep")
    parser.add_argument("--tolerance", type=float, default=0.02, help="relative edge precision of the search")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration")
    parser.add_argument("--device", default=None, choices=["cpu", "cuda"],
                        help="where workers run (default: cuda if available)")
    progress.add_arguments(parser)
    args = parser.parse_args(argv)
    progress.setup(args)
    preset = presets.preset("fig7_dsn")
    scale = preset.scale(args.quick)
    placements = [p.strip() for p in args.placements.split(",") if p.strip()]
    bad = sorted(set(placements) - set(PLACEMENTS))
    if bad:
        parser.error(f"unknown placement(s) {bad}; choose from {', '.join(PLACEMENTS)}")
    targets = args.targets or preset.extra["targets"]
    device = args.device or scale.device
    budget = args.budget or scale.budget_bytes
    stem = f"results/{preset.name}{'_quick' if args.quick else ''}"
    common = dict(batch=scale.batch, width=8, depth=3, steps=1, device=device, timeout_s=args.timeout)
    with progress.bars_and_logs():
        if not args.no_sweep:
            configs = sweep_configs(args.sizes or scale.sizes, targets, placements, **common)
            log.info("memory sweep: %d configurations -> %s.jsonl", len(configs), stem)
            with progress.bar(len(configs), "memory sweep", args, unit="config") as pb:
                run_sweep(configs, f"{stem}.jsonl", echo=log.debug if not pb.disable else log.info, progress=pb)
            print("\n".join(spread_table(records.load(f"{stem}.jsonl"))), flush=True)
        if not args.no_maxsize:
            out = f"{stem}_maxsize.jsonl"
            base = RunConfig(model="dsn", size=min(scale.sizes), workers=0, targets=1,
                             budget_bytes=budget if device == "cuda" else None, **common)
            log.info("largest image within %.0f MiB per worker on %s -> %s", budget / MiB, device, out)
            results, guess = [], min(scale.sizes)
            cases = [base] + distributed(base, targets, placements)
            with progress.bar(len(cases), "size search", args, unit="search") as pb:
                echo = log.debug if not pb.disable else log.info
                for cfg in cases:
                    r = search(cfg, budget, guess, out=out, tolerance=args.tolerance, echo=echo, progress=pb)
                    log.info("%s: largest %s (first failing %s)", case_label(cfg), r["max_size"],
                             r["first_failing_size"])
                    pb.update(1)
                    results.append(r)
                    guess = r["max_size"] or guess
            print("\n".join(maxsize_table(results)), flush=True)


if __name__ == "__main__":
    main()
