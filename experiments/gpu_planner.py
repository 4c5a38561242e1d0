"""The cluster planner's one-GPU step against the GPU: predicted (op table measured here, and the device
table's fitted efficiencies) against measured step times and allocator peaks.

    python -m experiments.gpu_planner                 # on a machine with a CUDA GPU -> results/gpu_planner.jsonl
    python -m experiments.gpu_planner --device cpu --quick   # the same code path on a CPU (to check the script)

For each model, ``bigconv.harness.op_table.calibrate`` measures the model's per-op rates at a calibration
edge (what ``python -m bigconv.check MODEL --calibrate-ops FILE`` writes); at each larger edge
``bigconv.harness.cost_model.estimate`` prices one training step on one GPU twice, with that table and with
the device table's entry (``--gpu``, fitted to published throughput), and the same step is measured:
the plain model (SGD with momentum, cross-entropy, batch 1, float32; best of ``--steps`` timed steps after
one untimed) and one bigconv SPMD rank on the same GPU (``train_step``, one fresh process). The allocator's
peak of each is recorded beside the prediction's memory total. One GPU allows one rank, so this checks the
single-device part of the model (compute and memory), not the links.
"""

from __future__ import annotations

import gc
import json
import time

import torch

from bigconv.harness import cli
from bigconv.harness.records import append

