"""What a one-device user would do instead of bigconv: memory, time and exactness side by side.

    python -m experiments.alternatives --quick     # 128² image: a smoke run (about 2 minutes on 2 cores)
    python -m experiments.alternatives             # 2048², 1 GiB searches -> results/alternatives.jsonl

One CNN every row can run: ``bigconv.models.CNN2D`` (``--depth`` conv+ReLU blocks of ``--width``
channels at full resolution, global average pooling, a linear head), float32, one image, SGD with
momentum, 1 intra-op thread per process. Rows (``method``):

- ``plain``: PyTorch in one process.
- ``checkpoint``: the same, each conv+ReLU block under ``torch.utils.checkpoint.checkpoint``
  (``use_reentrant=False``).
- ``offload``: the same under ``torch.autograd.graph.save_on_cpu()``. On a CPU-only host the saved
  tensors are already on the CPU, so this row can only equal ``plain``: it is here for GPU runs.
- ``streaming``: ``lightstream``'s ``StreamingCNN`` streams the conv trunk tile by tile (``--tile``,
  ``copy_to_gpu=False``, mean 0 / std 1 given on the CPU, no normalization); the head runs on the
  reassembled feature map and its gradient is streamed back.
- ``bigconv_driver``: a local ``bigconv.World`` of 2 and 4 workers (the driver holds no shard).
- ``bigconv_spmd``: 2 and 4 SPMD ranks (``bigconv.spmd``, halos by point-to-point).
- ``bigconv_checkpoint``: 4 driver-mode workers, the model's blocks checkpointed as in ``checkpoint``.

Columns (one record per row in ``--out``):

- ``peak_bytes``: the largest per-process peak at ``--size`` (resident memory above the warm
  baseline, ``bigconv.memory.PeakMeter``; the driver of the driver mode counted too), each row in
  fresh processes.
- ``step_s``: the median over ``--rounds`` of each round's best step at ``--size``; the rows run
  interleaved, round by round, in one invocation (this host drifts by 10-20% over minutes).
- ``max_edge_1gib``: the largest square edge whose step fits ``--budget`` per process, by
  ``experiments.maxsize.search`` (predict, bracket, bisect; every probe in fresh processes, recorded
  in ``--probes``).
- ``rel_err``: the largest relative difference ``|w - w_plain| / |w_plain|`` over the parameter
  tensors after 2 SGD-momentum steps against plain PyTorch, in float64 at ``--check-size``
  (streaming on 2x2 tiles of it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn as nn

from bigconv.harness import records
from bigconv.harness.runner import MARK, ROOT, RunConfig, classify, describe, fresh_process
from bigconv.memory import PeakMeter
from bigconv.harness import cli

GiB = 2**30
MiB = 2**20
SINGLE = ("plain", "checkpoint", "offload", "streaming")
METHODS = SINGLE + ("bigconv_driver", "bigconv_spmd", "bigconv_checkpoint")
ROWS = (("plain", 1), ("checkpoint", 1), ("offload", 1), ("streaming", 1), ("bigconv_driver", 2),
        ("bigconv_driver", 4), ("bigconv_spmd", 2), ("bigconv_spmd", 4), ("bigconv_checkpoint", 4))


@dataclass(kw_only=True)
class AltConfig(RunConfig):
    """One row at one size: ``RunConfig`` (so ``experiments.maxsize.search`` can drive it) plus the method."""

    method: str = "plain"
    """One of ``METHODS``."""
    tile: int | None = None
    """``streaming`` only: the streamed tile's edge."""
    check_size: int | None = None
    """Edge of the float64 exactness check run after the measurement; None: no check (size probes)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {list(METHODS)}, got {self.method!r}")
        if (self.method in SINGLE) != (self.workers == 0):
            raise ValueError(f"{self.method}: workers must be 0 for a single-process method and > 0 for bigconv")
        if self.method == "streaming" and not self.tile:
            raise ValueError("streaming needs a tile size")


def check_sizes(size: int, tile: int, check_size: int, depth: int, budget: int) -> None:
    """Refuse sizes that cannot be laid out, naming the limit, before anything runs."""
    for name, v in (("size", size), ("tile", tile), ("check size", check_size), ("depth", depth),
                    ("budget", budget)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if tile > size:
        raise ValueError(f"streaming tile {tile} is larger than the image {size}: it must be at most {size}")
    halo = depth  # a 3x3 conv per block: the tile must hold more than its lost border on each side
    if tile <= 4 * halo:
        raise ValueError(f"streaming tile {tile} is too small for {depth} 3x3 layers: it must exceed {4 * halo}")
    if check_size // 2 <= 4 * halo:
        raise ValueError(f"check size {check_size} is too small: streaming is checked on 2x2 tiles, which must "
                         f"exceed {4 * halo} pixels, so it must be at least {8 * halo + 2}")


# ---------------------------------------------------------------------------------------------- models


class Checkpointed(nn.Module):
    """``CNN2D`` with each conv+ReLU block recomputed in backward (``torch.utils.checkpoint``)."""

    def __init__(self, cnn: nn.Module) -> None:
        super().__init__()
        self.cnn = cnn
        mods = list(cnn.features)
        self.blocks = [nn.Sequential(*mods[i:i + 2]) for i in range(0, len(mods), 2)]

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.cnn.head(self.cnn.pool(x))


def _build(cfg: AltConfig, size: int, dtype: torch.dtype, seed: int = 0):
    from bigconv.models import CNN2D

    torch.manual_seed(seed)
    model = CNN2D(in_channels=1, num_classes=2, width=cfg.width, depth=cfg.depth).to(dtype)
    x = torch.randn(cfg.batch, 1, size, size, dtype=dtype)
    y = torch.arange(cfg.batch) % 2
    return model, x, y


# ---------------------------------------------------------------------------------- one-process steps


class _Single:
    """A single-process method's training step, built on ``model``."""

    def __init__(self, method: str, model: nn.Module, x: torch.Tensor, tile: int | None) -> None:
        self.method, self.model = method, model
        self.loss_fn = nn.CrossEntropyLoss()
        self.net = Checkpointed(model) if method == "checkpoint" else model
        if method == "streaming":
            from bigconv.compat import allow_torchvision_without_ops

            allow_torchvision_without_ops()  # lightstream imports lightning, which imports torchvision
            from lightstream.core.scnn.scnn import StreamingCNN

            for m in model.features:  # lightstream's hooks forbid in-place ops on their outputs; same values
                if isinstance(m, nn.ReLU):
                    m.inplace = False
            c = x.shape[1]
            self.stream = StreamingCNN(model.features, tile_shape=(1, c, tile, tile), copy_to_gpu=False,
                                       statistics_on_cpu=False, normalize_on_gpu=False, verbose=False,
                                       mean=torch.zeros(c, 1, 1, dtype=x.dtype), std=torch.ones(c, 1, 1, dtype=x.dtype))
            model.features = self.stream.stream_module  # the streaming copy holds the trained weights
        self.opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.opt.zero_grad(set_to_none=True)
        if self.method == "streaming":
            with torch.no_grad():
                fmap = self.stream.forward(x)
            fmap.requires_grad_(True)
            loss = self.loss_fn(self.model.head(self.model.pool(fmap)), y)
            loss.backward()
            self.stream.backward(x, fmap.grad)
        elif self.method == "offload":
            with torch.autograd.graph.save_on_cpu(pin_memory=False):
                loss = self.loss_fn(self.net(x), y)
                loss.backward()
        else:
            loss = self.loss_fn(self.net(x), y)
            loss.backward()
        self.opt.step()
        return loss.item()


