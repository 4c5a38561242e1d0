"""``python -m multidsn.train``: train Domain Separation Networks and their baselines, and record target accuracy.

Two recipes (``--recipe``):

- ``paper`` (the default): Bousmalis et al. (2016)'s MNIST -> MNIST-M configuration (``multidsn.recipes``)
  on real MNIST digits and an MNIST-M-style target (``multidsn.mnist``). Every row of ``--methods``
  (source-only, DANN alone, DSN with MMD, DSN with DANN, target-only) is trained for every seed and appended
  to ``--out`` (default ``runs/multidsn_paper.jsonl``, never the committed ``results/`` file unless named),
  one line per (method, target, seed); a rerun skips what is recorded (``multidsn.paper``), then prints the
  table (``multidsn.paper_cli``). ``--report`` alone prints the committed records' table.
- ``demo``: the earlier recipe: a DSN and a source-only baseline (the same network with the warm-up never
  ending) per seed on scikit-learn's digits and procedural targets, with Adam and MMD, on a local World
  or in this process; lines in ``--out`` (default ``runs/multidsn_train.jsonl``) with a summary of the gain
  over the seeds.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
import time

import torch

from bigconv import progress, saving

from .config import DSNConfig
from .data import Domain, Sampler, load_folder_domains, procedural_domains, standardized
from .evaluation import accuracy, private_code_report
from .model import DSN
from .mnist import EXTRA_TARGETS
from .placement import workers_needed
from .recipes import METHODS, PaperRecipe
from .train_report import report, summarize, write
from .trainer import make_trainer
from bigconv.harness import cli

log = logging.getLogger("multidsn.train")


RECIPES = ("paper", "demo")
PAPER = PaperRecipe()
# Options whose default depends on the recipe: (paper, demo). None: derived (see the help).
RECIPE_DEFAULTS = {
    "steps": (PAPER.steps, 3000), "warmup": (PAPER.warmup, None), "batch_size": (PAPER.batch_size, 32),
    "lr": (PAPER.lr, None), "momentum": (PAPER.momentum, 0.9), "alpha": (PAPER.alpha, 0.1),
    "beta": (PAPER.beta, 0.05), "gamma": (PAPER.gamma, 1.0), "placement": ("single", "domain"),
    "out": ("runs/multidsn_paper.jsonl", "runs/multidsn_train.jsonl"), "log_every": (500, 100),
    "grl_schedule": (PAPER.grl_schedule, "constant"),
}


COMMITTED = {"paper": "results/multidsn_paper.jsonl", "demo": "results/multidsn_train.jsonl"}
"""The records committed with the repository: what ``--report`` reads when no ``--out`` is given. Training
never appends to them unless ``--out`` names them: a fresh clone's ``python -m multidsn.train`` retrains."""
QUICK = {"paper": dict(steps=300, warmup=100, lr_decay_steps=100, seeds=[0], log_every=100,
                       out="runs/multidsn_paper_quick.jsonl"),
         "demo": dict(steps=300, seeds=[0], placement="single", log_every=100, out="runs/multidsn_train_quick.jsonl")}
"""``--quick``: one seed of every row, 300 steps (the paper recipe's schedule compressed alike): a smoke run of a
few minutes on 2 cores whose numbers are not results. Options given on the command line win."""


def _both(name: str, demo_note: str = "") -> str:
    paper, demo = RECIPE_DEFAULTS[name]
    return f"(default: {paper} with --recipe paper; {demo_note or demo} with --recipe demo)"


