"""How far the cluster planner (``python -m bigconv.check ... --gpus N``) is from what can be measured here.

    python -m experiments.planner host          # gloo loopback, co-run slowdown, conv workspace -> results/planner_host.jsonl
    python -m experiments.planner memory        # per-rank peaks, predicted vs measured    -> results/planner_memory.jsonl
    python -m experiments.planner time          # step times at 1, 2, 4 ranks, predicted vs measured -> results/planner_time.jsonl
    python -m experiments.planner anchors       # efficiencies fitted to published GPU throughputs; this project's
                                                # H100 largest edges predicted              -> results/planner_anchors.jsonl
    python -m experiments.planner ornl          # the ORNL report's sizes, predicted       -> results/planner_ornl.jsonl
    python -m experiments.planner report        # the tables of benchmarks/planner.md, from the records

Every measured run is fresh SPMD ranks on this CPU host (``bigconv.runtime.spmd_launch``), 1 thread per rank,
each rank's peak resident memory above what it held before the model existed (``bigconv.memory.PeakMeter``,
the batch built before the meter starts, as ``bigconv.harness.spmd_workload`` measures), and the best of its
timed steps after a warm-up step on a tiny input. The load average of the host is recorded with each
measurement: this host has 2 cores shared with other jobs, so step times carry their noise.

The CPU is priced as a device of its own (``host_device``): the memory model's convolution workspace, a
rank's fixed memory beyond its tensors, the co-run slowdown (how much slower a process computes while k
processes share the 2 cores) and the wait of an exchange when k processes share them, measured by ``host``
(and the speed, slowdown and wait again by a probe right before each timed configuration); compute rates either from an op table measured on the same model at a smaller size (``time``'s
``table`` prediction: ``bigconv.harness.op_table``) or from one convolution's measured rate and the measured
copy bandwidth (the ``roofline`` prediction: FLOPs over a calibrated CPU throughput); the halo and gradient
messages on a gloo loopback link of the measured latency and bandwidth.
"""

from __future__ import annotations

import gc
import json
import math
import os
import statistics
import sys
import time

import torch

from bigconv.harness import cli
from bigconv.harness.records import append, load

MODELS = {
    "cnn2d": ("bigconv:CNN2D", 1, "classify"),
    "resnet50": ("torchvision:resnet50:num_classes=2", 3, "classify"),
    "unet": ("monai:UNet:spatial_dims=2,in_channels=1,out_channels=2,channels=(16,32,64),strides=(2,2),"
             "num_res_units=1", 1, "segment"),
}
"""The validation's models: bigconv's CNN2D, torchvision's ResNet-50, a MONAI U-Net (as the registry's ``unet``)."""
SIZES = {"cnn2d": (1024, 2048), "resnet50": (512, 1024), "unet": (1024, 2048)}
CALIBRATION_SIZE = 256
"""Where op tables are measured: smaller than every validated size."""
WARMUP_SIZE = 64
HOST = "results/planner_host.jsonl"


def loadavg() -> list[float]:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return []


