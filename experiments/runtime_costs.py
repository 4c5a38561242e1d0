"""What the runtime settings cost: RPC transport polling, the allocator, and idle time per step.

    python -m experiments.runtime_costs        # appends to results/runtime_costs.jsonl

- ``idle_cpu``: CPU seconds each process of an idle 2-worker World burns over 5 s, with the libuv
  transport (our default) and with TensorPipe's shared-memory transport.
- ``plain_allocator``: plain single-process CNN2D 2048^2 step time (1 thread) with glibc's default
  allocator and with ``bigconv.runtime.world.WORKER_ENV``.
- ``worker_busy``: over 4 training steps of CNN2D 2048^2 on 2 workers of 1 thread, each worker's
  CPU time (user and system) against the wall time: what it spends waiting is the rest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch

import bigconv
from bigconv.models import CNN2D
from bigconv.runtime.world import WORKER_ENV
from experiments.bench_core import append
from bigconv.harness.workload import Workload, environment
from bigconv.harness import cli

OUT = "results/runtime_costs.jsonl"
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process so far."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK


def _pids(world: bigconv.World) -> list[int]:
    return world.worker_pids + [os.getpid()]


def idle_cpu(transports: str) -> list[float]:
    os.environ["BIGCONV_RPC_TRANSPORTS"] = transports
    try:
        with bigconv.World(workers=2) as world:
            net = bigconv.parallelize(CNN2D(), world)
            net(torch.randn(1, 1, 32, 32))  # every pipe opened
            before = [sum(cpu_seconds(p)) for p in _pids(world)]
            time.sleep(5)
            return [sum(cpu_seconds(p)) - b for p, b in zip(_pids(world), before)]
    finally:
        del os.environ["BIGCONV_RPC_TRANSPORTS"]


def plain_step(env: dict) -> float:
    code = ("import json; from bigconv.harness.workload import Workload, train_plain; "
            "print(json.dumps(train_plain(Workload(model='cnn2d', size=2048, steps=2), 1)))")
    clean = {k: v for k, v in os.environ.items() if k not in WORKER_ENV}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                         check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return json.loads(out.stdout.strip().splitlines()[-1])["step_s"]


def worker_busy(steps: int = 4) -> dict:
    model, x, y = Workload(model="cnn2d", size=2048).build()
    with bigconv.World(workers=2, threads_per_worker=1) as world:
        net = bigconv.parallelize(model, world, grid=(2, 1))
        net.optimizer(torch.optim.SGD, lr=0.01)
        loss_fn = torch.nn.CrossEntropyLoss()
        net.train_step(x, y, loss_fn)
        before = [cpu_seconds(p) for p in _pids(world)]
        t0 = time.perf_counter()
        for _ in range(steps):
            net.train_step(x, y, loss_fn)
        wall = time.perf_counter() - t0
        after = [cpu_seconds(p) for p in _pids(world)]
    used = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before)]
    return {"wall_s": wall, "steps": steps, "user_s": [u for u, _ in used], "system_s": [s for _, s in used],
            "busy_fraction": [(u + s) / wall for u, s in used]}


def main(argv=None) -> None:
    cli.parser("experiments.runtime_costs", __doc__).parse_args(argv)  # --help describes the run; no options
    base = {"bench": "runtime_costs", "env": environment(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    for transports in ("uv", "shm,uv"):
        cpu = idle_cpu(transports)
        append(OUT, {**base, "kind": "idle_cpu", "transports": transports, "seconds": 5, "cpu_s": cpu})
        print(f"idle 2-worker World, transports {transports}: CPU s over 5 s (worker0, worker1, driver) "
              f"{[round(c, 2) for c in cpu]}", flush=True)
    for label, env in (("glibc default", {}), ("WORKER_ENV", WORKER_ENV)):
        step = plain_step(env)
        append(OUT, {**base, "kind": "plain_allocator", "allocator": label, "env_vars": env, "step_s": step})
        print(f"plain CNN2D 2048^2 step, 1 thread, {label}: {step:.3f} s", flush=True)
    busy = worker_busy()
    append(OUT, {**base, "kind": "worker_busy", **busy})
    print(f"2 workers x 1 thread, {busy['steps']} steps in {busy['wall_s']:.2f} s; busy fraction "
          f"(worker0, worker1, driver) {[round(b, 2) for b in busy['busy_fraction']]}; system s "
          f"{[round(s, 2) for s in busy['system_s']]}")


if __name__ == "__main__":
    main()