def build_parser() -> argparse.ArgumentParser:
    """The command line of both recipes; options whose default depends on the recipe default to None here and
    get it in ``parse_args``."""
    p = cli.parser("multidsn.train", __doc__.split("\n\n")[0])
    p.add_argument("--recipe", choices=RECIPES, default="paper",
                   help="'paper': Bousmalis et al.'s MNIST -> MNIST-M configuration (multidsn.recipes.PaperRecipe: "
                        "TF dann_mnist networks, SGD with momentum and a decaying learning rate, weight decay, "
                        "task-only warm-up, 32 px inputs in [-1, 1]) on real MNIST digits, every --methods row for "
                        "every seed; 'demo': the earlier recipe (small networks, Adam, MMD, scikit-learn digits, "
                        "procedural targets), a DSN and a source-only baseline per seed (default: paper)")
    p.add_argument("--seeds", type=_seed_list, default=None,
                   help="seeds, '0,1,2' or '0-4': every model is trained once per seed "
                        "(default: 0-2 with --recipe paper; --seed with --recipe demo)")
    p.add_argument("--steps", type=int, default=None, help="training steps per model " + _both("steps"))
    p.add_argument("--warmup", type=int, default=None,
                   help="task-only steps before the adaptation losses switch on " + _both("warmup", "steps // 5"))
    p.add_argument("--batch-size", type=int, default=None, help="images per domain per step " + _both("batch_size"))
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate " + _both("lr", "1e-3 for adam, 0.01 for sgd"))
    p.add_argument("--momentum", type=float, default=None, help="SGD momentum " + _both("momentum"))
    p.add_argument("--alpha", type=float, default=None, help="reconstruction weight of the DSN " + _both("alpha"))
    p.add_argument("--beta", type=float, default=None, help="difference weight of the DSN " + _both("beta"))
    p.add_argument("--gamma", type=float, default=None,
                   help="similarity weight: DANN's with --recipe paper, the --similarity one with --recipe demo "
                        + _both("gamma"))
    p.add_argument("--placement", choices=["single", "domain", "encoder"], default=None,
                   help="'single': this process; 'domain' / 'encoder': multidsn.parallelize on a local World of "
                        "worker processes (the same arithmetic) " + _both("placement"))
    p.add_argument("--decoder", choices=["domain", "head"], default="domain",
                   help="with a distributed placement: a decoder replica per domain, or one on the head worker "
                        "(default: domain)")
    p.add_argument("--head", choices=["separate", "source"], default="separate",
                   help="with a distributed placement: the classifiers on a worker of their own or on worker 0 "
                        "(default: separate)")
    p.add_argument("--workers", type=int, default=None,
                   help="World size (default: what the placement needs)")
    p.add_argument("--out", default=None,
                   help="JSON-lines file the results are appended to, and read to skip what it holds; with "
                        f"--report and no --out, the committed records ({COMMITTED['paper']} with --recipe paper, "
                        f"{COMMITTED['demo']} with --recipe demo) " + _both("out"))
    p.add_argument("--quick", action="store_true",
                   help="a smoke run of a few minutes: seed 0, 300 steps (paper recipe: warm-up 100, decay every 100), "
                        "records in runs/multidsn_<recipe>_quick.jsonl; not results (default: off)")
    p.add_argument("--log-every", type=int, default=None, help="steps between history entries " + _both("log_every"))
    p.add_argument("--collapse-ratio", type=float, default=0.01,
                   help="private codes count as collapsed below this fraction of the shared codes' norm "
                        "(default: 0.01)")
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads of this process: with --placement single the model's; otherwise the "
                        "driver only adds scalars. OpenMP spinning made a 28 px step 100x slower on a loaded "
                        "2-core host with the default of one thread per core (default: 1)")
    p.add_argument("--grl-schedule", choices=["constant", "dann"], default=None,
                   help="DANN's reversal factor: constant, or Ganin & Lempitsky's ramp 2 / (1 + exp(-10 p)) - 1 "
                        "over the steps after the warm-up " + _both("grl_schedule"))
    p.add_argument("--device", default="cpu",
                   help="where a --placement single model trains: 'cpu', or 'cuda' / 'cuda:N' for a GPU "
                        "(default: cpu)")
    paper = p.add_argument_group("paper recipe")
    paper.add_argument("--methods", type=_method_list, default=list(METHODS),
                       help=f"rows to train, comma-separated (default: {','.join(METHODS)})")
    paper.add_argument("--extra-targets", type=_names, default=[],
                       help="targets trained alongside mnistm (K = 1 + their number), comma-separated from "
                            f"{','.join(EXTRA_TARGETS)} (default: none)")
    paper.add_argument("--gamma-mmd", type=float, default=PAPER.gamma_mmd,
                       help=f"similarity weight of the dsn_mmd row (default: {PAPER.gamma_mmd})")
    paper.add_argument("--weight-decay", type=float, default=PAPER.weight_decay,
                       help=f"SGD weight decay (default: {PAPER.weight_decay})")
    paper.add_argument("--lr-mmd", type=float, default=PAPER.lr_mmd,
                       help=f"learning rate of the dsn_mmd row, which diverged at 0.02 (default: {PAPER.lr_mmd})")
    paper.add_argument("--lr-decay", type=float, default=PAPER.lr_decay,
                       help=f"staircase learning-rate decay factor (default: {PAPER.lr_decay})")
    paper.add_argument("--lr-decay-steps", type=int, default=None,
                       help=f"steps between two learning-rate decays (default: {PAPER.lr_decay_steps}; 100 with "
                            f"--quick)")
    paper.add_argument("--jobs", type=int, default=1,
                       help="models trained at once, each in a process of its own with --threads threads; the "
                            "(method, seed) runs go longest first, and each line is appended whole, so the "
                            "results file is the one a single process writes (default: 1)")
    paper.add_argument("--tune", action="store_true",
                       help="choose every row's settings without the test set (multidsn/paper_tuning.py): "
                            "--trials settings per row scored on a labelled target validation split, then the "
                            "chosen ones on the fresh --seeds (default 10-14) scored on the test digits, with 95%% "
                            "intervals and paired differences; records in --out (default runs/multidsn_tuning.jsonl) "
                            "(default: off)")
    paper.add_argument("--trials", type=int, default=4,
                       help="with --tune: settings tried per row, the same for every row (default: 4)")
    paper.add_argument("--tune-seeds", type=_seed_list, default=[100],
                       help="with --tune: seeds of the tuning runs, never among --seeds (default: 100)")
    paper.add_argument("--val-per-class", type=int, default=100,
                       help="with --tune: training digits per class held out of every training split as the "
                            "labelled target validation split (default: 100)")
    paper.add_argument("--report", action="store_true",
                       help=f"train nothing: print the table of what --out holds for this recipe; without --out, of "
                            f"the committed {COMMITTED['paper']} (default: off)")
    demo = p.add_argument_group("demo recipe")
    demo.add_argument("--targets", type=int, default=2,
                      help="K, the number of target domains (procedural: 1-7, the first K of multidsn.shifts.SHIFTS) "
                           "(default: 2)")
    demo.add_argument("--image-size", type=int, default=28, help="image side in pixels (default: 28)")
    demo.add_argument("--similarity", choices=["dann", "mmd"], default="mmd",
                      help="the DSN's similarity loss (default: mmd)")
    demo.add_argument("--optimizer", choices=["sgd", "adam"], default="adam",
                      help="optimizer of both models (default: adam)")
    demo.add_argument("--width", type=int, default=16,
                      help="channels of the first shared block; the other widths follow from it (default: 16)")
    demo.add_argument("--code-size", type=int, default=32, help="length of the shared and private codes (default: 32)")
    demo.add_argument("--normalize", choices=["image", "none"], default="image",
                      help="'image': every image of every domain to zero mean and unit variance (default: image)")
    demo.add_argument("--shifts", type=lambda s: s.split(","), default=None,
                      help="procedural targets by name, comma-separated (default: the first K of "
                           "multidsn.shifts.SHIFTS)")
    demo.add_argument("--seed", type=int, default=0, help="the seed when --seeds is not given (default: 0)")
    demo.add_argument("--data", choices=["procedural", "folders"], default="procedural",
                      help="procedural targets, or real images in folders (default: procedural)")
    demo.add_argument("--root", default=None, help="with --data folders: one folder per domain (default: none)")
    demo.add_argument("--source", default=None,
                      help="with --data folders: the labelled source folder's name (default: none)")
    demo.add_argument("--skip-baseline", action="store_true", help="train the DSN only (default: off)")
    demo.add_argument("--checkpoint", default=None,
                      help="checkpoint file, written atomically, removed when the run ends (default: --out with "
                           ".ckpt.pt)")
    demo.add_argument("--checkpoint-every", type=int, default=250,
                      help="steps between checkpoints, 0: none (default: 250)")
    demo.add_argument("--resume", action="store_true",
                      help="continue an interrupted run from --checkpoint (same arguments otherwise); seeds already "
                           "finished are not trained or written again (default: off). The paper recipe needs no "
                           "flag: rerun the same command and it trains only the (method, seed) not yet in --out")
    progress.add_arguments(p)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    column = RECIPES.index(args.recipe)
    if args.tune:
        if args.recipe != "paper":
            raise SystemExit("--tune is for --recipe paper")
        if args.out is None and getattr(args, "report", False) and not args.quick:
            args.out = COMMITTED["paper"]  # the committed protocol's lines sit beside the earlier runs' there
        args.out = args.out or ("runs/multidsn_tuning_quick.jsonl" if args.quick else "runs/multidsn_tuning.jsonl")
        args.seeds = args.seeds or ([10, 11] if args.quick else [10, 11, 12, 13, 14])
        if args.quick and args.trials == 4:
            args.trials = 2
    if args.out is None and getattr(args, "report", False):
        args.out = COMMITTED[args.recipe]
    if args.quick:
        for name, value in QUICK[args.recipe].items():
            if getattr(args, name) is None:
                setattr(args, name, value)
    if args.lr_decay_steps is None:
        args.lr_decay_steps = PAPER.lr_decay_steps
    for name, values in RECIPE_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, values[column])
    _check_device(args)
    return args


