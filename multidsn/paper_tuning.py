"""``python -m multidsn.train --tune``: settings chosen without the test set, then measured on fresh seeds.

1. **Validation split.** ``--val-per-class`` training digits per class are held out of both training sets
   (``multidsn.mnist.validation_domain``): their MNIST-M-style images are the labelled target validation
   split, disjoint from the test digits and from the unlabelled target training images.
2. **Tuning.** Every row of ``TUNED`` gets the same budget of ``--trials`` settings: trial 0 is the recipe's
   own setting, the others are drawn log-uniformly from the row's ``SPACES`` (a fixed draw per row and trial,
   so a rerun draws the same). Each trial trains with every ``--tune-seeds`` seed and is scored on the
   validation split: lines with ``split: "val"``, ``seed_role: "tuning"``. Then one ``selection`` record per
   row: every trial's mean validation accuracy and the chosen setting (the best mean; ties: the lower trial).
3. **Fresh seeds.** Each row's chosen setting trains with every ``--seeds`` seed (none of them a tuning
   seed) and is scored on the test digits: lines with ``split: "test"``, ``seed_role: "fresh"``,
   ``selected_on: "val"``.
4. **Report.** Per row the mean and 95% interval over the fresh seeds; the paired DSN-DANN - source-only and
   DSN-DANN - DANN differences with their intervals, and what they support (``paper_cli.verdict``).

Every step skips what ``--out`` already holds, so a stopped run resumes when rerun; ``--jobs N`` trains N
models at once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch

from .intervals import interval
from .paper import RunOptions, append_lines, done, evaluate, recipe_record, same_recipe, split_of, train
from .paper_verdict import verdict
from .recipes import METHODS, PaperRecipe, base_lr
from .train_report import environment

log = logging.getLogger("multidsn.tuning")

TUNED = ("source_only", "dann", "dsn_mmd", "dsn_dann")
"""The rows tuned and compared (target-only is the bound, trained on target labels: not tuned)."""
SPACES = {
    "source_only": {"lr": (0.005, 0.04)},
    "dann": {"lr": (0.005, 0.04), "gamma": (0.25, 2.0)},
    "dsn_mmd": {"lr": (0.005, 0.04), "gamma_mmd": (0.25, 4.0), "alpha": (0.01, 0.3), "beta": (0.03, 0.3)},
    "dsn_dann": {"lr": (0.005, 0.04), "gamma": (0.25, 2.0), "alpha": (0.01, 0.3), "beta": (0.03, 0.3)},
}
"""Per row, the settings a trial draws and their log-uniform ranges (every row's own knobs, around the paper's
values; the same number of trials whatever the number of knobs)."""
TRIAL_SEED = 35


@dataclasses.dataclass(kw_only=True)
class Protocol:
    trials: int = 4
    tune_seeds: tuple[int, ...] = (100,)
    seeds: tuple[int, ...] = (10, 11, 12, 13, 14)
    val_per_class: int = 100

    def __post_init__(self) -> None:
        if self.trials < 1:
            raise ValueError(f"--trials must be at least 1, got {self.trials}")
        if self.val_per_class < 1:
            raise ValueError(f"--val-per-class must be at least 1, got {self.val_per_class}")
        both = sorted(set(self.tune_seeds) & set(self.seeds))
        if both:
            raise ValueError(f"seeds {both} are tuning seeds: the fresh --seeds must not be used for tuning "
                             f"(--tune-seeds {','.join(map(str, self.tune_seeds))})")


def trial_params(recipe: PaperRecipe, method: str, trials: int) -> list[dict]:
    """The row's ``trials`` settings: the recipe's own first, then fixed log-uniform draws."""
    space = SPACES[method]
    own = {k: (base_lr(recipe, method) if k == "lr" else getattr(recipe, k)) for k in space}
    out = [own]
    for k in range(1, trials):
        rng = np.random.default_rng([TRIAL_SEED, METHODS.index(method), k])
        out.append({name: float(np.exp(rng.uniform(np.log(lo), np.log(hi)))) for name, (lo, hi) in space.items()})
    return out


def trial_recipe(recipe: PaperRecipe, method: str, params: dict) -> PaperRecipe:
    """The recipe a row trains with under ``params`` (its learning rate is ``lr``: ``lr_mmd`` is cleared)."""
    return dataclasses.replace(recipe, **params, lr_mmd=None)


@dataclasses.dataclass(frozen=True)
class Task:
    method: str
    seed: int
    params: dict
    split: str
    role: str


_DATA: dict = {}


def _data(val_per_class: int):
    if val_per_class not in _DATA:  # once per process: the data are made from a fixed seed
        from .mnist import validation_domain

        _DATA[val_per_class] = validation_domain(val_per_class=val_per_class)
    return _DATA[val_per_class]


def run_task(recipe: PaperRecipe, task: Task, proto: Protocol, opts: RunOptions, threads: int | None = None) -> dict:
    """Train one model of ``task`` and append its line (scored on the validation or the test split)."""
    if threads:
        torch.set_num_threads(threads)
    source, targets, val = _data(proto.val_per_class)
    r = trial_recipe(recipe, task.method, task.params)
    model, result = train(r, task.method, task.seed, source, targets, opts)
    try:
        scored = [val] if task.split == "val" else targets
        (row,) = evaluate(model, task.method, source, scored, opts)
    finally:
        model.close()
    row.pop("target_val_acc", None)
    line = {"record": "run", "method": task.method, "seed": task.seed, "split": task.split,
            "seed_role": task.role, "selected_on": "val" if task.role == "fresh" else None,
            "params": task.params, **row, "steps": r.steps, "warmup": r.warmup,
            "train_s": round(result["train_s"], 1), "domain_acc": result["domain_acc"], "placement": opts.placement,
            "device": opts.device, "recipe": recipe_record(r, [], proto.val_per_class),
            "config": dataclasses.asdict(result["config"]), "history": result["history"], "command": opts.command,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **environment()}
    append_lines(opts.out, [line])
    log.info("%s seed %d (%s, %s): %.1f%% on %s", task.method, task.seed, task.role, task.params,
             100 * line["target_acc"], task.split)
    return line


def _pending(recipe: PaperRecipe, tasks: list[Task], proto: Protocol, out: str) -> list[Task]:
    todo = []
    for t in tasks:
        key = recipe_record(trial_recipe(recipe, t.method, t.params), [], proto.val_per_class)
        if (t.method, "mnistm", t.seed) not in done(out, key, t.split):
            todo.append(t)
    return todo


def run_tasks(recipe: PaperRecipe, tasks: list[Task], proto: Protocol, opts: RunOptions, jobs: int,
              threads: int) -> None:
    todo = _pending(recipe, tasks, proto, opts.out)
    log.info("%d of %d models to train", len(todo), len(tasks))
    if jobs <= 1 or len(todo) <= 1:
        for t in todo:
            run_task(recipe, t, proto, opts)
        return
    quiet = RunOptions(**{**opts.__dict__, "quiet": True})
    fresh = {"max_tasks_per_child": 1} if sys.version_info >= (3, 11) else {}
    with ProcessPoolExecutor(min(jobs, len(todo)), mp_context=multiprocessing.get_context("spawn"), **fresh) as pool:
        for f in [pool.submit(run_task, recipe, t, proto, quiet, threads) for t in todo]:
            f.result()


def _lines(path: str) -> list[dict]:
    return [json.loads(x) for x in Path(path).read_text().splitlines()] if Path(path).exists() else []


def _accs(lines: list[dict], recipe: PaperRecipe, method: str, params: dict, proto: Protocol, split: str,
          seeds) -> dict[int, float]:
    key = recipe_record(trial_recipe(recipe, method, params), [], proto.val_per_class)
    return {r["seed"]: r["target_acc"] for r in lines if r.get("record") == "run" and r.get("method") == method
            and split_of(r) == split
            and r["seed"] in seeds and same_recipe(r.get("recipe"), key, method)}


def select(recipe: PaperRecipe, proto: Protocol, out: str, command: str = "") -> dict[str, dict]:
    """Each row's chosen setting (best mean validation accuracy over the tuning seeds), its ``selection``
    record appended to ``out`` unless the same one is there already; rows with missing trials are left out."""
    lines = _lines(out)
    chosen = {}
    for m in TUNED:
        trials = []
        for k, params in enumerate(trial_params(recipe, m, proto.trials)):
            acc = _accs(lines, recipe, m, params, proto, "val", proto.tune_seeds)
            trials.append({"trial": k, "params": params, "val_acc": acc and float(np.mean(list(acc.values()))),
                           "seeds": sorted(acc)})
        if any(len(t["seeds"]) < len(proto.tune_seeds) for t in trials):
            continue
        best = max(trials, key=lambda t: (t["val_acc"], -t["trial"]))
        chosen[m] = best["params"]
        rec = {"record": "selection", "method": m, "selected_on": "val", "trial_budget": proto.trials,
               "tuning_seeds": list(proto.tune_seeds), "val_per_class": proto.val_per_class,
               "val_images": 10 * proto.val_per_class, "trials": trials, "chosen": best["params"],
               "chosen_trial": best["trial"], "recipe": recipe_record(recipe, [], proto.val_per_class)}
        if not any(r.get("record") == "selection" and {**r, "command": "", "time": ""} == {**rec, "command": "",
                                                                                              "time": ""}
                   for r in lines):
            append_lines(out, [{**rec, "command": command, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}])
    return chosen


def report(recipe: PaperRecipe, proto: Protocol, out: str) -> str:
    """The fresh seeds' table and what it supports."""
    lines = _lines(out)
    selections = {r["method"]: r for r in lines if r.get("record") == "selection"
                  and r.get("trial_budget") == proto.trials and r.get("tuning_seeds") == list(proto.tune_seeds)
                  and same_recipe(r.get("recipe"), recipe_record(recipe, [], proto.val_per_class), "dann")}
    chosen = {m: r["chosen"] for m, r in selections.items()}
    rows = [f"selection on the target validation split ({10 * proto.val_per_class} images), {proto.trials} trials "
            f"per row, tuning seeds {','.join(map(str, proto.tune_seeds))}; fresh seeds "
            f"{','.join(map(str, proto.seeds))} on the 1,000 test digits",
            "| method | chosen setting | fresh seeds | target acc % (mean [95% interval]) |", "|---|---|---|---|"]
    acc = {}
    for m in TUNED:
        if m not in chosen:
            rows.append(f"| {m} | not selected yet | - | - |")
            continue
        acc[m] = _accs(lines, recipe, m, chosen[m], proto, "test", proto.seeds)
        setting = ", ".join(f"{k} {v:.3g}" for k, v in chosen[m].items())
        rows.append(f"| {m} | {setting} | {','.join(map(str, sorted(acc[m]))) or '-'} | "
                    f"{interval(list(acc[m].values())).text(100) if acc[m] else '-'} |")
    if all(acc.get(m) for m in ("source_only", "dann", "dsn_dann")):
        rows += [""] + verdict(acc, "val")
    if selections:
        rows += ["", "the trials (validation accuracy %, tuning seeds; * chosen):"]
        rows += [f"- {m}: " + "; ".join(_trial_text(t, t["trial"] == sel["chosen_trial"]) for t in sel["trials"])
                 for m, sel in selections.items()]
    return "\n".join(rows)


def _trial_text(trial: dict, chosen: bool) -> str:
    setting = ", ".join(f"{k} {v:.3g}" for k, v in trial["params"].items())
    return f"{'*' if chosen else ''}{trial['trial']}: {setting}: {100 * trial['val_acc']:.1f}"


def main(recipe: PaperRecipe, proto: Protocol, opts: RunOptions, jobs: int, threads: int, report_only: bool) -> str:
    if not report_only:
        tune = [Task(m, s, p, "val", "tuning") for m in TUNED for p in trial_params(recipe, m, proto.trials)
                for s in proto.tune_seeds]
        run_tasks(recipe, tune, proto, opts, jobs, threads)
        chosen = select(recipe, proto, opts.out, opts.command)
        fresh = [Task(m, s, chosen[m], "test", "fresh") for m in TUNED for s in proto.seeds]
        run_tasks(recipe, fresh, proto, opts, jobs, threads)
    return report(recipe, proto, opts.out)
