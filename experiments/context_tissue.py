"""Issue 54: whole image against tiles and against a memory-limited user's shrink, on real tissue, converged.

    python -m experiments.context --tissue --quick      # 256² smoke run of every method -> runs/
    python -m experiments.context --tissue --jobs 2     # the sweep (resumable) -> runs/context_tissue.jsonl
    python -m experiments.context --tissue --report     # the corrected table and figures, results/context_tissue.jsonl
    python -m experiments.context --tissue --control    # the colour-histogram control (records it)

The data (``experiments.context_tissue_data``): real MNIST digits drawn as haematoxylin on crops of real H&E.
The methods (``METHODS``) share ``ContextCNN`` (3 input channels):

- ``whole``: the whole image on a local ``bigconv.World`` of ``processes`` workers, through the public API
  (``World``, ``parallelize``, ``optimizer``, ``train_step``, ``net(x)``, ``save``/``load`` for the best checkpoint);
- ``shrink4``, ``shrink8``: the image area-averaged 4x or 8x per side, the ordinary (stride-4) stem;
- ``tilegrid``: the tile CNN's embeddings on their grid, read by a small CNN;
- ``transmil``: torchmil's TransMIL at its standard width (512, 8 heads; ``transmil_landmarks`` Nystrom landmarks);
- ``mil``: torchmil's ABMIL (attention width 128, torchmil's default).

The protocol (fixed in docs/context.md before the sweep ran): every run trains on images of the ``fit`` digits on
the training region, is evaluated every ``eval_every`` steps on ``val_images`` fixed images of the ``val`` digits,
keeps its lowest-validation-loss weights and stops when ``patience`` steps passed without a new lowest (not before
``min_steps``, and only once that loss is below ``LEARNT``) or at ``max_steps``. The learning rate of each (task,
method) is the one of its grid with the lowest mean best validation loss over the tuning seeds; a rate on the grid's
edge widens the grid by one rate on that side and the new rate is tried (at most ``widen`` times). Fresh seeds then
train at the chosen rate; their best weights are scored on ``test_images`` images of test digits on the test region,
and as many on the second domain. ``--report`` prints every (task, method) cell and whole minus each alternative,
paired by seed, with a 95% interval, the paired t-test's p, the exact sign-flip p, and Holm's correction over the
comparisons named in advance (``COMPARISONS``).
"""

from __future__ import annotations

import copy
import logging
import math
import os
import socket
import tempfile
import time
from dataclasses import dataclass, fields

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from bigconv.harness import cli, records
from experiments.context_data import shrink, tiles
from experiments.context_models import ContextCNN, TileGridCNN, TileMIL, TileTransMIL
from experiments.context_tissue_data import TISSUE_TASKS, TissueData, TissueLayout, as_float, colour_control

log = logging.getLogger(__name__)

METHODS = ("whole", "shrink4", "shrink8", "tilegrid", "transmil", "mil")
SHRINKS = {"shrink4": 4, "shrink8": 8}
ALTERNATIVES = METHODS[1:]
COMPARISONS = [(task, m) for task in TISSUE_TASKS for m in ALTERNATIVES]
"""Named before the sweep: per task, whole minus each alternative (10), on the test region (the primary family,
Holm-corrected over these 10) and on the second domain (a second family of 10, corrected on its own)."""
DOMAINS = ("test", "domain2")
BENCH = "context_tissue"
VAL_SEED = 123_456_789
TEST_SEED = {"test": 987_654_321, "domain2": 555_555_555}
CHUNK = 25
"""Images per scoring chunk; chunk ``i`` of a domain is drawn with seed ``TEST_SEED[domain] + i``."""