def _check_device(args: argparse.Namespace) -> None:
    """A --device that cannot hold the model is refused here, before any data is made or worker started."""
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise SystemExit(f"--device {args.device!r} is not a device; use 'cpu', 'cuda' or 'cuda:N'") from None
    if device.type == "cpu":
        return
    if args.placement != "single":
        raise SystemExit(f"--device {args.device} is for --placement single: a distributed placement's workers "
                         f"hold the model (use --device cpu)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: this process sees no GPU; use --device cpu")


def _method_list(text: str) -> list[str]:
    names = _names(text)
    unknown = [n for n in names if n not in METHODS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"--methods takes names from {','.join(METHODS)}, not {text!r}")
    return names


def _names(text: str) -> list[str]:
    return [n for n in text.split(",") if n]


def _seed_list(text: str) -> list[int]:
    try:
        if "-" in text.strip("-"):
            lo, hi = (int(v) for v in text.split("-", 1))
            seeds = list(range(lo, hi + 1))
        else:
            seeds = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds takes '0,1,2' or '0-4', not {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"--seeds {text!r} must name at least one seed, each once")
    return seeds


def load_data(args) -> tuple[Domain, list[Domain]]:
    if args.data == "folders":
        if not (args.root and args.source):
            raise SystemExit("--data folders needs --root DIR and --source NAME")
        source, targets = load_folder_domains(args.root, args.source, args.image_size, seed=args.seed)
        if len(targets) != args.targets:
            raise SystemExit(f"{args.root} has {len(targets)} target folders but --targets is {args.targets}")
    else:
        source, targets = procedural_domains(args.targets, args.image_size, seed=args.seed, shifts=args.shifts)
    if args.normalize == "image":
        source, targets = standardized(source), [standardized(t) for t in targets]
    return source, targets