MODELS = {
    "cnn2d": ("bigconv:CNN2D", 1, (1024, 2048, 4096)),
    "resnet50": ("torchvision:resnet50:num_classes=2", 3, (512, 1024, 2048)),
}
CALIBRATION = 256


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _peak_reset(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


def _peak(dev: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None


def _timed(step, steps: int, dev: torch.device) -> dict:
    """``steps`` timed calls of ``step`` after an untimed one, and the allocator's peak over all of them."""
    _peak_reset(dev)
    times = []
    for k in range(steps + 1):
        _sync(dev)
        t0 = time.perf_counter()
        step()
        _sync(dev)
        if k:
            times.append(time.perf_counter() - t0)
    return {"step_times_s": times, "step_s": min(times), "peak_bytes": _peak(dev)}


def device_env(device: str) -> dict:
    """The records' environment: versions, hardware, commit, the time, and the GPU's name."""
    from bigconv.harness.workload import environment

    env = {**environment(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if device.startswith("cuda"):
        env["gpu_name"] = torch.cuda.get_device_name(0)
    return env


def plain_step(spec: str, channels: int, size: int, steps: int, device: str) -> dict:
    from bigconv.harness.model_spec import build_model

    dev = torch.device(device)
    torch.manual_seed(0)
    model = build_model(spec).to(dev).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(1, channels, size, size, device=dev)
    y = torch.zeros(1, dtype=torch.long, device=dev)
    ce = torch.nn.CrossEntropyLoss()
    def one() -> None:
        opt.zero_grad(set_to_none=True)
        ce(model(x), y).backward()
        opt.step()

    out = _timed(one, steps, dev)
    del model, opt, x
    gc.collect()
    _peak_reset(dev)
    return out


def bigconv_rank(spec: str, channels: int, size: int, steps: int, device: str) -> dict:
    """One SPMD rank on ``device``: the same step through ``train_step``."""
    import bigconv
    from bigconv.harness.model_spec import build_model

    dev = torch.device(device)
    with bigconv.World.from_env(mode="spmd", device=device, timeout=300) as world:
        torch.manual_seed(0)
        net = bigconv.parallelize(build_model(spec), world, grid=(1, 1))
        net.optimizer(torch.optim.SGD, lr=0.01, momentum=0.9)
        x = torch.randn(1, channels, size, size)
        y = torch.zeros(1, dtype=torch.long)
        ce = torch.nn.CrossEntropyLoss()
        return _timed(lambda: net.train_step(x, y, ce), steps, dev)


def predict(spec: str, channels: int, size: int, gpu: str, table) -> dict:
    from bigconv.harness import devices
    from bigconv.harness.cost_model import Cluster, Profiler, estimate
    from bigconv.harness.model_spec import build_model

    dev = devices.device(gpu)
    cluster = Cluster(device=dev, gpus=1, intra=devices.link(dev.intra), op_table=table, headroom=0.0)
    e = estimate(Profiler(build_model(spec)), (1, channels, size, size), cluster, (1, 1))
    # The allocator's peak holds tensors only: the device's fixed reserve (CUDA context, library workspaces)
    # is compared with NVML figures elsewhere (gpu_check), not here.
    return {"step_s": e.time["step"], "memory_bytes": e.memory["total"] - e.memory.get("reserve", 0),
            "time": e.time, "memory": e.memory}


def report(path: str) -> None:
    """One row per record: the predictions (op table, device table) against the plain and bigconv steps, and
    the predicted tensors against the allocator's peak."""
    from bigconv.harness.records import load

    print("| model | edge | table at | measured plain (ms) | bigconv 1 rank (ms) | op table (ms) | vs plain | "
          "device table (ms) | vs plain | memory predicted / plain peak (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in load(path):
        if not r.get("ok"):
            print(f"| {r['model']} | {r['size']} | | {r.get('error', '')[:80]} |")
            continue
        ms = 1e3
        plain, bc = r["plain"]["step_s"], r.get("bigconv_1rank", {}).get("step_s")
        pt, pd = r["predicted_table"]["step_s"], r["predicted_device_table"]["step_s"]
        cal = r["calibration"]["input"][-1]
        peak = r["plain"]["peak_bytes"]
        mem = (f"{r['predicted_table']['memory_bytes'] / 2**20:.0f} / {peak / 2**20:.0f}" if peak else "")
        print(f"| {r['model']} | {r['size']}² | {cal}² | {plain * ms:.1f} | {bc * ms:.1f} | {pt * ms:.1f} | "
              f"{pt / plain - 1:+.0%} | {pd * ms:.1f} | {pd / plain - 1:+.0%} | {mem} |")


def main(argv=None) -> None:
    p = cli.parser("experiments.gpu_planner", __doc__)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS), help="models to measure")
    p.add_argument("--device", default="cuda", help="where the steps run (cpu: to check the script)")
    p.add_argument("--gpu", default="h100-80gb", help="the device table's entry the plain prediction uses")
    p.add_argument("--steps", type=int, default=5, help="timed steps per measurement (after an untimed one)")
    p.add_argument("--quick", action="store_true", help="the smallest edge of each model only, 2 steps")
    p.add_argument("--no-bigconv", action="store_true", help="skip the bigconv rank (plain model only)")
    p.add_argument("--calibration", type=int, default=CALIBRATION, help="the op table's calibration edge")
    p.add_argument("--sizes", nargs="+", type=int, default=None, help="edges (default: each model's three)")
    p.add_argument("--out", default="results/gpu_planner.jsonl", help="records file (appended)")
    p.add_argument("--report", action="store_true", help="print the table of --out's records, measuring nothing")
    args = p.parse_args(argv)
    if args.report:
        return report(args.out)
    from bigconv.harness.model_spec import build_model
    from bigconv.harness.op_table import calibrate
    from bigconv.runtime import spmd_launch as launch

    env = device_env(args.device)
    steps = 2 if args.quick else args.steps
    for name in args.models:
        spec, channels, sizes = MODELS[name]
        sizes = args.sizes or sizes
        t0 = time.perf_counter()
        table = calibrate(build_model(spec), (1, channels, args.calibration, args.calibration), args.device, steps=3)
        calib_s = time.perf_counter() - t0
        for size in sizes[:1] if args.quick else sizes:
            rec = {"kind": "gpu_planner", "model": name, "size": size, "device": args.device, "gpu_table": args.gpu,
                   "calibration": table.calibration, "calibration_s": calib_s}
            try:
                rec["predicted_table"] = predict(spec, channels, size, args.gpu, table)
                rec["predicted_device_table"] = predict(spec, channels, size, args.gpu, None)
                rec["plain"] = plain_step(spec, channels, size, steps, args.device)
                if not args.no_bigconv:
                    rec["bigconv_1rank"] = launch.run(bigconv_rank, 1, (spec, channels, size, steps, args.device),
                                                      timeout=300, threads=4)[0]
                m = rec["plain"]["step_s"]
                rec["error_table"] = rec["predicted_table"]["step_s"] / m - 1
                rec["error_device_table"] = rec["predicted_device_table"]["step_s"] / m - 1
                if rec["plain"]["peak_bytes"]:
                    rec["memory_error"] = rec["predicted_table"]["memory_bytes"] / rec["plain"]["peak_bytes"] - 1
                rec["ok"] = True
            except Exception as exc:  # the record says what broke; the next size still runs
                rec.update(ok=False, error=f"{type(exc).__name__}: {exc}")
            append(args.out, {**rec, "env": env})
            print(json.dumps({k: v for k, v in rec.items() if k not in ("calibration", "env")}, default=str)[:900],
                  flush=True)


if __name__ == "__main__":
    main()
