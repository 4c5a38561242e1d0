"""The GPU check: on a machine with a GPU, the CUDA path of both modes, tested and measured in one go.

    python -m experiments.gpu_check            # equivalence + benchmark -> results/gpu_*.jsonl
    python -m experiments.gpu_check --quick    # equivalence + a short benchmark

1. Equivalence on CUDA (float64, against one process on the same GPU; tolerance 1e-9):
   - the driver mode: ``World(workers=2, device="cuda")`` (halos over RPC through the host, distributed
     autograd) on CNN2D and a U-Net-like model with BatchNorm;
   - the SPMD mode: 2 and 4 ranks sharing the GPU (NCCL point-to-point halos, local autograd), spatial
     grids and hybrid replicas=2.
   -> ``results/gpu_equivalence.jsonl``, one line per case, with ``ok``.
2. Benchmark: 4 ranks sharing one GPU, each capped with ``set_per_process_memory_fraction`` to emulate
   ``--card-gib`` cards, against 1 rank under the same cap: the largest CNN2D and UNet edge that trains
   (doubling, then bisection), the step time at that edge, and the fraction of halo time hidden behind
   compute, ``(t_blocking - t_overlap) / (t_blocking - t_compute)``, where ``t_blocking`` waits for every
   exchange as soon as it is posted (``BIGCONV_P2P_BLOCKING=1``) and ``t_compute`` is one rank on one
   shard's share of the image. -> ``results/gpu_bench.jsonl``.

Every probe runs in fresh processes with a timeout, so an out-of-memory probe or a hang costs its
timeout, never the run. Each record is written as soon as it is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback

import torch

MiB = 2**20


def append(path: str, record: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")


# -- 1. equivalence ------------------------------------------------------------------------------------
def _cases():
    import torch.nn as nn

    from bigconv.models import CNN2D

    def unet_like():
        return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.ConvTranspose2d(8, 4, 2, stride=2),
                             nn.Conv2d(4, 3, 1))

    return {
        "cnn2d": (lambda: CNN2D(in_channels=1, num_classes=3), (4, 1, 37, 29), "class"),
        "unet_like-bn": (unet_like, (4, 1, 32, 24), "pixel"),
    }


def _compare(world, name: str, grid, replicas: int = 1, on_gpu: bool = True) -> dict:
    """The SPMD mode takes the model and batch on its GPU; the driver mode takes them on the host
    (its workers move their copies and shards to their GPUs)."""
    import torch.nn as nn

    from bigconv.verify import compare_training

    factory, shape, kind = _cases()[name]
    torch.manual_seed(0)
    dev = "cuda" if on_gpu else "cpu"
    model = factory().double().to(dev)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=g, dtype=torch.float64).to(dev)
    y = (torch.randint(0, 3, (shape[0],), generator=g) if kind == "class"
         else torch.randint(0, 3, (shape[0], *shape[2:]), generator=g)).to(dev)
    kw = {"replicas": replicas} if replicas > 1 else {}
    r = compare_training(model, world, x, y, nn.CrossEntropyLoss(), grid=grid, **kw)
    r.pop("net")
    r["ok"] = r["keys_match"] and r["replicas_equal"] and all(
        r[k] <= 1e-9 for k in ("forward", "input_grad", "param_grads", "loss", "weights"))
    return r


def spmd_equivalence_rank(cases: list) -> list:
    import bigconv

    out = []
    with bigconv.World.from_env(mode="spmd", device="cuda", timeout=120) as world:
        for name, grid, replicas in cases:
            try:
                out.append({"case": name, "grid": grid, "replicas": replicas, **_compare(world, name, grid, replicas)})
            except Exception as exc:
                out.append({"case": name, "grid": grid, "replicas": replicas, "ok": False,
                            "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
    return out


def equivalence(out: str, base: dict) -> int:
    import bigconv
    from bigconv.runtime import spmd_launch as launch

    failures = 0

    def record(r):
        nonlocal failures
        failures += not r.get("ok")
        append(out, {**base, **{k: v for k, v in r.items() if k != "traceback"}})
        print(f"{r['mode']:6} {r['case']:14} grid={r['grid']} R={r.get('replicas', 1)}: "
              f"{'ok' if r.get('ok') else 'FAILED ' + str(r.get('error', r))}", flush=True)

    try:
        with bigconv.World(workers=2, device="cuda", timeout=120) as world:
            for name, grid in (("cnn2d", (2, 1)), ("unet_like-bn", (1, 2))):
                try:
                    record({"mode": "driver", "case": name, "grid": grid,
                            **_compare(world, name, grid, on_gpu=False)})
                except Exception as exc:
                    record({"mode": "driver", "case": name, "grid": grid, "ok": False, "error": f"{exc}"})
    except Exception as exc:
        record({"mode": "driver", "case": "world", "grid": None, "ok": False, "error": f"{exc}"})
    for ranks, cases in ((2, [("cnn2d", (2, 1), 1), ("unet_like-bn", (1, 2), 1)]),
                         (4, [("cnn2d", (2, 2), 1), ("unet_like-bn", (2, 1), 2), ("cnn2d", (1, 2), 2)])):
        try:
            for r in launch.run(spmd_equivalence_rank, ranks, (cases,), timeout=600)[0]:
                record({"mode": "spmd", "ranks": ranks, **r})
        except Exception as exc:
            record({"mode": "spmd", "ranks": ranks, "case": "launch", "grid": None, "ok": False, "error": f"{exc}"})
    return failures


# -- 2. benchmark ------------------------------------------------------------------------------------------
def _probe(model: str, size: int, ranks: int, fraction: float, blocking: bool = False, steps: int = 3,
           grid=None) -> dict | None:
    from bigconv.harness.spmd_workload import train_spmd
    from bigconv.harness.workload import Workload

    depth = 3
    w = Workload(model=model, size=size, steps=steps, depth=depth)
    env_before = os.environ.get("BIGCONV_P2P_BLOCKING")
    os.environ["BIGCONV_P2P_BLOCKING"] = "1" if blocking else "0"
    try:
        return train_spmd(w, ranks, grid=grid, device="cuda", memory_fraction=fraction, timeout=300)
    except Exception as exc:
        return {"error": str(exc)[:2000]}
    finally:
        if env_before is None:
            os.environ.pop("BIGCONV_P2P_BLOCKING", None)
        else:
            os.environ["BIGCONV_P2P_BLOCKING"] = env_before


def largest(model: str, ranks: int, fraction: float, start: int, multiple: int, out: str, base: dict,
            max_probes: int) -> tuple[int, dict | None]:
    """Largest edge (a multiple of ``multiple``) that trains: doubling from ``start``, then bisection."""
    good, bad, best = 0, None, None
    size = start
    for _ in range(max_probes):
        r = _probe(model, size, ranks, fraction, steps=1)
        ok = r is not None and "error" not in r
        append(out, {**base, "kind": "probe", "model": model, "ranks": ranks, "size": size, "ok": ok,
                     "error": None if ok else r.get("error", "")[:500],
                     "step_s": r.get("step_s") if ok else None})
        print(f"  {model} ranks={ranks} edge={size}: {'fits' if ok else 'fails'}", flush=True)
        if ok:
            good, best = size, r
        else:
            bad = size
        if bad is None:
            size *= 2
        else:
            nxt = (good + bad) // 2 // multiple * multiple
            if nxt <= good or bad - good <= max(multiple, good // 32):
                break
            size = nxt
    return good, best


def bench(out: str, base: dict, card_gib: float, quick: bool) -> None:
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = min(1.0, card_gib * 2**30 / total)
    print(f"GPU {torch.cuda.get_device_name(0)}: {total / 2**30:.0f} GiB; cap per process {fraction:.3f} "
          f"(~{card_gib:g} GiB)", flush=True)
    for model, multiple in (("cnn2d", 8), ("unet", 8)):
        found = {}
        for ranks in (1, 4):
            edge, rec = largest(model, ranks, fraction, 2048, multiple, out, base,
                                max_probes=4 if quick else 9)
            found[ranks] = edge
            append(out, {**base, "kind": "largest", "model": model, "ranks": ranks, "card_gib": card_gib,
                         "edge": edge, "step_s": rec["step_s"] if rec else None})
            print(f"{model}: largest edge on {ranks} rank(s) capped at {card_gib:g} GiB each: {edge}", flush=True)
        edge = found[4] // 2 // multiple * multiple or 1024  # a size both modes comfortably train
        overlap = _probe(model, edge, 4, fraction, grid=(2, 2))
        blocking = _probe(model, edge, 4, fraction, blocking=True, grid=(2, 2))
        compute = _probe(model, edge // 2, 1, fraction)  # one shard's share, no halos
        rec = {**base, "kind": "overlap", "model": model, "edge": edge, "ranks": 4}
        if all(r and "error" not in r for r in (overlap, blocking, compute)):
            t_o, t_b, t_c = overlap["step_s"], blocking["step_s"], compute["step_s"]
            hidden = (t_b - t_o) / (t_b - t_c) if t_b > t_c else None
            rec.update(step_overlap_s=t_o, step_blocking_s=t_b, step_compute_only_s=t_c, hidden_fraction=hidden,
                       halo_wait_s=[p["stats"]["wait_s"] for p in overlap["per_rank"]])
            print(f"{model} {edge}²: step {t_o:.3f}s (blocking {t_b:.3f}s, compute only {t_c:.3f}s): "
                  f"{'n/a' if hidden is None else f'{hidden:.0%}'} of halo time hidden", flush=True)
        else:
            rec["error"] = [r.get("error") if r else None for r in (overlap, blocking, compute)]
        append(out, rec)
        try:  # the driver mode at the same edge, side by side
            import bigconv
            from bigconv.harness.workload import Workload, train_distributed

            with bigconv.World(workers=4, device="cuda", timeout=300) as world:
                r = train_distributed(Workload(model=model, size=edge, steps=3), world, grid=(2, 2))
            append(out, {**base, "kind": "driver_mode", "model": model, "edge": edge, "workers": 4,
                         "step_s": r["step_s"]})
            print(f"{model} {edge}² driver mode, 4 workers: step {r['step_s']:.3f}s", flush=True)
        except Exception as exc:
            append(out, {**base, "kind": "driver_mode", "model": model, "edge": edge, "error": str(exc)[:2000]})
            print(f"driver mode at {edge}²: {exc}", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--card-gib", type=float, default=16.0, help="the card each rank emulates")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--out-dir", default="results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check needs a CUDA GPU; on CPU the same paths run in the test suite (gloo)")
    from bigconv.harness.workload import environment

    base = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "env": environment()}
    failures = equivalence(os.path.join(args.out_dir, "gpu_equivalence.jsonl"), {**base, "bench": "gpu_equivalence"})
    print(f"equivalence: {failures} failure(s)", flush=True)
    if not args.skip_bench:
        bench(os.path.join(args.out_dir, "gpu_bench.jsonl"), {**base, "bench": "gpu"}, args.card_gib, args.quick)
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