def train_one(name: str, cfg: DSNConfig, args, world, source: Domain, targets: list[Domain],
              saved: dict | None = None, keep: dict | None = None) -> dict:
    """Train one model; ``saved``: the checkpoint's ``extra`` when this very run is being resumed;
    ``keep``: what every checkpoint of this run must also remember (finished runs)."""
    torch.manual_seed(args.seed)
    model = make_trainer(DSN(cfg), world, args.placement, args.decoder, args.head, args.device)
    try:
        if args.optimizer == "sgd":
            model.optimizer(torch.optim.SGD, lr=args.lr or 0.01, momentum=args.momentum)
        else:
            model.optimizer(torch.optim.Adam, lr=args.lr or 1e-3)
        sampler = Sampler(source, targets, args.batch_size, seed=args.seed)
        start, history, spent, first = time.perf_counter(), [], 0.0, 0
        if saved is not None:
            model.load(args.checkpoint)
            sampler.gen.set_state(saved["sampler"])
            history, spent, first = saved["history"], saved["train_s"], model.steps
            log.info("%s (seed %d): resumed at step %d from %s", name, args.seed, first, args.checkpoint)
        with progress.bar(args.steps, f"{name} (seed {args.seed})", args, unit="step") as pb:
            pb.update(first)
            # On a terminal the bar shows progress and the step lines are --verbose only; in a log file
            # (no bar) they are the progress.
            level = logging.DEBUG if not pb.disable else logging.INFO
            for step in range(first, args.steps):
                terms = model.train_step_terms(next(sampler))
                pb.update(1)
                if step % args.log_every == 0 or step == args.steps - 1:
                    record = {"step": step, **terms.record()}
                    history.append(record)
                    pb.set_postfix(loss=f"{record['loss']:.4f}", task=f"{record['task']:.4f}", refresh=False)
                    rate = (step + 1 - first) / (time.perf_counter() - start)
                    log.log(level, "%s %5d/%d  loss %.4f  task %.4f  sim %s  %.1f steps/s", name, step + 1,
                            args.steps, record["loss"], record["task"],
                            "-" if record["similarity"] is None else f"{record['similarity']:.4f}", rate)
                if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0 and step + 1 < args.steps:
                    model.save(args.checkpoint, extra={
                        **(keep or {}), "seed": args.seed, "model": name, "history": history,
                        "sampler": sampler.gen.get_state(), "train_s": spent + time.perf_counter() - start,
                        "config": _fingerprint(args)})
        train_s = spent + time.perf_counter() - start
        result = {"model": name, "train_s": round(train_s, 3), "step_s": round(train_s / args.steps, 5),
                  "source_accuracy": accuracy(model, source, 0),
                  "target_accuracy": {t.name: accuracy(model, t, d + 1) for d, t in enumerate(targets)},
                  "history": history}
        labelled = [v for v in result["target_accuracy"].values() if v is not None]
        result["mean_target_accuracy"] = sum(labelled) / len(labelled) if labelled else None
        if name == "dsn":
            result["private_codes"] = private_code_report(model, [source, *targets], args.collapse_ratio)
        return result
    finally:
        model.close()


