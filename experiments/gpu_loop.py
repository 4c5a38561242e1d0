"""The native loop's mixed precision on a GPU: one SPMD rank under ``torch.autocast`` against one process.

    python -m experiments.gpu_loop                       # on a CUDA machine -> results/gpu_loop.jsonl
    python -m experiments.gpu_loop --device cpu          # the same code on a CPU (bf16 and fp16 autocast)

The CPU tests (tests/test_native_loop.py) check the sums of 4 gloo ranks under autocast on the CPU; this is
the CUDA half: the dtypes one process's autocast gives (a bf16 output stays bf16), and fp16 with
``torch.amp.GradScaler`` (scale, skipped steps) through bigconv's module, on the GPU's own kernels.
torchvision ResNet-18 (BatchNorm in training mode), batch 2 at ``--size``², SGD with momentum, ``--steps``
steps from the same weights and data. One rank: NCCL needs one GPU per rank, so the sums across ranks are
not what this checks. Reported per dtype: the output's dtype on both sides, the largest relative difference
of the output, the loss, each gradient (against its own norm) after the first backward and of the weights
after the last step (float32 without autocast as the floor), the scaler's scale on both sides, and the step times of both.
"""

from __future__ import annotations

import contextlib
import copy
import json
import time

import torch

from bigconv.harness import cli
from bigconv.harness.records import append


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def rank(device: str, dtype_name: str, size: int, steps: int, tf32: bool = True) -> dict:
    import torchvision

    import bigconv

    dev = torch.device(device)
    dtype = getattr(torch, dtype_name)
    torch.backends.cudnn.allow_tf32 = tf32  # PyTorch's default for convolutions is True
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=3)
    plain = copy.deepcopy(model).to(dev)
    x = torch.randn(2, 3, size, size)
    y = torch.tensor([0, 2])
    ce = torch.nn.CrossEntropyLoss()
    scaled = dtype == torch.float16
    out: dict = {"dtype": dtype_name, "device": device, "size": size, "steps": steps, "cudnn_tf32": tf32}
    with bigconv.World.from_env(mode="spmd", device=device, timeout=300) as world:
        net = bigconv.parallelize(model, world, grid=(1, 1))
        sides = {"plain": (plain, lambda inp: plain(inp.to(dev))), "bigconv": (net, net)}
        for side, (module, call) in sides.items():
            opt = torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9)
            scaler = torch.amp.GradScaler(dev.type) if scaled else None
            times = []
            for step in range(steps):
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                with torch.autocast(dev.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext():
                    o = call(x)
                    loss = ce(o.float(), y.to(o.device))
                (scaler.scale(loss) if scaled else loss).backward()
                if step == 0:
                    out[f"{side}_output_dtype"] = str(o.dtype)
                    out[f"{side}_output"] = o.detach().float().cpu()
                    out[f"{side}_loss"] = float(loss.detach())
                    out[f"{side}_grads"] = {n: p.grad.detach().float().cpu().clone()
                                            for n, p in module.named_parameters() if p.grad is not None}
                if scaled:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                times.append(time.perf_counter() - t0)
            out[f"{side}_step_times_s"] = times
            out[f"{side}_scale"] = float(scaler.get_scale()) if scaled else None
            out[f"{side}_weights"] = {n: t.detach().float().cpu().clone() for n, t in module.state_dict().items()}
    report = {k: v for k, v in out.items() if not k.endswith(("_output", "_grads", "_weights"))}
    report["output_rel"] = _rel(out["bigconv_output"], out["plain_output"])
    report["loss_rel"] = abs(out["bigconv_loss"] - out["plain_loss"]) / abs(out["plain_loss"])
    g = out["plain_grads"]
    report["grads_missing"] = sorted(set(g) ^ set(out["bigconv_grads"]))
    both = [n for n in g if n in out["bigconv_grads"]]
    # fp16's first scaled backward may overflow (the scaler then skips the step on both sides): such
    # gradients are counted, not compared.
    finite = [n for n in both if g[n].isfinite().all() and out["bigconv_grads"][n].isfinite().all()]
    report["grads_nonfinite"] = {side: sum(not out[f"{side}_grads"][n].isfinite().all() for n in both)
                                 for side in ("plain", "bigconv")}
    report["grad_rel_worst"] = max(((_rel(out["bigconv_grads"][n], g[n]), n) for n in finite), default=None)
    w = out["plain_weights"]
    report["weight_rel_worst"] = max((_rel(out["bigconv_weights"][n], w[n]), n) for n in w
                                     if w[n].is_floating_point() and w[n].norm() > 0)
    report["same_output_dtype"] = out["plain_output_dtype"] == out["bigconv_output_dtype"]
    return report


def report(path: str) -> None:
    from bigconv.harness.records import load

    print("| autocast | TF32 convs | output dtype (plain / bigconv) | output | loss | worst gradient | worst weight "
          "after the steps | scale (plain / bigconv) | step, plain / bigconv (ms) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in load(path):
        if "error" in r:
            print(f"| {r['dtype']} | | {r['error'][:80]} |")
            continue
        ms = lambda ts: f"{1e3 * min(ts[1:]):.1f}"  # noqa: E731 (the first step warms up)
        g, w = r["grad_rel_worst"], r["weight_rel_worst"]
        auto = "none (float32)" if r["dtype"] == "float32" else r["dtype"]
        print(f"| {auto} | {'yes' if r.get('cudnn_tf32', True) else 'no'} | "
              f"{r['plain_output_dtype'].split('.')[-1]} / {r['bigconv_output_dtype'].split('.')[-1]} | "
              f"{r['output_rel']:.1e} | {r['loss_rel']:.1e} | {g[0]:.1e} (`{g[1]}`) | {w[0]:.1e} (`{w[1]}`) | "
              f"{r['plain_scale']} / {r['bigconv_scale']} | {ms(r['plain_step_times_s'])} / "
              f"{ms(r['bigconv_step_times_s'])} |")


def main(argv=None) -> None:
    p = cli.parser("experiments.gpu_loop", __doc__)
    p.add_argument("--device", default="cuda", help="where both sides run (cpu: to check the script)")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float16"],
                   help="float32: no autocast (the floor the other rows are read against)")
    p.add_argument("--size", type=int, default=256, help="the images' edge")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per side")
    p.add_argument("--no-tf32", action="store_true", help="convolutions without TF32 (PyTorch's default allows it)")
    p.add_argument("--out", default="results/gpu_loop.jsonl", help="records file (appended)")
    p.add_argument("--report", action="store_true", help="print the table of --out's records, measuring nothing")
    args = p.parse_args(argv)
    if args.report:
        return report(args.out)
    from bigconv.runtime import spmd_launch as launch

    from .gpu_planner import device_env

    env = device_env(args.device)
    for name in args.dtypes:
        try:
            r = launch.run(rank, 1, (args.device, name, args.size, args.steps, not args.no_tf32), timeout=300, threads=4)[0]
        except Exception as exc:
            r = {"dtype": name, "device": args.device, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        append(args.out, {"kind": "gpu_loop", **r, "env": env})
        print(json.dumps(r, default=str), flush=True)


if __name__ == "__main__":
    main()
