"""What a worker still holds after each training step: the probe behind ``WORKER_ENV``'s MKL setting.

    python -m experiments.memory_probe --model cnn3d --size 64 --workers 8 --steps 5
    python -m experiments.memory_probe --mkl-cache ...       # MKL's per-thread buffer caching back on

After every step each worker reports its resident set and the bytes glibc's allocator has handed
out and not had back (``mallinfo2``: arena chunks in use plus mmapped chunks), with the number of
distinct threads its forward calls have run on. A single process holds the same after every step;
a worker whose allocations grow step after step keeps something per step or per thread (MKL's
per-thread GEMM buffers did: +4.8 MiB for each new RPC thread that ran a halo slab's convolution).
glibc only (Linux); prints one line per step, worker 0 first.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import threading

import torch
from bigconv.harness import cli

_THREADS: set[int] = set()


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def allocated_bytes() -> int:
    """Bytes glibc's malloc has handed out and not had back (all arenas plus mmapped chunks)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def track_forward_threads() -> None:
    """Worker side: note the thread of every forward call from now on."""
    from bigconv.runtime.model_part import ModelPart

    original = ModelPart.forward

    def forward(*args, **kwargs):
        _THREADS.add(threading.get_native_id())
        return original(*args, **kwargs)

    ModelPart.forward = forward


def snapshot() -> dict:
    """Worker side: what this process holds now."""
    from bigconv import memory

    return {"allocated_bytes": allocated_bytes(), "rss_bytes": memory.rss_bytes(), "forward_threads": len(_THREADS)}


def main(argv=None) -> None:
    import bigconv
    probe = importlib.import_module("experiments.memory_probe")  # workers cannot unpickle __main__'s functions
    from bigconv.harness.workload import Workload
    from bigconv.runtime.world import WORKER_ENV

    parser = cli.parser("experiments.memory_probe", __doc__)
    parser.add_argument("--model", default="cnn3d", help="a benchmark model")
    parser.add_argument("--size", type=int, default=64, help="input edge")
    parser.add_argument("--workers", type=int, default=8, help="worker processes")
    parser.add_argument("--steps", type=int, default=5, help="training steps")
    parser.add_argument("--mkl-cache", action="store_true",
                        help="workers keep MKL's buffer caching (MKL disables it for any non-empty value)")
    args = parser.parse_args(argv)
    if args.mkl_cache:
        os.environ["MKL_DISABLE_FAST_MM"] = ""  # set here, so WORKER_ENV's value does not apply
    for key, value in WORKER_ENV.items():  # the plain run's settings, as in the sweeps
        os.environ.setdefault(key, value)
    w = Workload(model=args.model, size=args.size, steps=1)
    MiB = 2**20
    with bigconv.World(workers=args.workers, threads_per_worker=max(1, (os.cpu_count() or 1) // args.workers)) as world:
        world.call(probe.track_forward_threads, [()] * world.workers, "tracking threads")
        model, x, y = w.build()
        net = bigconv.parallelize(model, world)
        net.optimizer(torch.optim.SGD, lr=0.01, momentum=0.9)
        first = None
        for step in range(args.steps):
            net.train_step(x, y, torch.nn.CrossEntropyLoss())
            snaps = world.call(probe.snapshot, [()] * world.workers, "reading memory")
            first = first or snaps
            grown = [(s["allocated_bytes"] - f["allocated_bytes"]) / MiB for s, f in zip(snaps, first)]
            print(f"step {step}: worker0 allocated {snaps[0]['allocated_bytes'] / MiB:.1f} MiB, "
                  f"rss {snaps[0]['rss_bytes'] / MiB:.1f} MiB, forward threads {snaps[0]['forward_threads']}; "
                  f"allocations grown since step 0 (MiB, per worker): {', '.join(f'{g:.1f}' for g in grown)}",
                  flush=True)


if __name__ == "__main__":
    main()