def model_config(args: argparse.Namespace) -> DSNConfig:
    """The DSN the command line describes; the widths of every part follow from ``--width``."""
    warmup = args.steps // 5 if args.warmup is None else args.warmup
    w = args.width
    return DSNConfig(image_size=args.image_size, channels=3, num_classes=10, num_targets=args.targets,
                     code_size=args.code_size, shared_widths=(w, 2 * w), private_widths=(max(1, w // 2), w),
                     decoder_widths=(w, max(1, w // 2)), classifier_hidden=4 * w, similarity=args.similarity,
                     alpha=args.alpha, beta=args.beta, gamma=args.gamma, warmup_steps=warmup,
                     grl_schedule=args.grl_schedule, grl_ramp_steps=max(1, args.steps - warmup))


def task_only(cfg: DSNConfig, steps: int) -> DSNConfig:
    """``cfg`` with the warm-up never ending in ``steps``: only the task loss trains it."""
    return DSNConfig(**{**cfg.__dict__, "warmup_steps": steps})


def main(argv: list[str] | None = None):
    args = parse_args(argv)
    if args.recipe == "paper":
        from . import paper_cli

        return paper_cli.main(args, sys.argv[1:] if argv is None else argv)
    args.checkpoint = args.checkpoint or os.path.splitext(args.out)[0] + ".ckpt.pt"
    progress.setup(args, fmt="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    cfg = model_config(args)
    baseline_cfg = task_only(cfg, args.steps)
    seeds = args.seeds or [args.seed]
    data = {}
    for seed in seeds:  # every seed's data before any worker starts: a bad --root or --shifts fails first
        data[seed] = load_data(_with_seed(args, seed))
    world = None
    if args.placement != "single":
        import bigconv

        world = bigconv.World(workers=args.workers or workers_needed(args.targets, args.placement, args.head))
    runs = []
    with progress.bars_and_logs():
        _train_seeds(args, seeds, data, cfg, baseline_cfg, world, runs)
    summary = summarize(args, cfg, runs, sys.argv[1:] if argv is None else argv)
    write(args.out, [summary])
    log.info("wrote %s", args.out)
    print(report(summary, runs))
    return summary


def _train_seeds(args, seeds, data, cfg, baseline_cfg, world, runs: list) -> None:
    saved = _resumable(args)
    if saved is not None:
        runs.extend(saved["runs"])
    try:
        for seed in seeds:
            if any(r["seed"] == seed for r in runs):  # finished before the interruption; its lines are written
                continue
            seed_args = _with_seed(args, seed)
            source, targets = data[seed]
            log.info("seed %d data: source %s (%d train), targets %s; %s", seed, source.name, len(source.train_x),
                     [t.name for t in targets], world or "single process")
            here = saved if saved is not None and saved["seed"] == seed else None
            if here is not None and here["model"] == "source_only":
                dsn = here["dsn_result"]
            else:
                dsn = train_one("dsn", cfg, seed_args, world, source, targets, here, keep={"runs": runs})
            run = {"seed": seed, "dsn": dsn, "source_only": None}
            if not args.skip_baseline:
                mine = here if here is not None and here["model"] == "source_only" else None
                run["source_only"] = train_one("source_only", baseline_cfg, seed_args, world, source, targets, mine,
                                               keep={"runs": runs, "dsn_result": dsn})
            runs.append(run)
            # each seed's lines as soon as its models finish: a stopped run keeps them
            write(args.out, [{"seed": seed, **run[m]} for m in ("dsn", "source_only") if run[m] is not None])
            if args.checkpoint_every:  # the finished seeds, for a resume that comes before the next checkpoint
                _mark_seed_done(args, runs)
    finally:
        if world is not None:
            world.close()
    if args.checkpoint_every and os.path.exists(args.checkpoint):
        os.unlink(args.checkpoint)  # the run is complete: nothing to resume


def _fingerprint(args) -> dict:
    """What a resumed run must share with the interrupted one."""
    skip = {"resume", "checkpoint", "checkpoint_every", "quiet", "verbose", "log_every", "threads", "workers", "seed"}
    return {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in sorted(vars(args).items())
            if k not in skip}


def _resumable(args) -> dict | None:
    """The checkpoint's ``extra`` to resume from, after checking it belongs to this command line."""
    if not args.resume:
        return None
    if not os.path.exists(args.checkpoint):
        log.warning("--resume: no checkpoint at %s; starting from the beginning", args.checkpoint)
        return None
    extra = saving.read(args.checkpoint).get("extra", {})
    if extra.get("config") != _fingerprint(args):
        theirs, ours = extra.get("config", {}), _fingerprint(args)
        diff = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
        raise SystemExit(f"--resume: {args.checkpoint} was written by another command line (differs in "
                         f"{', '.join('--' + k.replace('_', '-') for k in diff)}); rerun it with the same arguments")
    return extra


def _mark_seed_done(args, runs: list) -> None:
    """A checkpoint that says: these seeds are done, the next starts from scratch."""
    extra = {"runs": runs, "seed": None, "model": None, "config": _fingerprint(args)}
    saving.atomic_save(saving.checkpoint({}, None, None, 0, extra=extra), args.checkpoint)


def _with_seed(args: argparse.Namespace, seed: int) -> argparse.Namespace:
    out = copy.copy(args)
    out.seed = seed
    return out


if __name__ == "__main__":
    main()
