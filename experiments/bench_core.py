"""Core benchmark: per-worker peak memory against a plain single process, step time, overhead.

    python -m experiments.bench_core                       # CNN2D at 2048^2, the README table
    python -m experiments.bench_core --size 512 --quick    # a quick look

Memory: CNN2D, batch 1, float32, on 1, 2 and 4 workers, each configuration in a fresh World (CPU:
peak RSS above the resident set after a warm-up step on a tiny image; GPU: the CUDA allocator's
peak), against the same model trained plainly in a fresh process under the same protocol.
Target: per-worker peak <= 1.15 * (single / N) + halo, where halo is the bytes a worker received
per step.

Time: the best of ``--steps`` steps of plain PyTorch with 1 thread, the SPMD mode on 2 ranks, the
driver mode on 2 workers on each transport (``p2p``, the default, and ``rpc``) and on 1 worker, all of
1 thread, interleaved for ``--rounds`` rounds. Targets: driver (p2p) on 2 workers <= 1.05x the SPMD
step and >= 1.8x plain (or within 5% of what ``experiments.host_bound`` says any 2-process split can
gain here); driver overhead on 1 worker <= 1.03x plain.

``--mode spmd`` measures the SPMD mode instead (ranks spawned as torchrun would, halos by gloo
point-to-point, no driver): the same memory table on 1, 2 and 4 ranks (target single/(N·peak) >= 0.95),
and step times of 1 and 2 ranks of 1 thread against plain PyTorch with 1 thread (targets: overhead
<= 1.05, speedup >= 1.8), with the driver mode's 2 workers measured in the same run for comparison.

Prints a markdown table and appends one JSON line per measurement to ``--out``.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict

import bigconv
from bigconv.runtime.world import WORKER_ENV
from bigconv.harness.spmd_workload import train_spmd
from bigconv.harness.workload import Workload, environment, plain_in_fresh_process, train_distributed
from bigconv.harness import cli

MiB = 2**20


def append(path: str, record: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")


def memory_rows(w: Workload, workers: list[int], single: dict, out: str, base: dict) -> list[str]:
    rows = []
    for n in workers:
        with bigconv.World(workers=n, threads_per_worker=max(1, (os.cpu_count() or 1) // n)) as world:
            r = train_distributed(w, world, transport=base["transport"])
        peaks = [m["peak_bytes"] for m in r["per_worker"]]
        halo = max(m["recv_bytes"] for m in r["per_worker"]) / (w.steps + 1)
        bound = 1.15 * single["peak_bytes"] / n + halo
        record = {**base, "kind": "memory", "workers": n, "grid": r["grid"], "per_worker": r["per_worker"],
                  "peak_bytes_max": max(peaks), "single_peak_bytes": single["peak_bytes"],
                  "halo_bytes_per_step": halo, "target_bytes": bound, "meets_target": max(peaks) <= bound,
                  "single_over_n_peak": single["peak_bytes"] / (n * max(peaks))}
        append(out, record)
        rows.append(f"| {n} | {tuple(r['grid'])} | {max(peaks) / MiB:.1f} | {single['peak_bytes'] / n / MiB:.1f} | "
                    f"{halo / MiB:.2f} | {bound / MiB:.1f} | {'yes' if record['meets_target'] else 'NO'} | "
                    f"{record['single_over_n_peak']:.3f} |")
    return rows


DRIVER_TIME_RUNS = [
    ("spmd", "p2p", 2, "SPMD, 2 ranks x 1 thread"),
    ("driver", "p2p", 2, "driver mode (p2p), 2 workers x 1 thread"),
    ("driver", "rpc", 2, "driver mode (rpc), 2 workers x 1 thread"),
    ("driver", "p2p", 1, "driver mode (p2p), 1 worker x 1 thread (overhead)"),
]


def _timed(w: Workload, mode: str, transport: str, n: int) -> dict:
    if mode == "spmd":
        return train_spmd(w, n, threads=1)
    with bigconv.World(workers=n, threads_per_worker=1) as world:
        return train_distributed(w, world, transport=transport)


def time_rows(w: Workload, single: dict, out: str, base: dict, rounds: int) -> list[str]:
    """Plain PyTorch and every run of ``DRIVER_TIME_RUNS``, interleaved for ``rounds`` rounds (this host
    drifts by 10-20% over minutes); each figure is the median over rounds of the best step, and each
    ratio is taken against the plain step of its own round."""
    best: dict[str, list[float]] = {label: [] for *_, label in DRIVER_TIME_RUNS}
    ratios: dict[str, list[float]] = {label: [] for *_, label in DRIVER_TIME_RUNS}
    plain = [single["step_s"]]
    for rnd in range(rounds):
        if rnd:
            plain.append(plain_in_fresh_process(w, threads=1)["step_s"])
        for mode, transport, n, label in DRIVER_TIME_RUNS:
            r = _timed(w, mode, transport, n)
            best[label].append(r["step_s"])
            ratios[label].append(plain[-1] / r["step_s"])
            append(out, {**base, "kind": "time", "mode": mode, "transport": transport, "workers": n, "round": rnd,
                         "threads_per_worker": 1, "grid": r["grid"], "step_s": r["step_s"],
                         "step_times_s": r["step_times_s"], "single_step_s": plain[-1], "speedup": ratios[label][-1]})
    med = statistics.median
    rows = [f"| plain PyTorch, 1 thread | {med(plain):.3f} | 1.00 | |"]
    spmd2 = med(best[DRIVER_TIME_RUNS[0][3]])
    for *_, label in DRIVER_TIME_RUNS:
        rows.append(f"| {label} | {med(best[label]):.3f} | {med(ratios[label]):.2f} | "
                    f"{med(best[label]) / spmd2:.2f} |")
    append(out, {**base, "kind": "time-summary", "rounds": rounds, "plain_step_s": plain,
                 "best_step_s": best, "speedup_per_round": ratios})
    return rows


def spmd_memory_rows(w: Workload, ranks: list[int], single: dict, out: str, base: dict) -> list[str]:
    rows = []
    for n in ranks:
        r = train_spmd(w, n, threads=max(1, (os.cpu_count() or 1) // n))
        peaks = [m["peak_bytes"] for m in r["per_rank"]]
        ratio = single["peak_bytes"] / (n * max(peaks))
        append(out, {**base, "kind": "memory", "mode": "spmd", "ranks": n, "grid": r["grid"], "per_rank": r["per_rank"],
                     "peak_bytes_max": max(peaks), "single_peak_bytes": single["peak_bytes"],
                     "single_over_n_peak": ratio, "meets_target": ratio >= 0.95 or n == 1})
        rows.append(f"| {n} | {tuple(r['grid'])} | {max(peaks) / MiB:.1f} | {single['peak_bytes'] / n / MiB:.1f} | "
                    f"{ratio:.3f} |")
    return rows


def spmd_time_rows(w: Workload, single: dict, out: str, base: dict, rounds: int = 1) -> list[str]:
    rows = [f"| plain PyTorch, 1 thread | {single['step_s']:.3f} | {max(single['step_times_s']):.3f} | 1.00 | |"]
    runs = [(1, "spmd", "SPMD, 1 rank x 1 thread (overhead)"), (2, "spmd", "SPMD, 2 ranks x 1 thread (speedup)"),
            (2, "rpc", "driver mode (rpc), 2 workers x 1 thread (same run)")]
    for n, mode, label in runs:
        if mode == "spmd":
            r = train_spmd(w, n, threads=1)
            waits = [p["stats"]["wait_s"] / (w.steps + 1) for p in r["per_rank"]]
        else:
            with bigconv.World(workers=n, threads_per_worker=1) as world:
                r = train_distributed(w, world, transport="rpc")
            waits = []
        ratio = single["step_s"] / r["step_s"]
        append(out, {**base, "kind": "time", "mode": mode, "workers": n, "threads_per_worker": 1, "grid": r["grid"],
                     "step_s": r["step_s"], "step_times_s": r["step_times_s"], "single_step_s": single["step_s"],
                     "speedup": ratio, "halo_wait_s_per_step": waits})
        wait = f"{max(waits):.3f}" if waits else "n/a"
        rows.append(f"| {label} | {r['step_s']:.3f} | {max(r['step_times_s']):.3f} | {ratio:.2f} | {wait} |")
    return rows


def main_spmd(args, w: Workload, base: dict) -> None:
    _tables(args, w, {**base, "bench": "core-spmd"}, spmd_memory_rows, spmd_time_rows,
            "| ranks | grid | per-rank peak (MiB) | single / N (MiB) | single / (N·peak) |",
            "| run | best step (s) | worst step (s) | speedup over plain | halo wait per step, slowest rank (s) |",
            record_single_memory=False)


def _tables(args, w: Workload, base: dict, memory, timing, memory_head: str, time_head: str,
            record_single_memory: bool = True) -> None:
    """The memory table against the plain process with all cores, then (unless ``--skip-time``) the
    step-time table against the plain process with one thread."""
    single_mem = plain_in_fresh_process(w, threads=max(1, os.cpu_count() or 1))
    if record_single_memory:
        append(args.out, {**base, "kind": "memory", "workers": 0, "peak_bytes": single_mem["peak_bytes"],
                          "sources": single_mem["sources"]})
    print(f"\n{memory_head}\n{'|---' * memory_head.count(' | ')}|---|")
    for row in memory(w, [int(n) for n in args.workers.split(",")], single_mem, args.out, base):
        print(row, flush=True)
    print(f"\nsingle process peak: {single_mem['peak_bytes'] / MiB:.1f} MiB ({', '.join(single_mem['sources'])})")
    if args.skip_time:
        return
    single_time = plain_in_fresh_process(w, threads=1)
    append(args.out, {**base, "kind": "time", "workers": 0, "threads_per_worker": 1, "step_s": single_time["step_s"],
                      "step_times_s": single_time["step_times_s"]})
    print(f"\n{time_head}\n{'|---' * time_head.count(' | ')}|---|")
    for row in timing(w, single_time, args.out, base, args.rounds):
        print(row, flush=True)


def main(argv=None) -> None:
    parser = cli.parser("experiments.bench_core", __doc__)
    parser.add_argument("--size", type=int, default=2048, help="image edge (CNN2D, one image)")
    parser.add_argument("--workers", default="1,2,4", help="worker counts for the memory table")
    parser.add_argument("--steps", type=int, default=3, help="measured steps after one warm-up step")
    parser.add_argument("--out", default="results/bench_core.jsonl", help="results file the records are appended to")
    parser.add_argument("--skip-time", action="store_true", help="memory table only")
    parser.add_argument("--mode", choices=["driver", "spmd"], default="driver",
                        help="driver: a driver and its workers; spmd: ranks with no driver")
    parser.add_argument("--transport", choices=["p2p", "rpc"], default="p2p",
                        help="the driver mode's transport for the memory table (the time table runs both)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the driver-mode time table")
    args = parser.parse_args(argv)
    w = Workload(model="cnn2d", size=args.size, steps=args.steps)
    base = {"bench": "core", "workload": asdict(w), "env": environment(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "worker_env": {k: os.environ.get(k, v) for k, v in WORKER_ENV.items()},
            "rpc_transports": os.environ.get("BIGCONV_RPC_TRANSPORTS", "uv"), "transport": args.transport}
    print(f"CNN2D {w.size}x{w.size}, batch {w.batch}, {w.dtype}, width {w.width}, depth {w.depth}; "
          f"{os.cpu_count()} cores; torch {base['env']['torch']}")
    if args.mode == "spmd":
        return main_spmd(args, w, base)
    _tables(args, w, base, memory_rows, time_rows,
            "| workers | grid | per-worker peak (MiB) | single / N (MiB) | halo (MiB) | target (MiB) | meets | "
            "single / (N·peak) |",
            "| run | best step (s), median over rounds | speedup over plain | step / SPMD 2-rank step |")

if __name__ == "__main__":
    main()
