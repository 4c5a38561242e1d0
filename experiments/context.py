"""Does whole-image training pay? A context benchmark: whole image (bigconv) vs tiles vs shrunk.

    python -m experiments.context --quick      # 128² images, 1 seed, 2 dials, every method: a smoke run -> runs/
    python -m experiments.context --report     # the committed results/context.jsonl's table and figure
    python -m experiments.context              # the first sweep: 1024², 3 seeds x 4 dials x 3 methods -> runs/
    python -m experiments.context --scaled     # issue 35's sweep: 256², 3 tasks, 5 methods, 5 seeds, chosen lrs
    python -m experiments.context --tissue     # issue 54's: real tissue, converged (experiments.context_tissue)

The data (``experiments.context_data``): two 8-pixel real MNIST digits ``dial`` tiles apart on one row of
a black image. Task ``order``: a 6 and a 9, label 1 iff the 6 is left. Task ``same``: two of {3, 5, 8},
label 1 iff of the same class. Task ``has3``: two of {3, 5, 8}, label 1 iff one is a 3. The methods train the
same CNN (``experiments.context_models.ContextCNN``: a patchify stem, three conv+BatchNorm+max-pool levels,
four dilated convolutions, a global max pool, a linear head):

- ``whole``: the whole image, on a local ``bigconv.World`` of ``--processes`` workers (grid 2x2 for 4),
  through the public API only (``World``, ``parallelize``, ``optimizer``, ``train_step``, ``net(x)``).
- ``mil``, ``transmil``, ``tilegrid``: the image cut into ``tile``-pixel tiles; the CNN (without its
  head) embeds each tile, and torchmil's ABMIL (an unordered bag), torchmil's TransMIL (its PPEG sees
  the grid) or a small CNN over the embeddings laid on their grid reads the bag; trained end to end.
- ``downsampled``: the CNN on the image shrunk ``--shrink`` times per side (default: the square root
  of the process count), with the full-size stem (``fixed``) or a stem matched to the shrink.

Every method gets the same initial trunk weights, the same training images in the same order (batch
``s`` of seed ``k`` is drawn from seed ``k * 1_000_003 + s``), the same number of Adam steps, and is
scored on the same held-out images made from test digits (never seen in training). With ``--lrs``, each
(task, method) first tries every rate on validation digits (a part of the training digits) and uses the
best. Each run appends its record when it ends; a rerun skips recorded runs, so a sweep may span several
sittings. The figure is drawn from the saved records (``python -m plots.context``).
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from bigconv.harness import records
from experiments.context_data import RULES, TASKS, ContextData, Layout, shrink, tiles
from experiments.context_models import ContextCNN, TileGridCNN, TileMIL, TileTransMIL
from bigconv.harness import cli

log = logging.getLogger(__name__)

METHODS = ("whole", "mil", "transmil", "tilegrid", "downsampled")
"""``mil``: ABMIL over an unordered bag; ``transmil``: TransMIL, whose PPEG sees the tiles' grid; ``tilegrid``:
a CNN over the tile embeddings laid on their grid. The first sweep (``results/context.jsonl``) ran whole, mil
and downsampled."""
TILE_METHODS = ("mil", "transmil", "tilegrid")
STEMS = ("fixed", "matched")
"""``downsampled``'s stem: ``fixed``, the stride-4 stem of the full-size image (the first sweep's); ``matched``,
stride 4 / shrink, so its feature map has the whole-image method's size and each cell as many digit pixels."""