@dataclass(kw_only=True)
class TissueSetting:
    """One sweep on tissue: geometry, training protocol, statistics and where records go."""

    size: int = 512
    tile: int = 64
    digit: int = 16
    """Digit edge (pixels): a nucleus's size at 20x (cmu_small_region's magnification)."""
    dial: float = 3.5
    """Digits ``dial`` tiles apart: beyond one tile, so no tile holds both."""
    tasks: tuple[str, ...] = TISSUE_TASKS
    methods: tuple[str, ...] = METHODS
    seeds: tuple[int, ...] = tuple(range(8))
    """Fresh seeds (the test runs)."""
    tune_seeds: tuple[int, ...] = (100, 101)
    lrs: tuple[float, ...] = (3e-4, 1e-3, 3e-3)
    """The starting learning-rate grid of every (task, method)."""
    widen: int = 2
    """How many times a grid may grow by one rate on the side its choice sits on."""
    batch: int = 8
    max_steps: int = 3000
    """The step cap."""
    min_steps: int = 1000
    """No run stops on patience before this step."""
    eval_every: int = 200
    """Steps between two validation evaluations."""
    patience: int = 800
    """Steps without a new lowest validation loss after which a run stops (once it has learnt: ``LEARNT``)."""
    val_images: int = 256
    test_images: int = 1000
    width: int = 16
    processes: int = 2
    transmil_dim: int = 512
    transmil_heads: int = 8
    transmil_landmarks: int = 32
    abmil_dim: int = 128
    world_timeout: float = 7200.0
    """The World's wait limit (s): long, so a sweep paused with SIGSTOP for an hour resumes."""
    out: str = "runs/context_tissue.jsonl"
    quick: bool = False

    def __post_init__(self) -> None:
        for name in ("size", "tile", "digit", "batch", "max_steps", "eval_every", "val_images", "test_images",
                     "width", "processes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        bad = [m for m in self.methods if m not in METHODS]
        if bad:
            raise ValueError(f"unknown method(s) {bad}; choose from {list(METHODS)}")
        bad = [t for t in self.tasks if t not in TISSUE_TASKS]
        if bad or not self.tasks:
            raise ValueError(f"unknown task(s) {bad or self.tasks}; choose from {list(TISSUE_TASKS)}")
        if set(self.tune_seeds) & set(self.seeds):
            raise ValueError(f"tuning seeds {self.tune_seeds} overlap the fresh seeds {self.seeds}")
        if len(self.lrs) < 3 or any(not lr > 0 for lr in self.lrs) or list(self.lrs) != sorted(set(self.lrs)):
            raise ValueError(f"lrs must be at least 3 increasing positive rates (an interior choice needs one), "
                             f"got {self.lrs}")
        if self.processes < 2 and "whole" in self.methods and not self.quick:
            raise ValueError("the whole image trains on at least 2 bigconv workers")
        q = ContextCNN.STRIDE
        if self.tile % q or self.size % q:
            raise ValueError(f"size {self.size} and tile {self.tile} must be multiples of {q}")
        for m in self.methods:
            if m in SHRINKS and self.size % (q * SHRINKS[m]):
                raise ValueError(f"size {self.size} shrunk {SHRINKS[m]}x ({m}) must stay a multiple of {q}: use a "
                                 f"size divisible by {q * SHRINKS[m]}")
        self.layout = TissueLayout(size=self.size, tile=self.tile, digit=self.digit, dial=self.dial)


def quick_setting(**kw) -> TissueSetting:
    return TissueSetting(**{**dict(size=256, tile=32, digit=8, dial=2.5, seeds=(0,), tune_seeds=(100,),
                                   max_steps=6, min_steps=2, eval_every=2, patience=2, batch=4, val_images=8,
                                   test_images=8, transmil_dim=32, transmil_heads=4, transmil_landmarks=8,
                                   abmil_dim=16, out="runs/context_tissue_quick.jsonl", quick=True), **kw})


def _setting_fields(s: TissueSetting) -> dict:
    return {f.name: getattr(s, f.name) for f in fields(s) if f.init}


# -- models --------------------------------------------------------------------------------------------------
def _grid(processes: int) -> tuple[int, int]:
    a = math.isqrt(processes)
    while processes % a:
        a -= 1
    return (a, processes // a)


class _Plain:
    """A one-process method: its model, its input transform, one logit per image."""

    def __init__(self, s: TissueSetting, method: str, lr: float) -> None:
        cnn = ContextCNN(s.width, in_channels=3)
        if method in SHRINKS:
            self.model, k = cnn, SHRINKS[method]
            self.inputs = lambda x: shrink(x, k)
            self.logit = lambda out: out[:, 1] - out[:, 0]  # two-class CE = BCE on the logit difference
        else:
            self.model = {"tilegrid": lambda: TileGridCNN(cnn, s.width, s.size // s.tile),
                          "transmil": lambda: _transmil(cnn, s),
                          "mil": lambda: TileMIL(cnn, s.width, s.abmil_dim)}[method]()
            self.inputs = lambda x: tiles(x, s.tile)
            self.logit = lambda out: out
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)

    def step(self, x, y) -> float:
        self.opt.zero_grad(set_to_none=True)
        loss = F.binary_cross_entropy_with_logits(self.logit(self.model(self.inputs(x))), y.float())
        loss.backward()
        self.opt.step()
        return loss.item()

    def score(self, x) -> torch.Tensor:
        with torch.no_grad():
            return self.logit(self.model(self.inputs(x)))

    def mode(self, train: bool) -> None:
        self.model.train(train)

    def keep(self) -> None:
        self.best = copy.deepcopy(self.model.state_dict())

    def restore(self) -> None:
        self.model.load_state_dict(self.best)

    def close(self) -> None:
        pass


def _transmil(cnn: ContextCNN, s: TissueSetting) -> nn.Module:
    from torchmil.models import TransMIL

    m = TileTransMIL.__new__(TileTransMIL)
    nn.Module.__init__(m)
    m.cnn = cnn
    m.head = TransMIL(in_shape=(s.width,), att_dim=s.transmil_dim, n_heads=s.transmil_heads,
                      n_landmarks=s.transmil_landmarks)
    return m


class _Whole:
    """The whole image on bigconv workers; the best weights kept with ``save`` and brought back with ``load``."""

    def __init__(self, s: TissueSetting, lr: float, world) -> None:
        import bigconv

        self.net = bigconv.parallelize(ContextCNN(s.width, in_channels=3), world, grid=_grid(s.processes))
        self.net.optimizer(torch.optim.Adam, lr=lr)
        self.loss_fn = nn.CrossEntropyLoss()
        self.dir = tempfile.mkdtemp(prefix="context_tissue_")
        self.path = os.path.join(self.dir, "best.pt")

    def step(self, x, y) -> float:
        return float(self.net.train_step(x, y, self.loss_fn))

    def score(self, x) -> torch.Tensor:
        with torch.no_grad():
            out = self.net(x)
        return out[:, 1] - out[:, 0]

    def mode(self, train: bool) -> None:
        self.net.train(train)

    def keep(self) -> None:
        self.net.save(self.path)

    def restore(self) -> None:
        self.net.load(self.path)

    def close(self) -> None:
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)


def _evaluate(m, images_u8: np.ndarray, y: torch.Tensor, chunk: int = 16) -> tuple[float, float]:
    """(mean log-loss, accuracy) of ``m`` on uint8 images."""
    logits = torch.cat([m.score(as_float(images_u8[i:i + chunk])) for i in range(0, len(images_u8), chunk)])
    return (float(F.binary_cross_entropy_with_logits(logits, y.float())),
            float(((logits > 0).long() == y).float().mean()))


def _score_domain(m, s: TissueSetting, task: str, domain: str) -> dict:
    data = TissueData(s.layout, task, domain)
    loss_sum, right, n = 0.0, 0, 0
    for i in range(math.ceil(s.test_images / CHUNK)):
        k = min(CHUNK, s.test_images - i * CHUNK)
        x, y, _ = data.batch(k, TEST_SEED[domain] + i)
        loss, acc = _evaluate(m, x, y)
        loss_sum, right, n = loss_sum + loss * k, right + round(acc * k), n + k
    return {"accuracy": right / n, "loss": loss_sum / n, "images": n}


LEARNT = 0.6
"""The patience rule fires only once the lowest validation loss is below this (ln 2 = 0.693 is a coin's): a run
still at chance goes on to the cap, so a late start is not cut short."""


def run_one(s: TissueSetting, task: str, method: str, seed: int, lr: float, role: str, world=None) -> dict:
    """Train with early stopping on validation loss; score the best weights on both test domains when ``role``
    is 'fresh'. The record's run-specific fields."""
    fit, val = TissueData(s.layout, task, "fit"), TissueData(s.layout, task, "val")
    xv, yv, _ = val.batch(s.val_images, VAL_SEED)
    torch.manual_seed(seed)
    m = _Whole(s, lr, world) if method == "whole" else _Plain(s, method, lr)
    best, best_step, curve, losses, train_curve, stopped = math.inf, 0, [], [], [], "max_steps"
    try:
        for step in range(1, s.max_steps + 1):
            x, y, _ = fit.batch(s.batch, seed * 1_000_003 + step)
            losses.append(m.step(as_float(x), y))
            if step % s.eval_every:
                continue
            m.mode(False)
            vl, va = _evaluate(m, xv, yv)
            m.mode(True)
            curve.append([step, round(vl, 5), round(va, 5)])
            train_curve.append(round(sum(losses[-s.eval_every:]) / s.eval_every, 5))
            if vl < best:
                best, best_step = vl, step
                m.keep()
            if step >= s.min_steps and step - best_step >= s.patience and best < LEARNT:
                stopped = "patience"
                break
        steps_run = step
        if best_step == 0:  # no evaluation happened (max_steps < eval_every): the last weights
            m.keep()
        m.restore()
        m.mode(False)
        out = {"steps_run": steps_run, "best_step": best_step, "best_val_loss": best,
               "best_val_acc": next((a for st, _, a in curve if st == best_step), None), "stopped": stopped,
               "val_curve": curve, "train_curve": train_curve}
        if role == "fresh":
            out["scores"] = {d: _score_domain(m, s, task, d) for d in DOMAINS}
        return out
    finally:
        m.close()


def _key(s: TissueSetting, task: str, method: str, seed: int, lr: float, role: str) -> tuple:
    return (task, method, role, seed, float(lr), s.size, s.tile, s.digit, float(s.dial), s.batch, s.max_steps,
            s.min_steps, s.eval_every, s.patience, s.val_images, s.test_images if role == "fresh" else None,
            s.width, s.processes if method == "whole" else 1, _arch(s, method))


def _arch(s: TissueSetting, method: str) -> str:
    if method == "transmil":
        return f"dim{s.transmil_dim}-heads{s.transmil_heads}-landmarks{s.transmil_landmarks}"
    if method == "mil":
        return f"att{s.abmil_dim}"
    if method in SHRINKS:
        return f"shrink{SHRINKS[method]}-stem4"
    return "-"


def _record_key(r: dict) -> tuple:
    return (r["task"], r["method"], r["role"], r["seed"], float(r["lr"]), r["image_size"], r["tile_size"],
            r["digit_size"], float(r["dial"]), r["batch"], r["max_steps"], r["min_steps"], r["eval_every"],
            r["patience"], r["val_images"], r["test_images"] if r["role"] == "fresh" else None, r["width"],
            r["processes"], r["arch"])


def runs_of(recs: list[dict]) -> list[dict]:
    return [r for r in recs if r.get("bench") == BENCH and r.get("record") == "run"]


def mine(s: TissueSetting, recs: list[dict]) -> list[dict]:
    """The runs of ``recs`` made under ``s``'s protocol (any lr, any seed)."""
    return [r for r in runs_of(recs) if _record_key(r) == _key(s, r["task"], r["method"], r["seed"], r["lr"],
                                                               r["role"])]


# -- learning-rate selection ---------------------------------------------------------------------------------
def _widened(grid: list[float], side: str) -> float:
    a, b = (grid[0], grid[1]) if side == "low" else (grid[-1], grid[-2])
    return float(f"{a * a / b:.3g}")


def selection(s: TissueSetting, task: str, method: str, recs: list[dict]) -> dict:
    """The grid so far of (task, method), each rate's mean best validation loss over the tuning seeds, and the
    choice: ``{"grid", "trials", "missing", "chosen_lr", "edge", "widened", "final"}``. A choice on an edge (with
    widenings left) adds the next rate on that side: the grid grows until the choice is inside it."""
    runs = [r for r in mine(s, recs) if r["task"] == task and r["method"] == method and r["role"] == "tuning"]
    grid, widened = list(s.lrs), []
    while True:
        trials, missing = [], []
        for lr in grid:
            got = {r["seed"]: r["best_val_loss"] for r in runs if r["lr"] == lr and r["seed"] in s.tune_seeds}
            missing += [(lr, k) for k in s.tune_seeds if k not in got]
            if len(got) == len(s.tune_seeds):
                trials.append({"lr": lr, "mean_best_val_loss": sum(got.values()) / len(got),
                               "best_val_loss": {str(k): v for k, v in sorted(got.items())},
                               "best_val_acc": {str(r["seed"]): r["best_val_acc"] for r in runs if r["lr"] == lr
                                                and r["seed"] in s.tune_seeds}})
        base = {"task": task, "method": method, "grid": list(grid), "trials": trials, "missing": missing,
                "widened": list(widened)}
        if missing:
            return {**base, "chosen_lr": None, "edge": None, "final": False}
        best = min(trials, key=lambda t: (t["mean_best_val_loss"], t["lr"]))["lr"]
        edge = "low" if best == grid[0] else "high" if best == grid[-1] else None
        if edge is None or len(widened) >= s.widen:
            return {**base, "chosen_lr": best, "edge": edge, "final": True}
        new = _widened(grid, edge)
        widened.append(new)
        grid = [new] + grid if edge == "low" else grid + [new]


# -- the sweep -----------------------------------------------------------------------------------------------
class _Runner:
    def __init__(self, s: TissueSetting, echo, jobs: int) -> None:
        from bigconv.harness.workload import environment

        self.s, self.echo, self.jobs, self.env, self.world = s, echo, jobs, environment(), None
        self.done = {_record_key(r) for r in runs_of(records.load(s.out))} if os.path.exists(s.out) else set()

    def run(self, items: list[tuple]) -> list[dict]:
        """Run and record every (task, method, seed, lr, role) not recorded yet."""
        s = self.s
        items = [i for i in items if _key(s, *i[:4], i[4]) not in self.done]
        if not items:
            return []
        if self.jobs == 1:
            return [self._here(*i) for i in items]
        from experiments.context_jobs import Job, run_jobs

        new: list[dict] = []
        jobs = [Job({"setting": _setting_fields(s), "task": t, "method": m, "seed": k, "lr": lr, "role": role},
                    s.processes if m == "whole" else 1, f"{t} {m} seed {k} lr {lr:g} ({role})", (t, m, k, lr, role))
                for t, m, k, lr, role in items]
        run_jobs(jobs, self.jobs, lambda job, r, _: new.append(self.record(*job.item, r)), echo=self.echo,
                 child=CHILD, cpu_timeout=RUN_CPU_TIMEOUT)
        return new

    def _here(self, task, method, seed, lr, role) -> dict:
        if method == "whole" and self.world is None:
            self.world = _world(self.s)
        t0 = time.perf_counter()
        r = run_one(self.s, task, method, seed, lr, role, self.world)
        return self.record(task, method, seed, lr, role, {**r, "train_s": time.perf_counter() - t0})

    def record(self, task, method, seed, lr, role, r: dict) -> dict:
        s, env = self.s, self.env
        rec = {"bench": BENCH, "record": "run", "task": task, "method": method, "role": role, "seed": seed,
               "lr": lr, "image_size": s.size, "tile_size": s.tile, "digit_size": s.digit, "dial": float(s.dial),
               "distance_px": s.layout.distance, "batch": s.batch, "max_steps": s.max_steps,
               "min_steps": s.min_steps, "eval_every": s.eval_every, "patience": s.patience,
               "val_images": s.val_images, "test_images": s.test_images if role == "fresh" else None,
               "width": s.width, "processes": s.processes if method == "whole" else 1,
               "grid": list(_grid(s.processes)) if method == "whole" else None, "arch": _arch(s, method),
               "shrink": SHRINKS.get(method), "optimizer": "Adam", "selected_on": "val", "quick": s.quick, **r,
               "commit": env["commit"], "commit_dirty": env["commit_dirty"], "torch": env["torch"],
               "host": socket.gethostname(), "env": env, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        records.append(s.out, rec)
        self.done.add(_record_key(rec))
        tail = " ".join(f"{d} {v['accuracy']:.3f}" for d, v in r.get("scores", {}).items())
        self.echo(f"  {task:5s} {method:8s} seed {seed:3d} lr {lr:<8g} ({role}): best val loss "
                  f"{r['best_val_loss']:.3f} at step {r['best_step']} of {r['steps_run']} ({r['stopped']}) "
                  f"{tail} ({r['train_s']:.0f}s)")
        return rec

    def close(self) -> None:
        if self.world is not None:
            self.world.close()


RUN_CPU_TIMEOUT = 4 * 3600
"""CPU seconds (its process tree's) a ``--jobs`` run may use before it is stopped and named: about 5x the costliest
run's estimate (a whole-image run to the cap, ~0.45 core-s a step). Not wall time: the sweep runs at ``nice 19`` on a
shared host and may be paused (SIGSTOP), so a run's wall time says nothing of whether it is stuck; a stuck
whole-image run is ended by its World's own wait limit (``world_timeout``)."""
CHILD = "from experiments.context_tissue import child; child()"


def _world(s: TissueSetting):
    import bigconv

    return bigconv.World(workers=s.processes, threads_per_worker=1, timeout=s.world_timeout)


def child() -> None:
    """One run of ``--jobs``: its spec as JSON on stdin, its result on stdout."""
    import json
    import sys

    from experiments.context_jobs import RESULT

    spec = json.load(sys.stdin)
    torch.set_num_threads(1)
    s = TissueSetting(**{k: tuple(v) if isinstance(v, list) else v for k, v in spec["setting"].items()})
    world = _world(s) if spec["method"] == "whole" else None
    try:
        t0 = time.perf_counter()
        r = run_one(s, spec["task"], spec["method"], spec["seed"], spec["lr"], spec["role"], world)
        r["train_s"] = time.perf_counter() - t0
    finally:
        if world is not None:
            world.close()
    print(RESULT + json.dumps(r), flush=True)


COST_ORDER = ("transmil", "whole", "tilegrid", "mil", "shrink4", "shrink8")
"""The methods from the longest run to the shortest (measured at 512²): the order runs are started in."""


def _longest_first(items: list[tuple]) -> list[tuple]:
    return sorted(items, key=lambda i: COST_ORDER.index(i[1]))


def _informative_first(items: list[tuple], s: TissueSetting) -> list[tuple]:
    """Tuning runs in the order that tells most soonest: every (task, method) at the grid's middle rate with the
    first tuning seed, then the next rate out, and so on (longest runs first within each); the records do not
    depend on the order."""
    mid = math.log(s.lrs[len(s.lrs) // 2])
    return sorted(items, key=lambda i: (round(abs(math.log(i[3]) - mid), 3), s.tune_seeds.index(i[2])
                                        if i[2] in s.tune_seeds else 0, COST_ORDER.index(i[1]), i[0]))


def sweep(s: TissueSetting, echo=print, jobs: int = 1, tuning_only: bool = False) -> list[dict]:
    """Tuning rounds until every (task, method) has its final choice (a ``selection`` record each), then every
    fresh run not yet recorded. Resumable: recorded runs are skipped."""
    run = _Runner(s, echo, jobs)
    new: list[dict] = []
    try:
        for round_ in range(s.widen + 1):
            recs = records.load(s.out) if os.path.exists(s.out) else []
            sels = [selection(s, t, m, recs) for t in s.tasks for m in s.methods]
            todo = [(sel["task"], sel["method"], k, lr, "tuning") for sel in sels for lr, k in sel["missing"]]
            if not todo:
                break
            echo(f"tuning round {round_}: {len(todo)} run(s)")
            new += run.run(_informative_first(todo, s))
        recs = records.load(s.out) if os.path.exists(s.out) else []
        chosen = {}
        for t in s.tasks:
            for m in s.methods:
                sel = selection(s, t, m, recs)
                if not sel["final"]:
                    raise RuntimeError(f"{t} {m}: the tuning is incomplete ({sel['missing']})")
                rec = {"bench": BENCH, "record": "selection", **{k: v for k, v in sel.items() if k != "missing"},
                       "tune_seeds": list(s.tune_seeds), "selected_on": "val",
                       "criterion": "mean over the tuning seeds of the lowest validation loss", **_protocol(s)}
                if not any(r.get("record") == "selection" and {**r, "time": None} == {**rec, "time": None}
                           for r in recs if r.get("bench") == BENCH):
                    records.append(s.out, {**rec, "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
                    echo(f"  {t} {m}: lr {sel['chosen_lr']:g} of {sel['grid']}" +
                         (f" (still on the {sel['edge']} edge after {s.widen} widenings)" if sel["edge"] else ""))
                chosen[t, m] = sel["chosen_lr"]
        if tuning_only:
            return new
        fresh = [(t, m, k, chosen[t, m], "fresh") for k in s.seeds for t in s.tasks for m in s.methods]
        echo(f"fresh runs: {len(fresh)} of {s.out}")
        # Seed by seed, so that a sweep cut short holds whole seeds of every cell; the longest runs first.
        new += run.run(sorted(fresh, key=lambda i: (i[2], COST_ORDER.index(i[1]))))
    finally:
        run.close()
    return new


def _protocol(s: TissueSetting) -> dict:
    return {"image_size": s.size, "tile_size": s.tile, "digit_size": s.digit, "dial": float(s.dial),
            "batch": s.batch, "max_steps": s.max_steps, "min_steps": s.min_steps, "eval_every": s.eval_every,
            "patience": s.patience, "val_images": s.val_images, "width": s.width}


# -- statistics ----------------------------------------------------------------------------------------------
def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the given order."""
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    out, running = [0.0] * len(pvalues), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(pvalues) - rank) * pvalues[i]))
        out[i] = running
    return out


def sign_flip_p(diffs: list[float]) -> float:
    """Exact two-sided sign-flip permutation p of the mean of paired differences (all 2^n sign patterns)."""
    d = np.asarray(diffs, dtype=np.float64)
    n = len(d)
    signs = ((np.arange(2 ** n)[:, None] >> np.arange(n)) & 1) * 2 - 1
    stats = np.abs(signs @ d)
    return float(np.mean(stats >= abs(d.sum()) - 1e-12))


def paired_test(a: dict[int, float], b: dict[int, float]) -> dict | None:
    """Paired by seed: mean difference, 95% t-interval, paired t-test p, exact sign-flip p."""
    from scipy import stats

    seeds = sorted(set(a) & set(b))
    if len(seeds) < 2:
        return None
    d = np.array([a[k] - b[k] for k in seeds])
    mean, sd = float(d.mean()), float(d.std(ddof=1))
    half = float(stats.t.ppf(0.975, len(d) - 1)) * sd / math.sqrt(len(d))
    p_t = float(stats.ttest_1samp(d, 0.0).pvalue) if sd > 0 else (0.0 if mean != 0 else 1.0)
    return {"n": len(d), "mean": mean, "low": mean - half, "high": mean + half, "p_t": p_t,
            "p_signflip": sign_flip_p(d.tolist())}


def fresh_scores(s: TissueSetting, recs: list[dict], domain: str) -> dict[tuple[str, str], dict[int, float]]:
    """(task, method) -> seed -> accuracy on ``domain`` of the fresh runs at the final chosen rate."""
    out: dict[tuple[str, str], dict[int, float]] = {}
    for t in s.tasks:
        for m in s.methods:
            sel = selection(s, t, m, recs)
            if not sel["final"]:
                continue
            out[t, m] = {r["seed"]: r["scores"][domain]["accuracy"] for r in mine(s, recs)
                         if r["task"] == t and r["method"] == m and r["role"] == "fresh" and r["lr"] ==
                         sel["chosen_lr"] and r["seed"] in s.seeds}
    return out


def comparisons(s: TissueSetting, recs: list[dict], domain: str) -> list[dict]:
    """Every comparison of ``COMPARISONS`` that has paired seeds, Holm-corrected over those of this domain (the
    paired t-test's p; the family is every named comparison, a missing one counted as p = 1)."""
    acc = fresh_scores(s, recs, domain)
    rows = []
    for task, m in COMPARISONS:
        got = paired_test(acc.get((task, "whole"), {}), acc.get((task, m), {})) if task in s.tasks else None
        rows.append({"task": task, "method": m, "domain": domain, **(got or {"n": 0, "p_t": 1.0})})
    for row, adj in zip(rows, holm([r["p_t"] for r in rows])):
        row["p_holm"] = adj
    return rows


IMPROVING = 600
"""A run that reached the cap with its lowest validation loss in its last this many steps was still improving."""


def still_improving(r: dict) -> bool:
    return r["stopped"] == "max_steps" and r["best_step"] > r["steps_run"] - IMPROVING and \
        r["best_val_loss"] < LEARNT


def report(s: TissueSetting, recs: list[dict]) -> list[str]:
    from multidsn.intervals import interval

    lines = []
    for t in s.tasks:
        lines += [f"selections, task {t} (mean over seeds {list(s.tune_seeds)} of the lowest validation loss; "
                  "validation accuracy at it):", "", "| method | grid | per rate | chosen | edge |",
                  "|---|---|---|---|---|"]
        for m in s.methods:
            sel = selection(s, t, m, recs)
            per = ", ".join(f"{tr['lr']:g}: {tr['mean_best_val_loss']:.3f} (" + "/".join(
                f"{a:.2f}" for a in tr["best_val_acc"].values() if a is not None) + ")" for tr in sel["trials"])
            chosen = "" if sel["chosen_lr"] is None else f"{sel['chosen_lr']:g}"
            edge = (f"{sel['edge']} (widened {sel['widened']})" if sel["edge"] else
                    f"inside (widened {sel['widened']})" if sel["widened"] else "inside") if sel["final"] else \
                f"{len(sel['missing'])} trial(s) missing"
            lines.append(f"| {m} | {', '.join(f'{v:g}' for v in sel['grid'])} | {per} | {chosen} | {edge} |")
        lines.append("")
    for domain in DOMAINS:
        acc = fresh_scores(s, recs, domain)
        lines += [f"test accuracy, {domain} ({s.test_images} images per run), mean [95% interval] (n seeds):", "",
                  "| task | " + " | ".join(s.methods) + " |", "|---" * (len(s.methods) + 1) + "|"]
        for t in s.tasks:
            cells = []
            for m in s.methods:
                a = list(acc.get((t, m), {}).values())
                if not a:
                    cells.append("")
                    continue
                iv = interval(a)
                cells.append(f"{iv.mean:.3f} [{iv.low:.3f}, {iv.high:.3f}] (n={len(a)})" if iv.low is not None
                             else f"{iv.mean:.3f} (n={len(a)})")
            lines.append(f"| {t} | " + " | ".join(cells) + " |")
        lines += ["", f"whole minus each alternative, {domain}, paired by seed: mean [95% t-interval], paired t p, "
                  "exact sign-flip p, Holm-adjusted p (paired t, over the 10 named comparisons of this domain):", "",
                  "| task | whole - | n | difference | p (t) | p (sign-flip) | p (Holm) |",
                  "|---|---|---|---|---|---|---|"]
        for c in comparisons(s, recs, domain):
            if not c["n"]:
                lines.append(f"| {c['task']} | {c['method']} | 0 | | | | |")
                continue
            lines.append(f"| {c['task']} | {c['method']} | {c['n']} | {c['mean']:+.3f} [{c['low']:+.3f}, "
                         f"{c['high']:+.3f}] | {c['p_t']:.4f} | {c['p_signflip']:.4f} | {c['p_holm']:.4f} |")
        lines.append("")
    runs = mine(s, recs)
    if runs:
        capped = [r for r in runs if r["stopped"] == "max_steps"]
        lines.append(f"{len(runs)} runs; {len(capped)} reached the step cap ({s.max_steps}) without the patience "
                     f"rule firing, {sum(still_improving(r) for r in runs)} of them still improving (their lowest "
                     f"validation loss in the last {IMPROVING} steps); training took "
                     f"{sum(r['train_s'] for r in runs) / 3600:.2f} h of run time in all (a whole-image run holds "
                     f"{s.processes} cores)")
        for t in s.tasks:
            cell = {m: [r for r in runs if r["task"] == t and r["method"] == m] for m in s.methods}
            lines.append(f"  {t}, per method: runs still improving at the cap / never below {LEARNT} validation loss "
                         "/ runs: " + ", ".join(f"{m} {sum(map(still_improving, c))}/"
                                                f"{sum(r['best_val_loss'] >= LEARNT for r in c)}/{len(c)}"
                                                for m, c in cell.items()))
    ctl = [r for r in recs if r.get("bench") == BENCH and r.get("record") == "control"]
    for r in ctl:
        lines.append(f"colour-histogram control, task {r['task']}: test accuracy {r['accuracy']:.3f} (coin's 95% band "
                     f"{r['chance_band'][0]:.3f}-{r['chance_band'][1]:.3f}, {r['n_train']} training images, training "
                     f"accuracy {r['train_accuracy']:.3f})")
    return lines


def run_control(s: TissueSetting, n_train: int = 2000, n_test: int = 1000) -> list[dict]:
    from bigconv.harness.workload import environment

    env, out = environment(), []
    for t in s.tasks:
        r = colour_control(s.layout, t, n_train, n_test)
        rec = {"bench": BENCH, "record": "control", "task": t, **r, **_protocol(s), "commit": env["commit"],
               "commit_dirty": env["commit_dirty"], "torch": env["torch"], "host": socket.gethostname(),
               "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        records.append(s.out, rec)
        out.append(rec)
    return out


def time_methods(s: TissueSetting, steps: int = 20, echo=print) -> list[dict]:
    """CPU seconds per training step and per validation image of every method (the run's process and its World's
    workers), after one warm-up step: what the sweep's size and step cap were chosen from. Trains nothing kept."""
    import psutil

    me, out, world = psutil.Process(), [], None

    def cpu() -> float:
        total = sum(me.cpu_times()[:2])
        for c in me.children(recursive=True):
            try:
                total += sum(c.cpu_times()[:2])
            except psutil.NoSuchProcess:
                pass
        return total

    fit = TissueData(s.layout, s.tasks[0], "fit")
    try:
        for m in s.methods:
            if m == "whole" and world is None:
                world = _world(s)
            torch.manual_seed(0)
            run = _Whole(s, 1e-3, world) if m == "whole" else _Plain(s, m, 1e-3)
            x, y, _ = fit.batch(s.batch, 0)
            run.step(as_float(x), y)
            c0, t0 = cpu(), time.perf_counter()
            for i in range(steps):
                x, y, _ = fit.batch(s.batch, i + 1)
                run.step(as_float(x), y)
            c1, t1 = cpu(), time.perf_counter()
            run.mode(False)
            xv, yv, _ = fit.batch(32, 999)
            _evaluate(run, xv, yv)
            c2 = cpu()
            run.close()
            out.append({"method": m, "cpu_s_per_step": (c1 - c0) / steps, "wall_s_per_step": (t1 - t0) / steps,
                        "cpu_s_per_val_image": (c2 - c1) / 32, "load_average": os.getloadavg()[0]})
            echo(f"{m:8s} {out[-1]['cpu_s_per_step']:.3f} core-s per step of {s.batch} "
                 f"({out[-1]['wall_s_per_step']:.2f} s wall), {out[-1]['cpu_s_per_val_image']:.4f} core-s per "
                 f"validation image, load average {out[-1]['load_average']:.1f}")
    finally:
        if world is not None:
            world.close()
    return out


COMMITTED = "results/context_tissue.jsonl"


def _names(text: str) -> tuple[str, ...]:
    return tuple(t for t in text.split(",") if t)


def _ints(text: str) -> tuple[int, ...]:
    if "-" in text and "," not in text:
        lo, hi = (int(t) for t in text.split("-", 1))
        return tuple(range(lo, hi + 1))
    return tuple(int(t) for t in text.split(",") if t)


def main(argv=None) -> None:
    parser = cli.parser("experiments.context --tissue", __doc__)
    parser.add_argument("--quick", action="store_true",
                        help="256² smoke run of every method, 6 steps (a minute or two)")
    parser.add_argument("--size", type=int, help="image edge (default 512)")
    parser.add_argument("--tile", type=int, help="tile edge (default 64)")
    parser.add_argument("--tasks", type=_names, help=f"of {','.join(TISSUE_TASKS)} (default both)")
    parser.add_argument("--methods", type=_names, help=f"of {','.join(METHODS)} (default all)")
    parser.add_argument("--seeds", type=_ints, help="fresh seeds (default 0-7)")
    parser.add_argument("--max-steps", type=int, dest="max_steps", help="step cap (default: the protocol's)")
    parser.add_argument("--out", help=f"records (default runs/context_tissue.jsonl; with --report, {COMMITTED})")
    parser.add_argument("--jobs", type=int, default=1, help="cores kept busy with runs side by side (a whole-image "
                        "run takes --processes of them)")
    parser.add_argument("--tuning-only", action="store_true", dest="tuning_only", help="stop after the selections")
    parser.add_argument("--control", action="store_true", help="record the colour-histogram control and stop")
    parser.add_argument("--time", action="store_true", help="print every method's CPU time per step and per "
                        "validation image (20 steps each, nothing recorded) and stop")
    parser.add_argument("--report", action="store_true", help="train nothing: print the tables from --out")
    parser.add_argument("--figure", help="figure path stem (default context_tissue[_quick] beside a given --out, "
                        "else in figures/)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    given = {k: v for k, v in vars(args).items() if k in ("size", "tile", "tasks", "methods", "seeds", "max_steps",
                                                          "out") and v is not None}
    if args.report and args.out is None and not args.quick:
        given["out"] = COMMITTED
    s = (quick_setting if args.quick else TissueSetting)(**given)
    torch.set_num_threads(1)
    if args.time:
        time_methods(s)
        return
    if args.control:
        for r in run_control(s, *((64, 64) if s.quick else ())):
            print(f"control {r['task']}: {r['accuracy']:.3f} (band {r['chance_band']})")
        return
    if not args.report:
        t0 = time.perf_counter()
        sweep(s, jobs=args.jobs, tuning_only=args.tuning_only)
        log.info("sweep: %.0f s this sitting", time.perf_counter() - t0)
    recs = records.load(s.out) if os.path.exists(s.out) else []
    print("\n".join(report(s, recs)))
    from plots import context_tissue as plot

    name = "context_tissue_quick" if s.quick else "context_tissue"
    stem = args.figure or os.path.join(os.path.dirname(args.out) if args.out else "figures", name)
    chosen = {(t, m): selection(s, t, m, recs)["chosen_lr"] for t in s.tasks for m in s.methods}
    for p in plot.draw_accuracy(mine(s, recs), stem, chosen) + plot.draw_curves(mine(s, recs), f"{stem}_curves"):
        print(p)

