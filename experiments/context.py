"""Does whole-image training pay? A context benchmark: whole image (bigconv) vs tiles (MIL) vs shrunk.

    python -m experiments.context --quick      # 128² images, 1 seed, 2 dials: a smoke run (< 1 minute)
    python -m experiments.context              # 1024² images, 3 seeds x 4 dials x 3 methods -> results/context.jsonl
    python -m experiments.context --report     # the table and figure from the saved records, training nothing

The data (``experiments.context_data``): two 8-pixel real MNIST digits, a 6 and a 9, ``dial`` tiles
apart on one row of a black image; the label is whether the 6 is left of the 9. Three ways to train
the same CNN (``ContextCNN``: a patchify stem, three conv+BatchNorm+max-pool levels, four dilated
convolutions, a global max pool, a linear head; its receptive field spans the full-size image):

- ``whole``: the whole image, on a local ``bigconv.World`` of ``--processes`` workers (grid 2x2 for 4),
  through the public API only (``World``, ``parallelize``, ``optimizer``, ``train_step``, ``net(x)``).
- ``mil``: the image cut into ``tile``-pixel tiles; the same CNN (without its head) embeds each tile
  and ``torchmil``'s attention-MIL head (``ABMIL``) pools the bag; trained end to end.
- ``downsampled``: the same CNN on the image shrunk ``--shrink`` times per side (default: the square
  root of the process count, so the shrunk image has the pixels one whole-image process holds).

Every method gets the same initial trunk weights, the same training images in the same order
(batch ``s`` of seed ``k`` is drawn from seed ``k * 1_000_003 + s``), the same number of Adam steps,
and is scored on the same held-out images made from test digits (never seen in training).
Each (method, dial, seed) run appends its record when it ends; a rerun skips recorded runs, so the
full sweep may span several sittings. The figure is drawn from the saved records
(``python -m plots.context``).
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from bigconv.harness import records
from experiments.context_data import CLASSES, ContextData, Layout, shrink, tiles
from experiments.context_models import ContextCNN, TileMIL
from bigconv.harness import cli

log = logging.getLogger(__name__)

METHODS = ("whole", "mil", "downsampled")


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
    methods: tuple[str, ...] = METHODS
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
    out: str = "results/context.jsonl"
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
        if not self.dials:
            raise ValueError("give at least one dial")
        # Every dial is laid out (and so checked) before anything trains.
        self.layouts = [Layout(size=self.size, tile=self.tile, dial=d, digit=self.digit) for d in self.dials]


def quick_setting(**kw) -> Setting:
    return Setting(**{**dict(size=128, tile=32, dials=(0.5, 2.5), seeds=(0,), steps=6, batch=4, test_images=16,
                             out="results/context_quick.jsonl", quick=True), **kw})


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


def run_whole(s: Setting, layout: Layout, seed: int, world) -> dict:
    import bigconv

    torch.manual_seed(seed)
    grid = _grid(s.processes)
    net = bigconv.parallelize(ContextCNN(s.width), world, grid=grid)
    net.optimizer(torch.optim.Adam, lr=s.lr)
    loss_fn = nn.CrossEntropyLoss()
    loss = None
    for x, y in _batches(ContextData(layout, train=True), s, seed):
        loss = net.train_step(x, y, loss_fn)
    net.eval()
    xt, yt, _ = ContextData(layout, train=False).batch(s.test_images, _TEST_SEED)
    acc = _accuracy(lambda x: net(x).argmax(1), xt, yt)
    return {"accuracy": acc, "train_loss_last": _last(loss), "processes": s.processes, "grid": list(grid),
            "input_size": s.size}


def run_mil(s: Setting, layout: Layout, seed: int) -> dict:
    torch.manual_seed(seed)
    cnn = ContextCNN(s.width)
    model = TileMIL(cnn, s.width)
    opt = torch.optim.Adam(model.parameters(), lr=s.lr)
    loss = None
    for x, y in _batches(ContextData(layout, train=True), s, seed):
        opt.zero_grad(set_to_none=True)
        loss = F.binary_cross_entropy_with_logits(model(tiles(x, s.tile)), y.float())
        loss.backward()
        opt.step()
    model.eval()
    xt, yt, _ = ContextData(layout, train=False).batch(s.test_images, _TEST_SEED)
    acc = _accuracy(lambda x: (model(tiles(x, s.tile)) > 0).long(), xt, yt)
    return {"accuracy": acc, "train_loss_last": _last(loss), "processes": 1, "grid": None, "input_size": s.tile,
            "bag_size": (s.size // s.tile) ** 2, "mil_head": "torchmil.models.ABMIL"}


def run_downsampled(s: Setting, layout: Layout, seed: int) -> dict:
    torch.manual_seed(seed)
    model = ContextCNN(s.width)
    opt = torch.optim.Adam(model.parameters(), lr=s.lr)
    loss = None
    for x, y in _batches(ContextData(layout, train=True), s, seed):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(shrink(x, s.shrink)), y)
        loss.backward()
        opt.step()
    model.eval()
    xt, yt, _ = ContextData(layout, train=False).batch(s.test_images, _TEST_SEED)
    acc = _accuracy(lambda x: model(shrink(x, s.shrink)).argmax(1), xt, yt)
    return {"accuracy": acc, "train_loss_last": _last(loss), "processes": 1, "grid": None,
            "input_size": s.size // s.shrink, "shrink": s.shrink}


_TEST_SEED = 987_654_321
"""Seed of the held-out images (test digits): the same for every method and training seed."""


def _grid(processes: int) -> tuple[int, int]:
    a = math.isqrt(processes)
    while processes % a:
        a -= 1
    return (a, processes // a)


def _key(s: Setting, method: str, dial: float, seed: int) -> tuple:
    return (method, float(dial), seed, s.size, s.tile, s.digit, s.steps, s.batch, s.lr, s.width, s.test_images,
            s.processes if method == "whole" else 1, s.shrink if method == "downsampled" else None)


def _record_key(r: dict) -> tuple:
    return (r["method"], float(r["dial"]), r["seed"], r["image_size"], r["tile_size"], r["digit_size"], r["steps"],
            r["batch"], r["lr"], r["width"], r["test_images"], r["processes"], r.get("shrink"))


def recorded(path: str) -> set[tuple]:
    """Keys of the runs already in ``path`` (a rerun skips them)."""
    return {_record_key(r) for r in records.load(path) if r.get("bench") == "context"} if os.path.exists(path) \
        else set()


def sweep(s: Setting, echo=print) -> list[dict]:
    """Run every (dial, seed, method) of ``s`` not yet recorded in ``s.out``; the new records."""
    from bigconv.harness.workload import environment

    env = environment()
    done = recorded(s.out)
    # Seed by seed, so that a sweep cut short has whole seeds of every dial and method.
    todo = [(layout, seed, m) for seed in s.seeds for layout in s.layouts for m in s.methods
            if _key(s, m, layout.dial, seed) not in done]
    echo(f"context sweep: {len(todo)} run(s) to do, {len(s.layouts) * len(s.seeds) * len(s.methods) - len(todo)} "
         f"already in {s.out}")
    if not todo:
        return []
    new: list[dict] = []
    world = None
    try:
        if any(m == "whole" for _, _, m in todo):
            import bigconv

            world = bigconv.World(workers=s.processes, threads_per_worker=1)
        for layout, seed, method in todo:
            t0 = time.perf_counter()
            if method == "whole":
                r = run_whole(s, layout, seed, world)
            elif method == "mil":
                r = run_mil(s, layout, seed)
            else:
                r = run_downsampled(s, layout, seed)
            rec = {"bench": "context", "method": method, "dial": float(layout.dial), "seed": seed,
                   "accuracy": r.pop("accuracy"), "image_size": s.size, "tile_size": s.tile, "digit_size": s.digit,
                   "distance_px": layout.distance, "processes": r.pop("processes"), "steps": s.steps,
                   "batch": s.batch, "lr": s.lr, "optimizer": "Adam", "width": s.width, "test_images": s.test_images,
                   "shrink": s.shrink if method == "downsampled" else None, "rule": f"label 1 iff the {CLASSES[0]} "
                   f"is left of the {CLASSES[1]}", "quick": s.quick, **r, "train_s": time.perf_counter() - t0,
                   "commit": env["commit"], "commit_dirty": env["commit_dirty"], "torch": env["torch"], "env": env,
                   "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
            records.append(s.out, rec)
            new.append(rec)
            echo(f"  {method:12s} dial {layout.dial:<5g} seed {seed}: accuracy {rec['accuracy']:.3f} "
                 f"({rec['train_s']:.0f}s)")
    finally:
        if world is not None:
            world.close()
    return new


def table(recs: list[dict]) -> list[str]:
    """Mean accuracy (min-max over seeds) per dial and method, as markdown."""
    dials = sorted({r["dial"] for r in recs})
    methods = [m for m in METHODS if any(r["method"] == m for r in recs)]
    rows = ["| dial (tiles) | distance (px) | " + " | ".join(methods) + " |", "|---" * (len(methods) + 2) + "|"]
    for d in dials:
        cells = []
        for m in methods:
            a = [r["accuracy"] for r in recs if r["dial"] == d and r["method"] == m]
            cells.append(f"{sum(a) / len(a):.3f} ({min(a):.2f}-{max(a):.2f}, n={len(a)})" if a else "")
        dist = next(r["distance_px"] for r in recs if r["dial"] == d)
        rows.append(f"| {d:g} | {dist} | " + " | ".join(cells) + " |")
    return rows


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(t) for t in text.split(",") if t)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(t) for t in text.split(",") if t)


def main(argv=None) -> None:
    parser = cli.parser("experiments.context", __doc__)
    parser.add_argument("--quick", action="store_true", help="128² images, 1 seed, 2 dials, 6 steps")
    parser.add_argument("--size", type=int, help="image edge (default: the scale's)")
    parser.add_argument("--tile", type=int, help="tile edge of the MIL baseline (default: the scale's)")
    parser.add_argument("--digit", type=int, help="edge of each MNIST digit pasted in (default: the scale's)")
    parser.add_argument("--dials", type=_floats, help="comma-separated, in tiles")
    parser.add_argument("--seeds", type=_ints, help="seeds, comma-separated or a range like 0-2 (default: the scale's)")
    parser.add_argument("--methods", type=lambda t: tuple(t.split(",")),
                        help="comma-separated methods to train (default: all)")
    parser.add_argument("--steps", type=int, help="training steps per run (default: the scale's)")
    parser.add_argument("--batch", type=int, help="images per step (default: the scale's)")
    parser.add_argument("--lr", type=float, help="learning rate (default: the scale's)")
    parser.add_argument("--test-images", type=int, dest="test_images",
                        help="held-out images per run (default: the scale's)")
    parser.add_argument("--processes", type=int, help="bigconv workers (default: the scale's)")
    parser.add_argument("--shrink", type=int, help="edge the shrunk-image baseline trains on (default: the scale's)")
    parser.add_argument("--out", help="results file (default results/context[_quick].jsonl)")
    parser.add_argument("--figure", default=None, help="figure path stem (default figures/context[_quick])")
    parser.add_argument("--report", action="store_true", help="train nothing: print the table and draw the figure "
                        "from the records already in --out")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    given = {k: v for k, v in vars(args).items() if k not in ("quick", "figure", "report") and v is not None}
    s = quick_setting(**given) if args.quick else Setting(**given)  # every layout is checked here
    torch.set_num_threads(1)
    if not args.report:
        t0 = time.perf_counter()
        sweep(s)
        log.info("sweep: %.0f s this sitting", time.perf_counter() - t0)
    mine = [r for r in (records.load(s.out) if os.path.exists(s.out) else []) if r.get("bench") == "context"
            and r["image_size"] == s.size and r["tile_size"] == s.tile and r["steps"] == s.steps
            and r["dial"] in s.dials and r["seed"] in s.seeds and r["method"] in s.methods]
    total = sum(r["train_s"] for r in mine)
    print(f"{len(mine)} of {len(s.layouts) * len(s.seeds) * len(s.methods)} runs recorded; "
          f"their training took {total / 60:.1f} min in all")
    print("\n".join(table(mine)))
    from plots import context as plot

    stem = args.figure or ("figures/context_quick" if s.quick else "figures/context")
    for p in plot.draw(mine, stem, title=f"{s.size}² images, {s.tile}² tiles, {s.digit}-px digits, "
                                          f"{s.steps} steps x {s.batch}"):
        print(p)


if __name__ == "__main__":
    main()