@dataclass(kw_only=True)
class Setting:
    """One sweep: the geometry, the training budget and where records go."""

    size: int = 1024
    """Image edge (pixels)."""
    tile: int = 128
    """MIL tile edge (pixels); the dial is measured in it."""
    digit: int = 8
    """Digit edge on the image (pixels)."""
    dials: tuple[float, ...] = (0.25, 1.5, 3.5, 6.5)
    """Digit distances in tiles. Half-integer beyond one tile: the digits then sit at the same place
    within their tiles whichever is left, so no within-tile position hints at the order."""
    seeds: tuple[int, ...] = (0, 1, 2)
    methods: tuple[str, ...] = ("whole", "mil", "downsampled")
    tasks: tuple[str, ...] = ("order",)
    """``experiments.context_data.TASKS``: ``order`` (is the 6 left of the 9?), ``same`` (same class?), ``has3``
    (is one a 3?)."""
    stem: str = "fixed"
    """``downsampled``'s stem (``STEMS``)."""
    lrs: tuple[float, ...] = ()
    """Learning rates tried per (task, method) before the sweep, the same budget for every method: each trains
    on the ``fit`` part of the training digits with ``tune_seed`` at every dial and is scored on the ``val``
    part; the best mean over the dials is the method's ``lr`` (a ``selection`` record). Empty: ``lr`` for all."""
    tune_seed: int = 100
    """Seed of the learning-rate trials, never one of ``seeds``."""
    steps: int = 300
    """Adam steps, the same for every method."""
    batch: int = 8
    """Images per step."""
    lr: float = 3e-3
    width: int = 16
    """Channels of every conv layer (and the MIL embedding size)."""
    test_images: int = 200
    """Held-out images per dial, the same for every method and seed."""
    processes: int = 4
    """Workers of the whole-image World."""
    shrink: int | None = None
    """Per-side shrink of ``downsampled``; None: sqrt(processes)."""
    out: str = "runs/context.jsonl"
    """Where records are appended (the committed ``results/context.jsonl`` only when named)."""
    quick: bool = False
    layouts: list[Layout] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        for name in ("steps", "batch", "width", "test_images", "processes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        bad = [m for m in self.methods if m not in METHODS]
        if bad:
            raise ValueError(f"unknown method(s) {bad}; choose from {list(METHODS)}")
        bad = [t for t in self.tasks if t not in TASKS]
        if bad or not self.tasks:
            raise ValueError(f"unknown task(s) {bad or self.tasks}; choose from {list(TASKS)}")
        if self.stem not in STEMS:
            raise ValueError(f"stem must be one of {STEMS}, got {self.stem!r}")
        if self.tune_seed in self.seeds and self.lrs:
            raise ValueError(f"tune_seed {self.tune_seed} is one of the seeds: the learning-rate trials must use "
                             f"a seed of their own")
        if any(not lr > 0 for lr in self.lrs):
            raise ValueError(f"learning rates must be positive, got {self.lrs}")
        if self.shrink is None:
            root = math.isqrt(self.processes)
            self.shrink = root if root * root == self.processes else max(1, round(math.sqrt(self.processes)))
        if isinstance(self.shrink, bool) or not isinstance(self.shrink, int) or self.shrink < 1:
            raise ValueError(f"shrink must be a positive integer, got {self.shrink!r}")
        q = ContextCNN.STRIDE
        if self.tile % q or self.size % q:
            raise ValueError(f"size {self.size} and tile {self.tile} must be multiples of {q} (the CNN's "
                             f"downsampling)")
        if self.size % (q * self.shrink):
            raise ValueError(f"size {self.size} shrunk {self.shrink}x must stay a multiple of {q}: use a size "
                             f"divisible by {q * self.shrink}")
        if self.stem == "matched" and 4 % self.shrink:
            raise ValueError(f"a matched stem is stride 4 / shrink: shrink {self.shrink} does not divide 4")
        if not self.dials:
            raise ValueError("give at least one dial")
        # Every dial is laid out (and so checked) before anything trains.
        self.layouts = [Layout(size=self.size, tile=self.tile, dial=d, digit=self.digit) for d in self.dials]


def quick_setting(**kw) -> Setting:
    return Setting(**{**dict(size=128, tile=32, dials=(0.5, 2.5), seeds=(0,), steps=6, batch=4, test_images=16,
                             methods=METHODS, out="runs/context_quick.jsonl", quick=True), **kw})


SCALED = dict(size=256, tile=32, digit=8, seeds=(0, 1, 2, 3, 4), methods=METHODS, tasks=("order", "same", "has3"),
              stem="matched", lrs=(1e-3, 3e-3, 1e-2), out="runs/context_scaled.jsonl")
"""``--scaled``: the sweep of issue 35 at a size that fits a few hours on 2 cores. Image and tiles a quarter of the
first sweep's per side (256², 32² tiles: still an 8x8 bag), the dials unchanged in tiles (so beyond one tile no
tile holds both digits, whatever the task), the digits kept at 8 px (a 2-px digit is no digit; 4 px is what
``downsampled`` sees). Every method, the three tasks, 5 seeds, the matched stem, 3 learning rates tried per (task,
method). 512² was tried first: its whole-image runs took 2-9 minutes each on this 2-core host (docs/context.md)."""


def scaled_setting(**kw) -> Setting:
    return Setting(**{**SCALED, **kw})


def _batches(data: ContextData, s: Setting, seed: int):
    for step in range(s.steps):
        x, y, _ = data.batch(s.batch, seed * 1_000_003 + step)
        yield x, y


def _last(loss) -> float:
    return loss.item() if torch.is_tensor(loss) else float(loss)


def _accuracy(predict, x: torch.Tensor, y: torch.Tensor, chunk: int = 16) -> float:
    right = 0
    with torch.no_grad():
        for i in range(0, len(x), chunk):
            right += int((predict(x[i:i + chunk]) == y[i:i + chunk]).sum())
    return right / len(x)


def _data(s: Setting, layout: Layout, task: str, split: str) -> tuple[ContextData, ContextData, int]:
    """(training data, scoring data, scoring images' seed): ``split`` 'test' trains on every training digit and
    scores the test digits; 'val' trains on the ``fit`` part and scores the ``val`` part (the trials)."""
    if split == "val":
        return (ContextData(layout, True, task, part="fit"), ContextData(layout, True, task, part="val"), _VAL_SEED)
    return ContextData(layout, True, task), ContextData(layout, False, task), _TEST_SEED


def _tile_model(method: str, s: Setting) -> nn.Module:
    cnn = ContextCNN(s.width)
    if method == "mil":
        return TileMIL(cnn, s.width)
    if method == "transmil":
        return TileTransMIL(cnn, s.width)
    return TileGridCNN(cnn, s.width, s.size // s.tile)


def _stem(s: Setting) -> int:
    return 4 // s.shrink if s.stem == "matched" else 4


def run_one(s: Setting, method: str, layout: Layout, seed: int, lr: float, task: str = "order",
            split: str = "test", world=None) -> dict:
    """Train ``method`` ``s.steps`` Adam steps at ``lr`` and score it; the record's method-specific fields."""
    train, score, score_seed = _data(s, layout, task, split)
    torch.manual_seed(seed)
    losses: list[float] = []
    if method == "whole":
        import bigconv

        grid = _grid(s.processes)
        net = bigconv.parallelize(ContextCNN(s.width), world, grid=grid)
        net.optimizer(torch.optim.Adam, lr=lr)
        loss_fn = nn.CrossEntropyLoss()
        for x, y in _batches(train, s, seed):
            losses.append(_last(net.train_step(x, y, loss_fn)))
        net.eval()
        predict = lambda x: net(x).argmax(1)  # noqa: E731
        extra = {"processes": s.processes, "grid": list(grid), "input_size": s.size}
    else:
        if method == "downsampled":
            model = ContextCNN(s.width, stem=_stem(s))
            inputs = lambda x: shrink(x, s.shrink)  # noqa: E731
            loss_of = lambda out, y: F.cross_entropy(out, y)  # noqa: E731
            decide = lambda out: out.argmax(1)  # noqa: E731
            extra = {"input_size": s.size // s.shrink, "shrink": s.shrink, "stem": _stem(s)}
        else:
            model = _tile_model(method, s)
            inputs = lambda x: tiles(x, s.tile)  # noqa: E731
            loss_of = lambda out, y: F.binary_cross_entropy_with_logits(out, y.float())  # noqa: E731
            decide = lambda out: (out > 0).long()  # noqa: E731
            extra = {"input_size": s.tile, "bag_size": (s.size // s.tile) ** 2,
                     "mil_head": {"mil": "torchmil.models.ABMIL", "transmil": "torchmil.models.TransMIL",
                                  "tilegrid": "TileGridCNN"}[method]}
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        for x, y in _batches(train, s, seed):
            opt.zero_grad(set_to_none=True)
            loss = loss_of(model(inputs(x)), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        model.eval()
        predict = lambda x: decide(model(inputs(x)))  # noqa: E731
        extra = {"processes": 1, "grid": None, **extra}
    xt, yt, _ = score.batch(s.test_images, score_seed)
    tail = losses[-max(1, len(losses) // 10):]
    return {"accuracy": _accuracy(predict, xt, yt), "train_loss_last": losses[-1],
            "train_loss_tail": sum(tail) / len(tail), "loss_curve": _curve(losses), **extra}


CURVE_POINTS = 30
"""``loss_curve``: the mean training loss over each of this many equal runs of steps (fewer for short runs),
so a record shows when a run began to learn, not only where it ended."""


def _curve(losses: list[float]) -> list[float]:
    n = max(1, len(losses) // CURVE_POINTS)
    return [round(sum(losses[i:i + n]) / len(losses[i:i + n]), 4) for i in range(0, len(losses) - n + 1, n)]


def run_whole(s: Setting, layout: Layout, seed: int, world) -> dict:
    return run_one(s, "whole", layout, seed, s.lr, world=world)


def run_mil(s: Setting, layout: Layout, seed: int) -> dict:
    return run_one(s, "mil", layout, seed, s.lr)


def run_downsampled(s: Setting, layout: Layout, seed: int) -> dict:
    return run_one(s, "downsampled", layout, seed, s.lr)


_VAL_SEED = 123_456_789
"""Seed of the validation images (the ``val`` part of the training digits)."""
_TEST_SEED = 987_654_321
"""Seed of the held-out images (test digits): the same for every method and training seed."""


def _grid(processes: int) -> tuple[int, int]:
    a = math.isqrt(processes)
    while processes % a:
        a -= 1
    return (a, processes // a)


def _key(s: Setting, method: str, dial: float, seed: int, lr: float | None = None, task: str = "order",
         split: str = "test") -> tuple:
    return (task, split, method, float(dial), seed, s.size, s.tile, s.digit, s.steps, s.batch,
            s.lr if lr is None else lr, s.width, s.test_images, s.processes if method == "whole" else 1,
            s.shrink if method == "downsampled" else None, _stem(s) if method == "downsampled" else None)


def _record_key(r: dict) -> tuple:
    """The run's ``_key``; a line older than a field ran with its first value (task order, split test, stem 4)."""
    stem = r.get("stem", 4) if r["method"] == "downsampled" else None
    return (r.get("task", "order"), r.get("split", "test"), r["method"], float(r["dial"]), r["seed"], r["image_size"],
            r["tile_size"], r["digit_size"], r["steps"], r["batch"], r["lr"], r["width"], r["test_images"],
            r["processes"], r.get("shrink"), stem)


def runs_of(recs: list[dict]) -> list[dict]:
    """The run records of the context benchmark (not its selection records)."""
    return [r for r in recs if r.get("bench") == "context" and r.get("record", "run") == "run"]


def recorded(path: str) -> set[tuple]:
    """Keys of the runs already in ``path`` (a rerun skips them)."""
    return {_record_key(r) for r in runs_of(records.load(path))} if os.path.exists(path) else set()


def _geometry(s: Setting) -> dict:
    return {"image_size": s.size, "tile_size": s.tile, "digit_size": s.digit, "steps": s.steps, "batch": s.batch,
            "width": s.width, "test_images": s.test_images, "shrink": s.shrink, "stem": s.stem}


class _Runner:
    """Records one (task, method, dial, seed, lr, split) at a time: run here (a World started on first need) or,
    with ``jobs`` above 1, in fresh processes side by side (``experiments.context_jobs``)."""

    def __init__(self, s: Setting, echo, jobs: int = 1) -> None:
        from bigconv.harness.workload import environment

        self.s, self.echo, self.env, self.world, self.jobs = s, echo, environment(), None, jobs
        self.done = recorded(s.out)

    def todo(self, item: tuple) -> bool:
        task, method, layout, seed, lr, split, _, _ = item
        return _key(self.s, method, layout.dial, seed, lr, task, split) not in self.done

    def run(self, items: list[tuple]) -> list[dict]:
        """Run and record every item (task, method, layout, seed, lr, split, seed_role, selected_on) not recorded
        yet; the new records."""
        items = [i for i in items if self.todo(i)]
        if self.jobs == 1:
            return [self._here(*i) for i in items]
        from experiments.context_jobs import Job, run_jobs

        new: list[dict] = []
        jobs = [Job({"setting": _setting_fields(self.s), "task": i[0], "method": i[1], "dial": i[2].dial,
                     "seed": i[3], "lr": i[4], "split": i[5]}, self.s.processes if i[1] == "whole" else 1,
                    f"{i[0]} {i[1]} dial {i[2].dial:g} seed {i[3]} lr {i[4]:g} ({i[5]})", i)
                for i in items]
        run_jobs(jobs, self.jobs, lambda job, r, _: new.append(self.record(*job.item, r)), echo=self.echo,
                 timeout=RUN_TIMEOUT)
        return new

    def _here(self, task, method, layout, seed, lr, split, role, selected_on) -> dict:
        s = self.s
        if method == "whole" and self.world is None:
            import bigconv

            self.world = bigconv.World(workers=s.processes, threads_per_worker=1)
        t0 = time.perf_counter()
        r = run_one(s, method, layout, seed, lr, task, split, self.world)
        return self.record(task, method, layout, seed, lr, split, role, selected_on,
                           {**r, "train_s": time.perf_counter() - t0})

    def record(self, task: str, method: str, layout: Layout, seed: int, lr: float, split: str, role: str | None,
               selected_on: str | None, r: dict) -> dict:
        s, env, r = self.s, self.env, dict(r)
        rec = {"bench": "context", "record": "run", "task": task, "split": split, "seed_role": role,
               "selected_on": selected_on, "method": method, "dial": float(layout.dial), "seed": seed,
               "accuracy": r.pop("accuracy"), "image_size": s.size, "tile_size": s.tile, "digit_size": s.digit,
               "distance_px": layout.distance, "processes": r.pop("processes"), "steps": s.steps, "batch": s.batch,
               "lr": lr, "optimizer": "Adam", "width": s.width, "test_images": s.test_images,
               "shrink": s.shrink if method == "downsampled" else None, "rule": RULES[task], "quick": s.quick, **r,
               "commit": env["commit"], "commit_dirty": env["commit_dirty"], "torch": env["torch"], "env": env,
               "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        records.append(s.out, rec)
        self.done.add(_record_key(rec))
        self.echo(f"  {task:5s} {method:11s} dial {layout.dial:<5g} seed {seed} lr {lr:g} ({split}): accuracy "
                  f"{rec['accuracy']:.3f}, loss {rec['train_loss_tail']:.3f} ({rec['train_s']:.0f}s)")
        return rec

    def close(self) -> None:
        if self.world is not None:
            self.world.close()


RUN_TIMEOUT = 4 * 3600
"""Seconds a ``--jobs`` run may take before it is stopped and named (the longest seen: about 6 minutes)."""


def _setting_fields(s: Setting) -> dict:
    """The fields a child process rebuilds ``s`` from (``child``)."""
    return {f.name: getattr(s, f.name) for f in fields(s) if f.init}


def child() -> None:
    """One run of ``--jobs``: its spec (``_Runner.run``) as JSON on stdin, its result on stdout."""
    import json
    import sys

    from experiments.context_jobs import RESULT

    spec = json.load(sys.stdin)
    torch.set_num_threads(1)
    given = spec["setting"]
    s = Setting(**{k: tuple(v) if isinstance(v, list) else v for k, v in given.items()})
    layout = next(lay for lay in s.layouts if lay.dial == spec["dial"])
    world = None
    if spec["method"] == "whole":
        import bigconv

        world = bigconv.World(workers=s.processes, threads_per_worker=1)
    try:
        t0 = time.perf_counter()
        r = run_one(s, spec["method"], layout, spec["seed"], spec["lr"], spec["task"], spec["split"], world)
        r["train_s"] = time.perf_counter() - t0
    finally:
        if world is not None:
            world.close()
    print(RESULT + json.dumps(r), flush=True)


def select_lr(s: Setting, task: str, method: str, recs: list[dict]) -> tuple[float, dict] | None:
    """The learning rate of ``s.lrs`` with the best mean validation accuracy over the dials (ties: the first),
    and the ``selection`` record; None while a trial is missing."""
    trials = []
    for lr in s.lrs:
        acc = {}
        for r in runs_of(recs):
            if r.get("split") == "val" and r["seed"] == s.tune_seed and r["method"] == method and r["lr"] == lr \
                    and r.get("task") == task and r["dial"] in s.dials and _record_key(r) == \
                    _key(s, method, r["dial"], s.tune_seed, lr, task, "val"):
                acc[r["dial"]] = (r["accuracy"], r["train_loss_tail"])
        if len(acc) < len(s.dials):
            return None
        trials.append({"lr": lr, "val_acc_mean": math.fsum(a for a, _ in acc.values()) / len(acc),
                       "val_acc": {str(d): a for d, (a, _) in sorted(acc.items())},
                       "train_loss_tail": {str(d): l for d, (_, l) in sorted(acc.items())}})
    best = max(trials, key=lambda t: (t["val_acc_mean"], -s.lrs.index(t["lr"])))
    rec = {"bench": "context", "record": "selection", "task": task, "method": method, "selected_on": "val",
           "lrs": list(s.lrs), "trial_budget": len(s.lrs), "tune_seed": s.tune_seed, "dials": list(s.dials),
           "trials": trials, "chosen_lr": best["lr"], **_geometry(s)}
    return best["lr"], rec


def chosen_lrs(s: Setting, recs: list[dict]) -> dict[tuple[str, str], float]:
    """(task, method) -> the learning rate its runs use: the selection's when ``s.lrs``, else ``s.lr``."""
    out = {}
    for task in s.tasks:
        for method in s.methods:
            if not s.lrs:
                out[task, method] = s.lr
                continue
            picked = select_lr(s, task, method, recs)
            if picked is not None:
                out[task, method] = picked[0]
    return out


def sweep(s: Setting, echo=print, jobs: int = 1, trials_only: bool = False) -> list[dict]:
    """The learning-rate trials (when ``s.lrs``), a ``selection`` record per (task, method), then (unless
    ``trials_only``) every (seed, task, dial, method) run not yet recorded in ``s.out``; the new records. ``jobs``
    above 1: that many cores busy with runs side by side (a whole-image run takes ``s.processes``), the longest
    runs first."""
    run = _Runner(s, echo, jobs)
    new: list[dict] = []
    try:
        if s.lrs:
            echo(f"learning-rate trials: {len(s.lrs)} per (task, method), seed {s.tune_seed}, validation digits")
            trials = [(task, method, layout, s.tune_seed, lr, "val", "tuning", None) for task in s.tasks
                      for method in s.methods for lr in s.lrs for layout in s.layouts]
            new += run.run(sorted(trials, key=lambda i: i[1] != "whole") if jobs > 1 else trials)
            recs = records.load(s.out)
            for task in s.tasks:
                for method in s.methods:
                    _, sel = select_lr(s, task, method, recs)
                    if not any(r.get("record") == "selection" and {**r, "time": None} == {**sel, "time": None}
                               for r in recs):
                        records.append(s.out, {**sel, "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
                        echo(f"  {task} {method}: lr {sel['chosen_lr']:g} chosen on the validation digits")
        if trials_only:
            return new
        lrs = chosen_lrs(s, records.load(s.out) if os.path.exists(s.out) else [])
        todo = len(s.seeds) * len(s.tasks) * len(s.layouts) * len(s.methods)
        echo(f"context sweep: {todo} run(s) of {s.out}")
        # Seed by seed, so that a sweep cut short has whole seeds of every task, dial and method.
        tests = [(task, method, layout, seed, lrs[task, method], "test", "fresh" if s.lrs else None,
                  "val" if s.lrs else None)
                 for seed in s.seeds for task in s.tasks for layout in s.layouts for method in s.methods]
        new += run.run(sorted(tests, key=lambda i: (i[3], i[1] != "whole")) if jobs > 1 else tests)
    finally:
        run.close()
    return new


CHANCE_LOSS = 0.6
"""A run whose training loss ends above this (ln 2 = 0.693 is a coin's) did not learn the training images."""


def report_records(s: Setting, recs: list[dict]) -> list[dict]:
    """The test runs of ``s`` (each (task, method) at its chosen learning rate)."""
    lrs = chosen_lrs(s, recs)
    return [r for r in runs_of(recs) if r.get("split", "test") == "test" and r.get("task", "order") in s.tasks
            and r["image_size"] == s.size and r["tile_size"] == s.tile and r["steps"] == s.steps
            and r["dial"] in s.dials and r["seed"] in s.seeds and r["method"] in s.methods
            and r["lr"] == lrs.get((r.get("task", "order"), r["method"]))
            and (r["method"] != "downsampled" or r.get("stem", 4) == _stem(s))]


def trials_table(s: Setting, recs: list[dict]) -> list[str]:
    """Per task, every learning-rate trial of ``s`` (its size, steps and dials): validation accuracy and the
    training loss at the end (mean of the last tenth of the steps), a row per (method, lr), a column per dial."""
    rows: list[str] = []
    for task in s.tasks:
        cells = {}
        for r in runs_of(recs):
            if r.get("split") == "val" and r.get("task") == task and r["seed"] == s.tune_seed and r["method"] in \
                    s.methods and r["lr"] in s.lrs and r["dial"] in s.dials and _record_key(r) == \
                    _key(s, r["method"], r["dial"], s.tune_seed, r["lr"], task, "val"):
                cells[r["method"], r["lr"], r["dial"]] = r
        if not cells:
            continue
        rows += [f"trials, task {task} (seed {s.tune_seed}, validation digits): accuracy (training loss at the end)",
                 "", "| method | lr | " + " | ".join(f"dial {d:g}" for d in s.dials) + " |",
                 "|---" * (len(s.dials) + 2) + "|"]
        for m in s.methods:
            for lr in s.lrs:
                got = [cells.get((m, lr, d)) for d in s.dials]
                if any(got):
                    rows.append(f"| {m} | {lr:g} | " + " | ".join(
                        "" if r is None else f"{r['accuracy']:.3f} ({r['train_loss_tail']:.3f})" for r in got) + " |")
        rows.append("")
    return rows


def table(recs: list[dict]) -> list[str]:
    """Per task: mean accuracy with its 95% interval over seeds (min-max with fewer than 2) per dial and method,
    runs that did not train marked; then, per dial, whole minus every other method paired by seed."""
    from multidsn.intervals import interval, paired

    rows: list[str] = []
    for task in [t for t in TASKS if any(r.get("task", "order") == t for r in recs)]:
        mine = [r for r in recs if r.get("task", "order") == task]
        dials = sorted({r["dial"] for r in mine})
        methods = [m for m in METHODS if any(r["method"] == m for r in mine)]
        rows += [f"task {task}: {RULES[task]}", "",
                 "| dial (tiles) | distance (px) | " + " | ".join(methods) + " |",
                 "|---" * (len(methods) + 2) + "|"]
        for d in dials:
            cells = []
            for m in methods:
                cell = [r for r in mine if r["dial"] == d and r["method"] == m]
                a = [r["accuracy"] for r in cell]
                if not a:
                    cells.append("")
                    continue
                stuck = sum(r.get("train_loss_tail", r.get("train_loss_last", 0)) > CHANCE_LOSS for r in cell)
                mark = f", {stuck} did not train" if stuck else ""
                iv = interval(a)
                cells.append(f"{iv.mean:.3f} [{iv.low:.2f}, {iv.high:.2f}] (n={len(a)}{mark})" if iv.low is not None
                             else f"{iv.mean:.3f} ({min(a):.2f}-{max(a):.2f}, n={len(a)}{mark})")
            dist = next(r["distance_px"] for r in mine if r["dial"] == d)
            rows.append(f"| {d:g} | {dist} | " + " | ".join(cells) + " |")
        if "whole" in methods and len(methods) > 1:
            others = [m for m in methods if m != "whole"]
            rows += ["", "whole minus each method, paired by seed (mean [95% interval], n):", "",
                     "| dial (tiles) | " + " | ".join(f"whole - {m}" for m in others) + " |",
                     "|---" * (len(others) + 1) + "|"]
            for d in dials:
                acc = {m: {r["seed"]: r["accuracy"] for r in mine if r["dial"] == d and r["method"] == m}
                       for m in methods}
                cells = []
                for m in others:
                    diff = paired(acc["whole"], acc[m])
                    cells.append("" if diff is None else diff.text(1, digits=3, sign=True))
                rows.append(f"| {d:g} | " + " | ".join(cells) + " |")
        rows.append("")
    rows.append(f"did not train: training loss above {CHANCE_LOSS} at the end (ln 2 = 0.693 is chance; the mean of "
                "the last tenth of the steps, or the last batch's for records older than that field)")
    return rows


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(t) for t in text.split(",") if t)


def _ints(text: str) -> tuple[int, ...]:
    if "-" in text.strip("-") and "," not in text:
        lo, hi = (int(t) for t in text.split("-", 1))
        return tuple(range(lo, hi + 1))
    return tuple(int(t) for t in text.split(",") if t)


COMMITTED = "results/context.jsonl"
"""The first sweep's records: what ``--report`` reads at the default scale when no ``--out`` is given."""


COMMITTED_SCALED = "results/context_scaled.jsonl"
"""The ``--scaled`` sweep's records: what ``--scaled --report`` reads when no ``--out`` is given."""


def _names(text: str) -> tuple[str, ...]:
    return tuple(t for t in text.split(",") if t)


def main(argv=None) -> None:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--tissue" in argv:  # issue 54's benchmark on real tissue: its own options (experiments.context_tissue)
        from experiments import context_tissue

        return context_tissue.main([a for a in argv if a != "--tissue"])
    parser = cli.parser("experiments.context", __doc__)
    scale = parser.add_mutually_exclusive_group()
    scale.add_argument("--tissue", action="store_true",
                       help="issue 54's benchmark on real H&E tissue (experiments.context_tissue; its own options: "
                            "--tissue --help)")
    scale.add_argument("--quick", action="store_true",
                       help="128² images, 1 seed, 2 dials, 6 steps, every method: a smoke run (about a minute)")
    scale.add_argument("--scaled", action="store_true",
                       help="the sweep of issue 35 (SCALED): 256² images, 32² tiles, the three tasks, every "
                            "method, 5 seeds, the matched stem, 3 learning rates tried per (task, method) on "
                            "validation digits")
    parser.add_argument("--size", type=int, help="image edge (default: the scale's)")
    parser.add_argument("--tile", type=int, help="tile edge of the MIL baseline (default: the scale's)")
    parser.add_argument("--digit", type=int, help="edge of each MNIST digit pasted in (default: the scale's)")
    parser.add_argument("--dials", type=_floats, help="comma-separated, in tiles (default: the scale's)")
    parser.add_argument("--seeds", type=_ints, help="seeds, comma-separated (default: the scale's)")
    parser.add_argument("--methods", type=_names,
                        help=f"comma-separated, of {','.join(METHODS)} (default: the scale's)")
    parser.add_argument("--tasks", type=_names, help=f"comma-separated, of {','.join(TASKS)} (default: the scale's)")
    parser.add_argument("--stem", choices=STEMS, help="downsampled's stem: fixed (stride 4) or matched (stride "
                        "4 / shrink) (default: the scale's)")
    parser.add_argument("--lrs", type=_floats, help="learning rates tried per (task, method) on validation digits, "
                        "comma-separated; none: --lr for every method (default: the scale's)")
    parser.add_argument("--tune-seed", type=int, dest="tune_seed",
                        help="seed of the learning-rate trials (default: 100)")
    parser.add_argument("--steps", type=int, help="training steps per run (default: the scale's)")
    parser.add_argument("--batch", type=int, help="images per step (default: the scale's)")
    parser.add_argument("--lr", type=float, help="learning rate without --lrs (default: 3e-3)")
    parser.add_argument("--test-images", type=int, dest="test_images",
                        help="held-out images per run (default: the scale's)")
    parser.add_argument("--processes", type=int, help="bigconv workers (default: the scale's)")
    parser.add_argument("--shrink", type=int, help="edge the shrunk-image baseline trains on (default: the scale's)")
    parser.add_argument("--out", help="results file: runs/context.jsonl, runs/context_quick.jsonl or "
                        f"runs/context_scaled.jsonl by scale; with --report, the committed {COMMITTED} (default scale) "
                        f"or {COMMITTED_SCALED} (--scaled) (default: by scale)")
    parser.add_argument("--jobs", type=int, default=1, help="cores to keep busy with runs side by side, each in a "
                        "fresh process (a whole-image run takes --processes of them); records are the same as one "
                        "at a time (default: 1, every run in this process)")
    parser.add_argument("--trials-only", action="store_true", dest="trials_only",
                        help="run the learning-rate trials and record the selections, then stop (the test runs "
                        "reuse them later; how many steps a method needs shows in each trial's loss_curve)")
    parser.add_argument("--figure", default=None, help="figure path stem (default context[_quick|_scaled] beside a "
                        "given --out, else in figures/)")
    parser.add_argument("--report", action="store_true", help="train nothing: print the table and draw the figure "
                        "from the records already in --out")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    if args.trials_only and args.report:
        parser.error("--trials-only trains, --report does not: give one of them")
    given = {k: v for k, v in vars(args).items() if k not in ("quick", "scaled", "tissue", "figure", "report", "jobs",
                                                                 "trials_only")
             and v is not None}
    if args.report and args.out is None and not args.quick:
        given["out"] = COMMITTED_SCALED if args.scaled else COMMITTED
    make = quick_setting if args.quick else scaled_setting if args.scaled else Setting
    s = make(**given)  # every layout is checked here: a ValueError names the limit
    if args.trials_only and not s.lrs:
        parser.error("--trials-only runs the learning-rate trials: give the rates to try (--lrs, or --scaled's)")
    torch.set_num_threads(1)
    if not args.report:
        t0 = time.perf_counter()
        sweep(s, jobs=args.jobs, trials_only=args.trials_only)
        log.info("sweep: %.0f s this sitting", time.perf_counter() - t0)
    recs = records.load(s.out) if os.path.exists(s.out) else []
    mine = report_records(s, recs)
    total = sum(r["train_s"] for r in runs_of(recs))
    print(f"{len(mine)} of {len(s.tasks) * len(s.layouts) * len(s.seeds) * len(s.methods)} runs recorded; the "
          f"training of every run in {s.out} took {total / 60:.1f} min in all")
    for task, method in ((t, m) for t in s.tasks for m in s.methods if s.lrs):
        picked = select_lr(s, task, method, recs)  # this setting's trials only (size, steps, dials, ...)
        if picked is None:
            print(f"selection: {task} {method}: trials missing")
            continue
        sel = picked[1]
        tried = ", ".join(f"{t['lr']:g} ({t['val_acc_mean']:.3f}, loss {max(t['train_loss_tail'].values()):.3f})"
                          for t in sel["trials"])
        print(f"selection: {task} {method}: lr {sel['chosen_lr']:g} of {tried} on validation digits (mean "
              f"accuracy over the dials, the highest training loss at the end)")
    print("\n".join(trials_table(s, recs) + table(mine)))
    from plots import context as plot

    name = "context_quick" if s.quick else "context_scaled" if args.scaled else "context"
    stem = args.figure or os.path.join(os.path.dirname(args.out) if args.out else "figures", name)
    for p in plot.draw(mine, stem, title=f"{s.size}² images, {s.tile}² tiles, {s.digit}-px digits, "
                                          f"{s.steps} steps x {s.batch}"):
        print(p)


if __name__ == "__main__":
    main()