def _timed(step, x, y, steps: int) -> list[float]:
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        step(x, y)
        if i:
            times.append(time.perf_counter() - t0)
    return times


def _single(cfg: AltConfig) -> dict:
    dtype = getattr(torch, cfg.dtype)
    tiny = max(4 * cfg.depth + 8, 32)
    m, x, y = _build(cfg, tiny, dtype)
    _Single(cfg.method, m, x, min(cfg.tile or tiny, tiny)).step(x, y)  # pages in kernels and pools
    del m, x, y
    model, x, y = _build(cfg, cfg.size, dtype)
    meter = PeakMeter("cpu")
    run = _Single(cfg.method, model, x, cfg.tile)
    times = _timed(run.step, x, y, cfg.steps)
    mem = meter.read()
    return {"grid": None, "step_s": min(times) if times else None, "step_times_s": times,
            "per_worker": [mem], "peak_bytes_max": mem["peak_bytes"], "driver_peak_bytes": None}


# ------------------------------------------------------------------------------------------- bigconv


def _driver(cfg: AltConfig, world) -> dict:
    import bigconv
    from bigconv.harness.workload import reset_worker_memory, worker_memory

    dtype = getattr(torch, cfg.dtype)
    wrap = Checkpointed if cfg.method == "bigconv_checkpoint" else (lambda m: m)
    m, x, y = _build(cfg, max(4 * cfg.depth + 8, 32), dtype)
    warm = bigconv.parallelize(wrap(m), world)
    warm.optimizer(torch.optim.SGD, lr=0.01, momentum=0.9)
    warm.train_step(x, y, nn.CrossEntropyLoss())
    del warm, m
    model, x, y = _build(cfg, cfg.size, dtype)
    reset_worker_memory(world)
    meter = PeakMeter("cpu")
    net = bigconv.parallelize(wrap(model), world)
    net.optimizer(torch.optim.SGD, lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    times = _timed(lambda a, b: net.train_step(a, b, loss_fn), x, y, cfg.steps)
    driver = meter.read()
    per = worker_memory(world)
    grid = list(net.plan(x).grid)
    peaks = [p["peak_bytes"] for p in per] + [driver["peak_bytes"]]
    return {"grid": grid, "step_s": min(times) if times else None, "step_times_s": times, "per_worker": per,
            "peak_bytes_max": max(peaks), "driver_peak_bytes": driver["peak_bytes"]}


def _spmd(cfg: AltConfig) -> dict:
    from bigconv.harness.spmd_workload import train_spmd
    from bigconv.harness.workload import Workload

    w = Workload(model="cnn2d", size=cfg.size, batch=cfg.batch, width=cfg.width, depth=cfg.depth, dtype=cfg.dtype,
                 steps=cfg.steps)
    r = train_spmd(w, cfg.workers, threads=1, timeout=0.95 * cfg.timeout_s)
    per = r["per_rank"]
    return {"grid": r["grid"], "step_s": r["step_s"], "step_times_s": r["step_times_s"], "per_worker": per,
            "peak_bytes_max": max(p["peak_bytes"] for p in per), "driver_peak_bytes": None}


# ---------------------------------------------------------------------------------------- exactness


def _weights_after_two_steps(cfg: AltConfig, world=None) -> list[torch.Tensor]:
    """Parameters (in ``CNN2D.parameters()`` order) after 2 float64 SGD-momentum steps at ``check_size``."""
    # Streaming is checked on 2x2 tiles of the check image, so that it really streams.
    c64 = replace(cfg, dtype="float64", size=cfg.check_size, tile=cfg.check_size // 2 if cfg.tile else None)
    model, x, y = _build(c64, c64.size, torch.float64, seed=1)
    if cfg.method in SINGLE:
        run = _Single(cfg.method, model, x, c64.tile)
        for _ in range(2):
            run.step(x, y)
        return [p.detach().clone() for p in model.parameters()]
    if cfg.method == "bigconv_spmd":
        from bigconv.runtime import spmd_launch as launch

        got = launch.run(_spmd_rank_weights, cfg.workers, (asdict(c64),), timeout=0.5 * cfg.timeout_s)[0]
        return [torch.from_numpy(a) for a in got]
    import bigconv

    net = bigconv.parallelize(Checkpointed(model) if cfg.method == "bigconv_checkpoint" else model, world)
    net.optimizer(torch.optim.SGD, lr=0.01, momentum=0.9)
    for _ in range(2):
        net.train_step(x, y, nn.CrossEntropyLoss())
    state = net.state_dict()
    prefix = "cnn." if cfg.method == "bigconv_checkpoint" else ""
    return [state[prefix + n].clone() for n, _ in model.named_parameters()]


def _spmd_rank_weights(cd: dict) -> list[torch.Tensor]:
    import bigconv

    cfg = AltConfig(**cd)
    torch.set_num_threads(1)
    model, x, y = _build(cfg, cfg.size, torch.float64, seed=1)
    with bigconv.World.from_env(mode="spmd", timeout=max(60.0, cfg.timeout_s / 3)) as world:
        net = bigconv.parallelize(model, world)
        net.optimizer(torch.optim.SGD, lr=0.01, momentum=0.9)
        for _ in range(2):
            net.train_step(x, y, nn.CrossEntropyLoss())
        state = net.state_dict()
    # numpy arrays pickle by value; tensors would travel as shared-memory handles of a rank that has exited
    return [state[n].detach().numpy().copy() for n, _ in model.named_parameters()]


def rel_err(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """The largest ``|g - r| / |r|`` over the tensors (Frobenius norms)."""
    return max(float((g - r).norm() / r.norm()) for g, r in zip(got, ref))


# ------------------------------------------------------------------------------------ one measurement


def measure_here(cfg: AltConfig) -> dict:
    """Measure ``cfg`` in this process (and the workers or ranks it starts); the full record."""
    import bigconv

    torch.set_num_threads(1)
    record = {**describe(cfg), "method": cfg.method, "processes": max(1, cfg.workers), "threads_per_process": 1}
    t0 = time.perf_counter()
    world = None
    try:
        if cfg.method in SINGLE:
            r = _single(cfg)
        elif cfg.method == "bigconv_spmd":
            r = _spmd(cfg)
        else:
            world = bigconv.World(workers=cfg.workers, threads_per_worker=1, timeout=max(60.0, cfg.timeout_s / 3))
            r = _driver(cfg, world)
        if cfg.check_size:
            plain = _weights_after_two_steps(replace(cfg, method="plain", workers=0, mode=None))
            r["rel_err"] = rel_err(_weights_after_two_steps(cfg, world), plain)
            r["rel_err_dtype"], r["rel_err_size"] = "float64", cfg.check_size
    except Exception as exc:
        text = f"{type(exc).__name__}: {exc}"
        record.update(status=classify(text + repr(exc.__cause__)), message=text[-2000:],
                      traceback=traceback.format_exc()[-4000:])
    else:
        record.update(status="ok", message=None, **r)
    finally:
        if world is not None:
            world.close()
    record["run_s"] = time.perf_counter() - t0
    return record


def measure_fresh(cfg: AltConfig) -> dict:
    """``measure_here`` in a new process (peak memory never resets across configurations)."""
    return fresh_process(["experiments.alternatives", "--one", json.dumps(asdict(cfg))], cfg.timeout_s,
                         {**describe(cfg), "method": cfg.method}, {"OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT})


# ------------------------------------------------------------------------------------------ the table


@dataclass(kw_only=True)
class Plan:
    size: int = 2048
    tile: int = 512
    check_size: int = 256
    width: int = 16
    depth: int = 3
    steps: int = 2
    rounds: int = 2
    budget: int = GiB
    tolerance: float = 0.03
    max_probes: int = 6
    """Probes per size search, the fixed-size measurement included (it is the first probe)."""
    rows: tuple = ROWS
    out: str = "results/alternatives.jsonl"
    probes: str = "results/alternatives_maxsize.jsonl"
    timeout: float = 1800.0
    quick: bool = False


def quick_plan(**kw) -> Plan:
    return Plan(**{**dict(size=128, tile=64, check_size=32, depth=3, steps=1, rounds=1, budget=64 * MiB,
                          tolerance=0.1, max_probes=1,
                          rows=(("plain", 1), ("checkpoint", 1), ("offload", 1), ("streaming", 1),
                                ("bigconv_driver", 4), ("bigconv_spmd", 4), ("bigconv_checkpoint", 4)),
                          out="results/alternatives_quick.jsonl", probes="results/alternatives_quick_maxsize.jsonl",
                          timeout=300.0, quick=True), **kw})


def _config(p: Plan, method: str, procs: int, **kw) -> AltConfig:
    kw.setdefault("steps", p.steps)
    return AltConfig(model="cnn2d", method=method, workers=0 if method in SINGLE else procs, width=p.width,
                     depth=p.depth, record=False, timeout_s=p.timeout,
                     tile=p.tile if method == "streaming" else None,
                     mode="spmd" if method == "bigconv_spmd" else None, **kw)


def run_table(p: Plan, echo=print) -> list[dict]:
    """Measure every row (interleaved rounds, then size searches); append one record per row to ``p.out``."""
    from experiments import maxsize

    check_sizes(p.size, p.tile, p.check_size, p.depth, p.budget)
    t0 = time.perf_counter()
    rounds: dict[tuple, list[dict]] = {row: [] for row in p.rows}
    for r in range(p.rounds):
        for row in p.rows:
            cfg = _config(p, *row, size=p.size, check_size=p.check_size if r == 0 else None)
            rec = measure_fresh(cfg)
            rounds[row].append(rec)
            if r == 0 and rec["status"] == "ok":  # also the size search's first probe (its peak is read first)
                records.append(p.probes, {**rec, "config": {**rec["config"], "check_size": None},
                                          "purpose": "maxsize"})
            echo(f"round {r + 1}/{p.rounds} {row[0]} x{row[1]}: {rec['status']} "
                 f"peak {(rec.get('peak_bytes_max') or 0) / MiB:.1f} MiB, step {rec.get('step_s') or 0:.3f} s"
                 + (f", rel_err {rec['rel_err']:.2e}" if "rel_err" in rec else "")
                 + (f" ({rec['message']})" if rec["status"] != "ok" else ""))
    out = []
    for row in p.rows:
        recs = rounds[row]
        first = recs[0]
        ok = [r for r in recs if r["status"] == "ok"]
        peak = max((r["peak_bytes_max"] for r in ok), default=None)
        base = _config(p, *row, size=p.size)
        found = maxsize.search(base, p.budget, p.size, out=p.probes, tolerance=p.tolerance, runner=measure_fresh,
                               echo=lambda m: None, max_probes=p.max_probes)
        steps = [r["step_s"] for r in ok]
        rec = {"bench": "alternatives", "method": row[0], "processes": row[1], "size": p.size,
               "peak_bytes": peak, "peak_bytes_per_process": first.get("per_worker") and
               [w.get("peak_bytes") for w in first["per_worker"]], "driver_peak_bytes": first.get("driver_peak_bytes"),
               "step_s": statistics.median(steps) if steps else None,
               "step_s_per_round": [r.get("step_s") for r in recs],
               "max_edge_1gib" if p.budget == GiB else "max_edge_budget": found["max_size"],
               "max_edge_budget_bytes": p.budget, "first_failing_edge": found["first_failing_size"],
               "rel_err": first.get("rel_err"), "rel_err_dtype": first.get("rel_err_dtype"),
               "rel_err_size": first.get("rel_err_size"), "exact_claimed": row[0].startswith("bigconv"),
               "grid": first.get("grid"), "status": first["status"], "message": first.get("message"),
               "model": f"CNN2D(width={p.width}, depth={p.depth})", "dtype": "float32", "batch": 1,
               "streaming_tile": p.tile if row[0] == "streaming" else None, "threads_per_process": 1,
               "memory_source": "rss above warm baseline (PeakMeter); driver included for bigconv_driver/checkpoint",
               "quick": p.quick, "commit": first.get("commit"), "torch": first.get("torch"), "env": first.get("env"),
               "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        if p.budget != GiB:
            rec["max_edge_1gib"] = None  # the quick plan searches a smaller budget: no 1 GiB figure
        records.append(p.out, rec)
        out.append(rec)
        echo(f"{row[0]} x{row[1]}: largest edge within {p.budget / MiB:.0f} MiB: {found['max_size']}")
    echo(f"alternatives: {time.perf_counter() - t0:.0f} s")
    return out


def table(recs: list[dict]) -> list[str]:
    """One markdown row per record: memory and time also as multiples of plain's."""
    plain = next((r for r in recs if r["method"] == "plain" and r.get("peak_bytes") and r.get("step_s")), None)
    rows = ["| method | processes | peak / process (MiB) | x plain | step (s) | x plain | largest edge | rel_err |",
            "|---|---|---|---|---|---|---|---|"]
    for r in recs:
        edge = r.get("max_edge_1gib") or r.get("max_edge_budget")
        pk, st, err = r.get("peak_bytes"), r.get("step_s"), r.get("rel_err")
        if not (pk and st):
            rows.append(f"| {r['method']} | {r['processes']} | {r.get('status')}: {r.get('message')} | | | | "
                        f"{edge} | |")
            continue
        rel_pk = f"{pk / plain['peak_bytes']:.2f}" if plain else ""
        rel_st = f"{st / plain['step_s']:.2f}" if plain else ""
        rows.append(f"| {r['method']} | {r['processes']} | {pk / MiB:.1f} | {rel_pk} | {st:.3f} | {rel_st} | {edge} | "
                    f"{'' if err is None else f'{err:.1e}'} |")
    return rows


def main(argv=None) -> None:
    parser = cli.parser("experiments.alternatives", __doc__)
    parser.add_argument("--quick", action="store_true", help="the 2-core CPU scale (smaller image, fewer rounds)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: one fresh-process measurement
    parser.add_argument("--size", type=int, help="image edge (default: the scale's)")
    parser.add_argument("--tile", type=int, help="lightstream's streaming tile edge (default: the scale's)")
    parser.add_argument("--check-size", type=int, dest="check_size",
                        help="edge of the float64 exactness check (default: the scale's)")
    parser.add_argument("--depth", type=int, help="conv blocks of CNN2D (default: the scale's)")
    parser.add_argument("--rounds", type=int, help="interleaved timing rounds (default: the scale's)")
    parser.add_argument("--budget", type=int, help="bytes per process for the size search")
    parser.add_argument("--out", help="results file (default results/alternatives[_quick].jsonl)")
    parser.add_argument("--probes", help="results file of the size search (default results/alternatives_maxsize.jsonl)")
    parser.add_argument("--figure", default=None, help="figure path stem (default figures/alternatives[_quick])")
    parser.add_argument("--report", action="store_true", help="only print the table and draw the figure from the "
                        "records already in --out (the last record of each row)")
    args = parser.parse_args(argv)
    if args.one:
        print(MARK + json.dumps(measure_here(AltConfig(**json.loads(args.one)))), flush=True)
        return
    given = {k: v for k, v in vars(args).items() if k not in ("quick", "one", "figure", "report") and v is not None}
    p = quick_plan(**given) if args.quick else Plan(**given)
    check_sizes(p.size, p.tile, p.check_size, p.depth, p.budget)
    if args.report:
        last = {}
        for r in records.load(p.out):
            if r.get("bench") == "alternatives":
                last[(r["method"], r["processes"])] = r
        recs = [last[row] for row in p.rows if row in last]
    else:
        recs = run_table(p)
    print("\n".join(table(recs)))
    from plots import alternatives as plot

    for path in plot.draw(recs, args.figure or ("figures/alternatives_quick" if p.quick else "figures/alternatives")):
        print(path)


if __name__ == "__main__":
    main()
