"""``python -m multidsn.train`` with ``--recipe paper`` (the default): the arguments to a ``PaperRecipe``,
the data, the runner, and the table of every recorded (method, seed) of this recipe."""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
from pathlib import Path

import torch

from bigconv import progress

from .mnist import paper_domains
from .paper import RunOptions, done, recipe_record, run, same_recipe, split_of
from .paper_jobs import run_jobs
from .paper_verdict import selected_on_of, verdict
from .placement import workers_needed
from .recipes import METHODS, PaperRecipe

log = logging.getLogger("multidsn.train")


def recipe_from(args: argparse.Namespace) -> PaperRecipe:
    return PaperRecipe(steps=args.steps, warmup=args.warmup, batch_size=args.batch_size, lr=args.lr,
                       momentum=args.momentum, weight_decay=args.weight_decay, lr_decay=args.lr_decay,
                       lr_decay_steps=args.lr_decay_steps, alpha=args.alpha, beta=args.beta, gamma=args.gamma,
                       gamma_mmd=args.gamma_mmd, grl_schedule=args.grl_schedule, lr_mmd=args.lr_mmd)


def main(args: argparse.Namespace, argv: list[str]) -> list[dict]:
    progress.setup(args, fmt="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    recipe = recipe_from(args)
    seeds = args.seeds or [0, 1, 2]
    key = recipe_record(recipe, args.extra_targets)
    if args.jobs < 1:
        raise SystemExit(f"--jobs must be at least 1, got {args.jobs}")
    if args.jobs > 1 and args.placement != "single":
        raise SystemExit(f"--jobs {args.jobs} trains each model in a process of its own: use --placement single, "
                         f"or --jobs 1 with --placement {args.placement}")
    if args.tune:
        from .paper_tuning import Protocol
        from .paper_tuning import main as tune

        try:
            proto = Protocol(trials=args.trials, tune_seeds=tuple(args.tune_seeds), seeds=tuple(seeds),
                             val_per_class=args.val_per_class)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        if args.extra_targets or args.placement != "single":
            raise SystemExit("--tune trains the mnistm target alone with --placement single")
        opts = RunOptions(log_every=args.log_every, collapse_ratio=args.collapse_ratio, out=args.out, quiet=args.quiet,
                          command="python -m multidsn.train " + " ".join(argv), device=args.device)
        with progress.bars_and_logs():
            text = tune(recipe, proto, opts, args.jobs, args.threads, args.report)
        print(text)
        return []
    if not args.report:
        source, targets = paper_domains(args.extra_targets)
        log.info("data: %s %d train / %d test; %s", source.name, len(source.train_x), len(source.test_x),
                 ", ".join(f"{t.name} {len(t.train_x)} train / {len(t.test_x)} test" for t in targets))
        opts = RunOptions(placement=args.placement, decoder=args.decoder, head=args.head, log_every=args.log_every,
                          collapse_ratio=args.collapse_ratio, out=args.out, quiet=args.quiet,
                          command="python -m multidsn.train " + " ".join(argv), device=args.device)
        if args.jobs > 1:
            run_jobs(recipe, args.methods, seeds, args.extra_targets, opts, args.jobs, args.threads)
        world = None
        if args.placement != "single":
            import bigconv

            world = bigconv.World(workers=args.workers or workers_needed(len(targets), args.placement, args.head))
        try:
            with progress.bars_and_logs():
                run(recipe, args.methods, seeds, source, targets, opts, world)
        finally:
            if world is not None:
                world.close()
    lines = records(args.out, key)
    print(table(lines, seeds))
    missing = [(m, s) for s in seeds for m in args.methods if (m, "mnistm", s) not in done(args.out, key)]
    if missing:
        print("not recorded yet: " + ", ".join(f"{m} seed {s}" for m, s in missing))
    return lines


def records(path: str, key: dict) -> list[dict]:
    """The lines of ``path`` that count for this recipe (``paper.same_recipe``), the last of each
    (method, target, seed)."""
    if not Path(path).exists():
        return []
    latest = {}  # one line per (method, target, seed): the last one recorded
    for r in map(json.loads, Path(path).read_text().splitlines()):
        if r.get("record", "run") == "run" and "method" in r and split_of(r) == "test" and same_recipe(r.get("recipe"), key, r["method"]):
            latest[r["method"], r["target"], r["seed"]] = r
    return list(latest.values())


def _stat(values: list[float | None]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    mean = 100 * statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.1f}"
    return f"{mean:.1f} ± {100 * statistics.stdev(values):.1f}"


def diverged(line: dict) -> bool:
    """Whether the run's training loss ended not finite (nan, inf): its accuracies are a broken model's
    (chance), not a result."""
    losses = [h.get("loss") for h in line.get("history", []) if h.get("loss") is not None]
    return bool(losses) and not math.isfinite(losses[-1])


def table(lines: list[dict], seeds: list[int], target: str = "mnistm") -> str:
    """Markdown: per method, mean ± std over the seeds of the target accuracy, its polarity split, source
    accuracy, the domain diagnostics and private-code collapse; then the bar's verdict. A diverged run
    (``diverged``) reads "diverged" and is left out of the means and the verdict."""
    rows = ["| method | seeds | target acc % | target val acc % | strokes light % | strokes dark % | source acc % "
            "| domain clf acc % | domain probe acc % | private codes | train s |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    gone = [r for r in lines if r["target"] == target and r["seed"] in seeds and diverged(r)]
    lines = [r for r in lines if not diverged(r)]
    means = {}
    for m in METHODS:
        lost = sorted(r["seed"] for r in gone if r["method"] == m)
        mine = [r for r in lines if r["method"] == m and r["target"] == target and r["seed"] in seeds]
        if lost and not mine:
            rows.append(f"| {m} | {','.join(map(str, lost))} | diverged" + " | -" * 8 + " |")
        if not mine:
            continue
        mine.sort(key=lambda r: r["seed"])
        means[m] = statistics.fmean(r["target_acc"] for r in mine)
        codes = "-"
        if any("private_codes" in r for r in mine):
            collapsed = sum(bool(r["private_codes"]["collapsed"]) for r in mine)
            codes = f"{collapsed}/{len(mine)} collapsed"
        seeds_cell = ",".join(str(r["seed"]) for r in mine)
        seeds_cell += f" ({','.join(map(str, lost))} diverged)" if lost else ""
        rows.append(f"| {m} | {seeds_cell} | {_stat([r['target_acc'] for r in mine])} "
                    f"| {_stat([r.get('target_val_acc') for r in mine])} "
                    f"| {_stat([r.get('target_acc_light') for r in mine])} "
                    f"| {_stat([r.get('target_acc_dark') for r in mine])} "
                    f"| {_stat([r['source_acc'] for r in mine])} | {_stat([r.get('domain_acc') for r in mine])} "
                    f"| {_stat([r.get('domain_probe_acc') for r in mine])} | {codes} "
                    f"| {statistics.fmean(r['train_s'] for r in mine):.0f} |")
    present = sorted({r["seed"] for r in lines + gone if r["target"] == target and r["seed"] in seeds})
    if present:
        rows += ["", "| method | " + " | ".join(f"seed {s} %" for s in present) + " |",
                 "|---|" + "---|" * len(present)]
        for m in METHODS:
            acc = {r["seed"]: f"{100 * r['target_acc']:.1f}" for r in lines
                   if r["method"] == m and r["target"] == target}
            acc.update({r["seed"]: "diverged" for r in gone if r["method"] == m})
            if acc:
                rows.append(f"| {m} | " + " | ".join(acc.get(s, "-") for s in present) + " |")
    if gone:
        rows.append("\ndiverged (training loss not finite at the end; left out of the means and the verdict): "
                    + ", ".join(f"{r['method']} seed {r['seed']}" for r in sorted(gone, key=lambda r: (r["method"],
                                                                                                     r["seed"]))))
    counts = next((r for r in lines if r["target"] == target and r.get("light_count") is not None), None)
    if counts:
        rows.append(f"\ntest images: {counts['light_count']} with light strokes, {counts['dark_count']} with dark")
    if {"source_only", "dann", "dsn_dann"} <= set(means):
        rows += verdict({m: {r["seed"]: r["target_acc"] for r in lines if r["method"] == m and r["target"] == target
                             and r["seed"] in seeds} for m in ("source_only", "dann", "dsn_dann")},
                        selected_on=selected_on_of(lines))
    return "\n".join(rows)