def _env() -> dict:
    from bigconv.harness.workload import environment

    return {**environment(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def _target(task: str, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randint(0, 2, (shape[0],) if task == "classify" else (shape[0], *shape[2:]))


# -- one measured run -------------------------------------------------------------------------------------

def rank_run(name: str, size: int, grid: tuple[int, ...], steps: int) -> dict:
    """One SPMD rank: warm-up on a tiny input, then ``steps`` + 1 steps at ``size`` (the first untimed)."""
    import bigconv
    from bigconv.harness.model_spec import build_model
    from bigconv.memory import PeakMeter

    spec, channels, task = MODELS[name]
    torch.set_num_threads(1)
    loss_fn = torch.nn.CrossEntropyLoss()
    with bigconv.World.from_env(mode="spmd", device="cpu", timeout=600) as world:
        torch.manual_seed(0)
        small = (1, channels, WARMUP_SIZE, WARMUP_SIZE)
        warm = bigconv.parallelize(build_model(spec), world, grid=grid)
        warm.optimizer(torch.optim.SGD, lr=0.01, momentum=0.9)
        warm.train_step(torch.randn(small), _target(task, small), loss_fn)
        del warm
        gc.collect()
        shape = (1, channels, size, size)
        x, y = torch.randn(shape), _target(task, shape)
        load_before = loadavg()
        meter = PeakMeter("cpu")
        net = bigconv.parallelize(build_model(spec), world, grid=grid)
        net.optimizer(torch.optim.SGD, lr=0.01, momentum=0.9)
        times, cpu = [], []
        for step in range(steps + 1):
            t0, c0 = time.perf_counter(), time.process_time()
            net.train_step(x, y, loss_fn)
            if step:
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
        return {**meter.read(), "rank": world.rank, "step_times_s": times, "cpu_times_s": cpu,
                "load_before": load_before, "load_after": loadavg()}


def measure(name: str, size: int, grid: tuple[int, ...], steps: int, timeout: float = 1800) -> dict:
    from bigconv.runtime import spmd_launch as launch

    ranks = launch.run(rank_run, math.prod(grid), (name, size, tuple(grid), steps), timeout=timeout, threads=1)
    per_step = [max(t) for t in zip(*(r["step_times_s"] for r in ranks))]  # a step ends when every rank's has
    return {"peak_bytes": [r["peak_bytes"] for r in ranks], "peak_bytes_max": max(r["peak_bytes"] for r in ranks),
            "step_times_s": per_step, "step_s": min(per_step) if per_step else None,
            "cpu_times_s": [max(t) for t in zip(*(r["cpu_times_s"] for r in ranks))],
            "load": [ranks[0]["load_before"], ranks[0]["load_after"]]}


# -- the CPU as a device --------------------------------------------------------------------------------

def host_device(host: dict, processes: int, conv_rate: float | None = None):
    """This host as a ``Device`` for ``processes`` ranks, from the ``host`` record."""
    from bigconv.harness.devices import Device, Link

    dev = Device(name="cpu (this host, measured)", memory_bytes=host["env"]["host_memory_bytes"],
                 reserve_bytes=host.get("reserve_bytes", 0),
                 flops={"float32": conv_rate or host["conv_rate_flops"]}, efficiency={"float32": 1.0},
                 hbm_bytes_s=host["copy_bytes_s"], hbm_efficiency=1.0, op_overhead_s=host["op_overhead_s"],
                 conv_workspace=tuple(host["conv_workspace"]), gpus_per_node=processes, nics_per_node=1,
                 intra="gloo", inter="gloo", cores=host["env"]["cores"],
                 co_run_slowdown={str(k): v for k, v in host["co_run_slowdown"].items()},
                 sources="measured on this host by python -m experiments.planner host")
    link = Link(name="gloo loopback (measured)", bytes_s=host["gloo_bytes_s"], latency_s=host["gloo_latency_s"],
                message_overhead_s=host["gloo_message_overhead_s"], p2p_efficiency=1.0, collective_efficiency=1.0,
                sync_s=host.get("sync_s", {}).get(str(processes), 0.0) if processes > 1 else 0.0)
    return dev, link


def _host(path: str = HOST) -> dict:
    recs = load(path)
    if not recs:
        raise SystemExit(f"no host calibration in {path}: run python -m experiments.planner host first")
    return recs[-1]


# -- host calibration -------------------------------------------------------------------------------------

def _pingpong(sizes: list[int], reps: int) -> dict:
    import torch.distributed as dist

    import bigconv

    out = {}
    with bigconv.World.from_env(mode="spmd", device="cpu", timeout=120) as world:
        peer = 1 - world.rank
        for n in sizes:
            buf = torch.zeros(max(1, n // 4))
            times = []
            for _ in range(reps):
                dist.barrier()
                t0 = time.perf_counter()
                if world.rank == 0:
                    dist.send(buf, peer)
                    dist.recv(buf, peer)
                else:
                    dist.recv(buf, peer)
                    dist.send(buf, peer)
                times.append((time.perf_counter() - t0) / 2)
            out[n] = min(times)
            out[f"median_{n}"] = statistics.median(times)
        # a batch of 8 small messages each way against one
        bufs = [torch.zeros(2) for _ in range(8)]
        recv = [torch.zeros(2) for _ in range(8)]
        best = float("inf")
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            ops = [dist.P2POp(dist.isend, b, peer) for b in bufs] + [dist.P2POp(dist.irecv, b, peer) for b in recv]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            best = min(best, time.perf_counter() - t0)
        out["batch8"] = best
    return out


def _conv_work(size: int, reps: int) -> float:
    """Best fwd+bwd time of a 16->16 3x3 convolution (CNN2D's) on one thread."""
    torch.set_num_threads(1)
    conv = torch.nn.Conv2d(16, 16, 3, padding=1)
    x = torch.randn(1, 16, size, size, requires_grad=True)
    best = float("inf")
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        conv(x).sum().backward()
        best = min(best, time.perf_counter() - t0)
    return best


def _co_run(k: int, size: int, reps: int) -> list:
    """One of ``k`` processes at once: the convolution benchmark's best time, then the median wait of a small
    ring exchange after each of 30 short computations (what an exchange costs once the peer must get a
    core: on an oversubscribed host it is the scheduler's, not the wire's)."""
    import torch.distributed as dist

    import bigconv

    with bigconv.World.from_env(mode="spmd", device="cpu", timeout=300) as world:
        dist.barrier()
        best = _conv_work(size, reps)
        if k == 1:
            return [best, 0.0]
        conv, x = torch.nn.Conv2d(16, 16, 3, padding=1), torch.randn(1, 16, 96, 96)
        send, recv = torch.zeros(64), torch.zeros(64)
        right, left = (world.rank + 1) % k, (world.rank - 1) % k
        waits = []
        with torch.no_grad():
            for _ in range(30):
                conv(x)
                t0 = time.perf_counter()
                ops = [dist.P2POp(dist.isend, send, right), dist.P2POp(dist.irecv, recv, left)]
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
                waits.append(time.perf_counter() - t0)
        return [best, statistics.median(waits)]


def _workspace() -> list[float]:
    """A convolution's transient memory on this CPU (oneDNN reorders), as multiples of (forward: its output;
    backward: its input, its output gradient): measured in fresh processes, then solved."""
    code = r'''
import sys, torch
from bigconv.memory import PeakMeter
torch.set_num_threads(1)
cin, n, xgrad = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
conv = torch.nn.Conv2d(cin, 16, 3, padding=1)
conv(torch.randn(1, cin, 32, 32, requires_grad=True)).sum().backward()
x = torch.randn(1, cin, n, n, requires_grad=xgrad)
m = PeakMeter("cpu"); y = conv(x); fwd = m.read()["peak_bytes"] - y.numel() * 4
g = torch.ones_like(y); m = PeakMeter("cpu"); y.backward(g)
bwd = m.read()["peak_bytes"] - (x.numel() * 4 if xgrad else 0)
print(fwd, bwd, x.numel() * 4, y.numel() * 4)
'''
    import subprocess

    from bigconv.runtime.world import WORKER_ENV

    rows = []
    for cin in (1, 16):
        done = subprocess.run([sys.executable, "-c", code, str(cin), "1024", "0"], capture_output=True, text=True,
                              env={**os.environ, **WORKER_ENV}, check=True)
        rows.append([int(v) for v in done.stdout.split()])
    # forward: extra = a * out; backward (no input gradient): extra = b * in + c * out
    (f1, b1, x1, y1), (f16, b16, x16, y16) = rows
    a = statistics.mean([f1 / y1, f16 / y16])
    c = b1 / y1 if x1 < y1 / 8 else 1.0  # the 1-channel input is small: its backward's extra is the gradient's
    b = max(0.0, (b16 - c * y16) / x16)
    return [round(a, 2), round(b, 2), round(c, 2)]


def host(args) -> None:
    from bigconv.harness.op_table import dispatch_overhead
    from bigconv.runtime import spmd_launch as launch

    sizes = [8, 1024, 65536, 1 << 20, 16 << 20]
    pp = launch.run(_pingpong, 2, (sizes, 20), timeout=600)[0]
    latency = pp[8]
    big = 16 << 20
    bandwidth = big / max(1e-9, pp[big] - latency)
    overhead = max(0.0, (pp["batch8"] - pp[8]) / 7)
    # The co-run slowdown, interleaved over rounds (the host's other jobs come and go): each round's k
    # processes against the same round's process alone, the median of the rounds.
    ratios: dict[int, list] = {2: [], 4: []}
    syncs: dict[int, list] = {2: [], 4: []}
    alones = []
    for _ in range(args.rounds):
        alones.append(_conv_work(512, 5))
        for k in (2, 4):
            per = launch.run(_co_run, k, (k, 512, 5), timeout=900)
            ratios[k].append(statistics.mean(r[0] for r in per) / alones[-1])
            syncs[k].append(statistics.mean(r[1] for r in per))
    alone = min(alones)
    slowdown = {1: 1.0, **{k: statistics.median(v) for k, v in ratios.items()}}
    flops = 3 * 2 * 16 * 16 * 9 * 512 * 512  # forward, input gradient, weight gradient
    x = torch.randn(64 << 20 >> 2)
    copy = float("inf")
    for _ in range(10):
        t0 = time.perf_counter()
        x.clone()
        copy = min(copy, time.perf_counter() - t0)
    # A rank's memory beyond the tensors the model prices (oneDNN's primitive caches, gloo's buffers, the
    # autograd graph): CNN2D at 512² on 4 ranks (shards of 256², smaller than any validated size), measured
    # less predicted.
    partial = {"conv_workspace": _workspace(), "copy_bytes_s": 1.0, "conv_rate_flops": 1.0, "op_overhead_s": 0.0,
               "co_run_slowdown": {1: 1.0}, "gloo_bytes_s": bandwidth, "gloo_latency_s": latency,
               "gloo_message_overhead_s": overhead, "reserve_bytes": 0, "env": _env()}
    got = measure("cnn2d", 512, (2, 2), steps=1)
    tensors = predict("cnn2d", 512, 4, partial, table=op_table("cnn2d"))["memory"]["total"]
    reserve = max(0, got["peak_bytes_max"] - tensors)
    record = {"kind": "host", "gloo_latency_s": latency, "gloo_bytes_s": bandwidth, "reserve_bytes": reserve,
              "reserve_measured": {"peak_bytes": got["peak_bytes"], "predicted_tensors_bytes": tensors},
              "gloo_message_overhead_s": overhead, "gloo_pingpong_s": {str(k): v for k, v in pp.items()},
              "conv_rate_flops": flops / alone, "conv_alone_s": alone, "co_run_slowdown": slowdown,
              "co_run_ratios": {str(k): v for k, v in ratios.items()}, "conv_alone_rounds_s": alones,
              "sync_s": {str(k): statistics.median(v) for k, v in syncs.items()},
              "copy_bytes_s": 2 * x.numel() * 4 / copy, "op_overhead_s": dispatch_overhead(torch.device("cpu")),
              "conv_workspace": partial["conv_workspace"], "load": loadavg(), "env": _env()}
    append(args.out or HOST, record)
    print(json.dumps({k: v for k, v in record.items() if k != "env"}, indent=1))


# -- predictions ----------------------------------------------------------------------------------------

def predict(name: str, size: int, ranks: int, host: dict, table=None, conv_rate=None) -> dict:
    from bigconv.geometry.boxes import choose_grid
    from bigconv.harness.cost_model import Cluster, Profiler, estimate
    from bigconv.harness.model_spec import build_model

    spec, channels, _ = MODELS[name]
    dev, link = host_device(host, ranks, conv_rate)
    cluster = Cluster(device=dev, gpus=ranks, intra=link, gpus_per_node=ranks, op_table=table, headroom=0.0)
    grid = choose_grid((size, size), ranks)
    e = estimate(Profiler(build_model(spec)), (1, channels, size, size), cluster, grid)
    return {"grid": list(grid), "memory": e.memory, "time": e.time}


def op_table(name: str):
    """The model's op table: rates and transient memory per op class, measured in this process at
    ``CALIBRATION_SIZE`` (one thread)."""
    from bigconv.harness.model_spec import build_model
    from bigconv.harness.op_table import calibrate

    spec, channels, _ = MODELS[name]
    return calibrate(build_model(spec), (1, channels, CALIBRATION_SIZE, CALIBRATION_SIZE), "cpu", steps=6, threads=1)


def memory(args) -> None:
    host_rec = _host(args.host_file)
    for name in args.models:
        table = op_table(name)
        for size in args.sizes or SIZES[name]:
            for ranks in args.ranks or (2, 4):
                pred = predict(name, size, ranks, host_rec, table=table)
                from bigconv.geometry.boxes import choose_grid

                grid = tuple(choose_grid((size, size), ranks))
                got = measure(name, size, grid, steps=1)
                predicted = pred["memory"]["total"]  # the host's per-rank reserve included
                rec = {"kind": "memory", "model": name, "size": size, "ranks": ranks, "grid": list(grid),
                       "predicted_bytes": predicted, "predicted_parts": pred["memory"], **got,
                       "workspace_from": f"op table at {CALIBRATION_SIZE}²",
                       "error": predicted / got["peak_bytes_max"] - 1, "env": _env()}
                append(args.out or "results/planner_memory.jsonl", rec)
                print(f"{name} {size}² on {ranks}: predicted {predicted / 2**20:.1f} MiB, measured "
                      f"{got['peak_bytes_max'] / 2**20:.1f} MiB ({100 * rec['error']:+.1f}%), load {got['load']}",
                      flush=True)


def probe(ranks: int) -> dict:
    """The host's speed right now, as the next measurement will find it: the convolution benchmark alone, its
    slowdown with ``ranks`` processes at once, and the median gloo round trip of small messages (the
    latency a blocking exchange waits when other jobs hold the cores)."""
    from bigconv.runtime import spmd_launch as launch

    alone = _conv_work(512, 5)
    found = {"conv_alone_s": alone, "conv_rate_flops": 3 * 2 * 16 * 16 * 9 * 512 * 512 / alone,
             "co_run_slowdown": {1: 1.0}}
    if ranks > 1:
        per = launch.run(_co_run, ranks, (ranks, 512, 5), timeout=900)
        found["co_run_slowdown"][ranks] = statistics.mean(r[0] for r in per) / alone
        found["sync_s"] = {str(ranks): statistics.mean(r[1] for r in per)}
    return found


def time_(args) -> None:
    """Each configuration right after a probe of the host (``probe``): the roofline prediction takes the
    probe's convolution rate, co-run slowdown and gloo latency; the op table, measured once per model,
    has its rates scaled by the probe's convolution rate against the rate at its calibration."""
    from dataclasses import replace

    from bigconv.geometry.boxes import choose_grid

    host_rec = _host(args.host_file)
    for name in args.models:
        speed_then = 3 * 2 * 16 * 16 * 9 * 512 * 512 / _conv_work(512, 5)
        table = op_table(name)
        for size in args.sizes or SIZES[name]:
            for ranks in args.ranks or (1, 2, 4):
                grid = tuple(choose_grid((size, size), ranks))
                now = probe(ranks)
                host_now = {**host_rec, **now}
                factor = now["conv_rate_flops"] / speed_then
                scaled = replace(table, rates={k: {p: r * factor for p, r in v.items()} for k, v in table.rates.items()})
                with_table = predict(name, size, ranks, host_now, table=scaled)
                roofline = predict(name, size, ranks, host_now)
                got = measure(name, size, grid, steps=args.steps)
                rec = {"kind": "time", "model": name, "size": size, "ranks": ranks, "grid": list(grid),
                       "predicted_table_s": with_table["time"]["step"], "predicted_roofline_s": roofline["time"]["step"],
                       "predicted_parts_table": with_table["time"], "predicted_parts_roofline": roofline["time"],
                       "probe": now, "table_speed_factor": factor, "calibration": table.calibration, **got,
                       "error_table": with_table["time"]["step"] / got["step_s"] - 1,
                       "error_roofline": roofline["time"]["step"] / got["step_s"] - 1, "env": _env()}
                append(args.out or "results/planner_time.jsonl", rec)
                print(f"{name} {size}² on {ranks}: measured {got['step_s']:.3f} s (steps "
                      f"{[round(t, 3) for t in got['step_times_s']]}), predicted {with_table['time']['step']:.3f} s "
                      f"with the op table ({100 * rec['error_table']:+.1f}%), {roofline['time']['step']:.3f} s roofline "
                      f"({100 * rec['error_roofline']:+.1f}%); probe {now}; load {got['load']}", flush=True)


# -- published and earlier-measured anchors ------------------------------------------------------------------

PUBLISHED = [  # NVIDIA DeepLearningExamples, PyTorch ResNet-50 v1.5, 1 GPU, training throughput (pytorch-21.03)
    {"gpu": "a100-80gb", "dtype": "float32", "amp": None, "key": "tf32", "batch": 256, "img_s": 938},
    {"gpu": "a100-80gb", "dtype": "float32", "amp": "float16", "key": "float16", "batch": 256, "img_s": 2470},
    {"gpu": "v100-16gb", "dtype": "float32", "amp": None, "key": "float32", "batch": 112, "img_s": 367},
    {"gpu": "v100-16gb", "dtype": "float32", "amp": "float16", "key": "float16", "batch": 256, "img_s": 1200},
]
"""github.com/NVIDIA/DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/README.md, "Training
performance results" (the batch sizes are that README's per-GPU defaults: 112 for V100 16GB FP32, else 256)."""

H100_LARGEST = [  # this project's H100, one rank, allocator capped at 16 GiB (benchmarks/gpu_h100.md)
    {"model": "cnn2d", "spec": "bigconv:CNN2D", "channels": 1, "fits": 8064, "fails": 8192, "task": "classify"},
    {"model": "unet", "spec": MODELS["unet"][0], "channels": 1, "fits": 6912, "fails": 7168, "task": "segment"},
]


def anchors(args) -> None:
    """Fit each published figure's convolution efficiency (bisection on this cost model's step time), then
    predict the H100's largest edges under the 16 GiB cap with the fitted table."""
    from dataclasses import replace

    from bigconv.harness import devices
    from bigconv.harness.cost_model import Cluster, Profiler, estimate
    from bigconv.harness.model_spec import build_model
    from bigconv.harness.plan_search import max_size

    out = args.out or "results/planner_anchors.jsonl"
    profiler = Profiler(build_model("torchvision:resnet50"), plain=True)  # as DeepLearningExamples ran it
    for a in PUBLISHED:
        dev = devices.GPUS[a["gpu"]]
        shape = (a["batch"], 3, 224, 224)

        def step(eff: float, dev=dev, a=a, shape=shape) -> float:
            d = replace(dev, efficiency={**dev.efficiency, a["key"]: eff})
            c = Cluster(device=d, gpus=1, intra=devices.link(d.intra), dtype=a["dtype"], amp=a["amp"])
            return estimate(profiler, shape, c, (1, 1)).time["step"]

        target = a["batch"] / a["img_s"]
        lo, hi = 0.01, 1.0
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if step(mid) > target else (lo, mid)
        eff = (lo + hi) / 2
        floor = step(1.0)
        rec = {"kind": "efficiency", **a, "fitted_efficiency": round(eff, 3), "step_s_published": target,
               "step_s_at_full_rate": floor, "reachable": floor < target, "env": _env()}
        append(out, rec)
        print(f"{a['gpu']} {a['key']}: {a['img_s']} img/s -> efficiency {eff:.3f} (step {target * 1e3:.1f} ms; at "
              f"the full rate {floor * 1e3:.1f} ms)", flush=True)
    for h in H100_LARGEST:
        d = devices.device("h100-80gb:memory_gib=16,reserve_gib=0")  # the cap binds the allocator only
        for headroom in (0.0, 0.1):
            c = Cluster(device=d, gpus=1, intra=devices.link("nvlink4"), headroom=headroom)
            size, e = max_size(Profiler(build_model(h["spec"])), (1, h["channels"], 2048, 2048), c, multiple=64)
            rec = {"kind": "largest_h100_16gib", **h, "headroom": headroom, "predicted_edge": size[2],
                   "predicted_peak_bytes": e.memory["total"], "within_measured": h["fits"] <= size[2] < h["fails"],
                   "env": _env()}
            append(out, rec)
            print(f"{h['model']}, headroom {headroom}: predicted largest {size[2]}² (measured: {h['fits']}² fits, "
                  f"{h['fails']}² does not)", flush=True)


ORNL = [  # the report's figures 2-5 (V100 16 GB, batch 1): largest single-GPU size, and a multi-GPU size reached
    {"model": "cnn1d", "spec": "bigconv:CNN1D", "dims": 1, "single": 8 * 2**20, "gpus": 6, "multi": 16 * 2**20},
    {"model": "cnn2d", "spec": "bigconv:CNN2D", "dims": 2, "single": 2200, "gpus": 10, "multi": 6000},
    {"model": "cnn3d", "spec": "bigconv:CNN3D", "dims": 3, "single": 170, "gpus": 28, "multi": 400},
    {"model": "fcn2d", "spec": "bigconv:FCN2D", "dims": 2, "single": 1500, "gpus": 10, "multi": 4500},
]
"""Tsaris and Hinkle (2021), section 2.2 (../shared/reference/): "up to 8M" 1D vectors on one GPU and "twice the
size ... using six GPUs"; 2,200x2,200 on one GPU and 6Kx6K on 10; 170^3 on one and 400^3 on 28; 1,500x1,500 on
one and 4,500x4,500 on 10."""


def ornl(args) -> None:
    from bigconv.harness import devices
    from bigconv.harness.cost_model import Cluster, Profiler
    from bigconv.harness.model_spec import build_model
    from bigconv.harness.plan_search import max_size

    out = args.out or "results/planner_ornl.jsonl"
    dev = devices.GPUS["v100-16gb"]
    for o in ORNL:
        profiler = Profiler(build_model(o["spec"]))
        multiple = 8 if o["model"] != "cnn1d" else 1024
        row = {"kind": "ornl", **o}
        for gpus, key in ((1, "single"), (o["gpus"], "multi")):
            c = Cluster(device=dev, gpus=gpus, intra=devices.link(dev.intra), inter=devices.link(dev.inter))
            start = (1, 1, *[o[key] // multiple * multiple] * o["dims"])  # the search starts at the published size
            size, e = max_size(profiler, start, c, multiple=multiple)
            row[f"predicted_{key}"] = size[2]
            row[f"predicted_{key}_grid"] = list(e.grid)
            row[f"predicted_{key}_peak_bytes"] = e.memory["total"]
            row[f"predicted_{key}_step_s"] = e.time["step"]
        # what the published single-GPU size costs in this model (the rest of 16 GB was the study's own)
        c = Cluster(device=dev, gpus=1, intra=devices.link(dev.intra))
        from bigconv.harness.cost_model import estimate

        at = -(-o["single"] // multiple) * multiple  # FCN2D takes multiples of 8: 1,504 for the report's 1,500
        row["published_single_priced_at"] = at
        row["predicted_bytes_at_published_single"] = estimate(
            profiler, (1, 1, *[at] * o["dims"]), c, (1,) * o["dims"]).memory["total"]
        row["env"] = _env()
        append(out, row)
        print(json.dumps({k: v for k, v in row.items() if k != "env"}), flush=True)


def _with_worker_env() -> None:
    """Re-run this command under the workers' allocator settings (``WORKER_ENV``), which glibc reads only at
    process start: without them freed memory stays in the heap, and neither the ranks' peaks nor an op's
    transient memory would read as they do in bigconv's runs."""
    from bigconv.runtime.world import WORKER_ENV

    if any(k not in os.environ for k in WORKER_ENV):
        os.execve(sys.executable, [sys.executable, "-m", "experiments.planner", *sys.argv[1:]],
                  {**WORKER_ENV, **os.environ})


def report(args) -> None:
    """The tables of benchmarks/planner.md, from the records (the last record of each configuration)."""
    def last(path, kind):
        found = {}
        for r in load(path):
            if r.get("kind") == kind:
                found[(r.get("model"), r.get("size"), r.get("ranks"), r.get("gpu"), r.get("key"))] = r
        return list(found.values())

    mib = 2**20
    print("| model | edge | ranks | grid | predicted (MiB) | measured (MiB), per rank | off by | load (1, 5, 15 min) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in last("results/planner_memory.jsonl", "memory"):
        print(f"| {r['model']} | {r['size']} | {r['ranks']} | {'x'.join(map(str, r['grid']))} | "
              f"{r['predicted_bytes'] / mib:,.1f} | {', '.join(f'{p / mib:,.1f}' for p in r['peak_bytes'])} | "
              f"{100 * r['error']:+.1f}% | {', '.join(map(str, r['load'][0]))} |")
    print()
    print("| model | edge | ranks | measured best step (s) | all steps (s) | op table: predicted (s), off by | "
          "roofline: predicted (s), off by | load before, after |")
    print("|---|---|---|---|---|---|---|---|")
    for r in last("results/planner_time.jsonl", "time"):
        print(f"| {r['model']} | {r['size']} | {r['ranks']} | {r['step_s']:.3f} | "
              f"{', '.join(f'{t:.2f}' for t in r['step_times_s'])} | {r['predicted_table_s']:.3f}, "
              f"{100 * r['error_table']:+.0f}% | {r['predicted_roofline_s']:.3f}, {100 * r['error_roofline']:+.0f}% | "
              f"{r['load'][0][0]}, {r['load'][1][0]} |")
    print()
    print("| model | edge | ranks | best step of each round (s) | spread (max / min) |")
    print("|---|---|---|---|---|")
    rounds: dict = {}
    for r in load("results/planner_time.jsonl"):
        if r.get("kind") == "time":
            rounds.setdefault((r["model"], r["size"], r["ranks"]), []).append(r["step_s"])
    for (model, size, ranks), steps in rounds.items():
        print(f"| {model} | {size} | {ranks} | {', '.join(f'{t:.3f}' for t in steps)} | "
              f"{max(steps) / min(steps):.2f} |")
    print()
    for r in last("results/planner_anchors.jsonl", "efficiency"):
        print(f"| {r['gpu']} | {r['key']} | {r['batch']} | {r['img_s']} | {r['fitted_efficiency']} | "
              f"{r['step_s_at_full_rate'] * 1e3:.1f} |")
    for r in load("results/planner_anchors.jsonl"):
        if r.get("kind") == "largest_h100_16gib":
            print(f"| {r['model']} | {r['headroom']} | {r['fits']}² fits, {r['fails']}² does not | {r['predicted_edge']}² "
                  f"({r['predicted_peak_bytes'] / 2**30:.2f} GiB) |")
    print()
    for r in last("results/planner_ornl.jsonl", "ornl"):
        d = "" if r["dims"] == 1 else "²" if r["dims"] == 2 else "³"
        print(f"| {r['model']} | {r['single']:,}{d} | {r['predicted_single']:,}{d} | {r['gpus']} GPUs: {r['multi']:,}{d} | "
              f"{r['predicted_multi']:,}{d} ({'x'.join(map(str, r['predicted_multi_grid']))}) | "
              f"{r['predicted_bytes_at_published_single'] / 2**30:.2f} GiB |")


def main(argv=None) -> None:
    if argv is None:
        _with_worker_env()
    parser = cli.parser("experiments.planner", __doc__)
    parser.add_argument("what", choices=["host", "memory", "time", "anchors", "ornl", "report"], help="which part")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS), help="models to run")
    parser.add_argument("--sizes", nargs="+", type=int, default=None, help="edges (default: each model's two)")
    parser.add_argument("--ranks", nargs="+", type=int, default=None, help="rank counts (default: memory 2 4, time 1 2 4)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run (after one untimed)")
    parser.add_argument("--rounds", type=int, default=5, help="host: interleaved rounds of the co-run measurement")
    parser.add_argument("--out", default=None, help="results file (default: results/planner_<what>.jsonl)")
    parser.add_argument("--host-file", default=HOST, help="memory/time: the host record to read (another machine's: "
                                                         "the --out of its own host run)")
    args = parser.parse_args(argv)
    {"host": host, "memory": memory, "time": time_, "anchors": anchors, "ornl": ornl,
     "report": report}[args.what](args)


if __name__ == "__main__":
    main()
