"""Ring attention's cost on the CPU: per-process peak memory and step time, ring vs gathered vs one process.

Global attention over the N = side x side positions of a map (``bigconv.ops.global_attention``), float32,
``--heads`` heads of ``--dim`` dims, batch 1, forward and backward of a sum of the output. Each configuration
runs in fresh processes (``ru_maxrss`` never resets) with bigconv's workers' allocator settings
(``WORKER_ENV``), the peak taken over the baseline after the inputs are made:

- one process: plain ``softmax(q kᵀ / √d) v`` with autograd, as torch runs it (the whole N x N scores);
- ring: P gloo processes on a P x 1 grid, ``_RingAttention`` (P - 1 passes forward, P backward);
- gathered: the same P processes, keys and values gathered, plain attention on them.

    python -m experiments.ring_attention --sides 32 64 --workers 4 --out benchmarks/ring_attention.md
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one(side: int, heads: int, dim: int, steps: int, queue) -> None:
    from bigconv.harness.attention_cost import inputs, rss_bytes

    torch.set_num_threads(1)
    q, k, v = inputs(side * side, heads, dim)
    base = rss_bytes()
    times = []
    for _ in range(steps):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        start = time.perf_counter()
        out = torch.softmax(leaves[0] @ leaves[1].transpose(-1, -2) / dim ** 0.5, -1) @ leaves[2]
        out.sum().backward()
        times.append(time.perf_counter() - start)
    queue.put((0, rss_bytes() - base, statistics.median(times[1:] or times)))


def _rank(rank: int, size: int, port: int, strategy: str, side: int, heads: int, dim: int, steps: int,
          queue) -> None:
    from bigconv.harness.attention_cost import rank_cost

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    peak, step = rank_cost(rank, size, strategy, side, heads, dim, steps)
    queue.put((rank, peak, step))


def run(kind: str, side: int, workers: int, heads: int, dim: int, steps: int) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    if kind == "one process":
        procs = [ctx.Process(target=_one, args=(side, heads, dim, steps, queue))]
    else:
        port = _free_port()
        procs = [ctx.Process(target=_rank, args=(r, workers, port, kind, side, heads, dim, steps, queue))
                 for r in range(workers)]
    for p in procs:
        p.start()
    got = [queue.get(timeout=900) for _ in procs]
    for p in procs:
        p.join(60)
    return {"kind": kind, "side": side, "positions": side * side, "processes": len(procs),
            "peak_mib": max(g[1] for g in got) / 2**20, "step_s": max(g[2] for g in got)}


def main(argv=None) -> None:
    from bigconv.runtime.world import WORKER_ENV

    for key, value in WORKER_ENV.items():  # as bigconv's workers run (freed tensors go back to the OS)
        os.environ.setdefault(key, value)
    ap = argparse.ArgumentParser(prog="python -m experiments.ring_attention", description=__doc__.split("\n")[0])
    ap.add_argument("--sides", type=int, nargs="+", default=[32, 64],
                    help="map sides (positions: side squared) (default: 32 64)")
    ap.add_argument("--workers", type=int, default=4, help="processes of the ring and gathered forms (default: 4)")
    ap.add_argument("--heads", type=int, default=2, help="attention heads (default: 2)")
    ap.add_argument("--dim", type=int, default=32, help="dims per head (default: 32)")
    ap.add_argument("--steps", type=int, default=3,
                    help="timed steps; the median of all but the first (default: 3)")
    ap.add_argument("--out", default=None, help="append the markdown table to this file (default: print only)")
    args = ap.parse_args(argv)
    rows = [run(kind, side, args.workers, args.heads, args.dim, args.steps)
            for side in args.sides for kind in ("one process", "ring", "gathered")]
    lines = ["| positions | form | processes | peak per process over baseline (MiB) | step (s) |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['positions']} ({r['side']}x{r['side']}) | {r['kind']} | {r['processes']} | {r['peak_mib']:.1f} | "
              f"{r['step_s']:.3f} |" for r in rows]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
