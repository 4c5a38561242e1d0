"""Faults: what a dead or stuck process costs. Time to the error, processes left, records lost.

    python -m experiments.faults                 # appends one line per scenario to results/faults.jsonl
    python -m experiments.faults --only worker_stop,driver_kill

Each scenario runs a fresh driver process training CNN2D (512^2, 2 workers, grid (2, 1), World
timeout ``--timeout``) that appends one record per finished step to a JSONL file, then injects:

- ``worker_kill_forward`` / ``_backward`` / ``_allreduce``: worker1 SIGKILLs itself as its next
  forward starts, as its backward reaches the model's output, or as it enters the gradient allreduce
  (worker0 is then inside the allreduce, waiting for it);
- ``worker_stop``: SIGSTOP to worker1 mid-training (a stalled process: alive, silent);
- ``driver_kill`` / ``driver_int``: SIGKILL / SIGINT (Ctrl-C) to the driver mid-training.

Measured: seconds from the fault to the driver's error (driver faults: to the last process gone),
the processes of the world (driver and workers, zombies not counted) still there 60 s after the
fault, and the step records lost (steps the driver reported done minus lines in its file).
Targets: error within 60 s, no process left, no record lost.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil

from bigconv.harness import records
from bigconv.harness.workload import environment
from bigconv.harness import cli

SCENARIOS = ("worker_kill_forward", "worker_kill_backward", "worker_kill_allreduce", "worker_stop", "driver_kill",
             "driver_int")
INJECTED = {"worker_kill_forward": "forward", "worker_kill_backward": "backward",
            "worker_kill_allreduce": "allreduce"}


# -- on worker1 (called by RPC) -------------------------------------------------------------------
def arm(host, kind: str) -> None:
    """Make this worker SIGKILL itself at the next forward, backward or gradient allreduce."""
    import torch.distributed as dist

    def die(*_):
        os.kill(os.getpid(), signal.SIGKILL)

    for replica in (p for p in host.parts.values() if hasattr(p, "model")):
        if kind == "forward":
            replica.model.register_forward_pre_hook(die)
        elif kind == "backward":
            def on_output(module, inputs, out):
                out.register_hook(die)  # returns a handle, which a forward hook must not return

            replica.model.register_forward_hook(on_output)
    if kind == "allreduce":
        dist.all_reduce = die


# -- the driver process -----------------------------------------------------------------------------
def drive(scenario: str, log_path: str, timeout: float, steps: int) -> None:
    import torch

    import bigconv
    from bigconv.models import CNN2D

    # A shell starts background jobs with SIGINT ignored, and Python then installs no KeyboardInterrupt
    # handler: restore it, as for a user at a terminal.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with bigconv.World(workers=2, timeout=timeout) as world:
        print("READY " + json.dumps({"driver": os.getpid(), "workers": world.worker_pids}), flush=True)
        net = bigconv.parallelize(CNN2D(1, 2), world, grid=(2, 1))
        net.optimizer(torch.optim.SGD, lr=0.01)
        x, y = torch.randn(1, 1, 512, 512), torch.tensor([1])
        for step in range(steps):
            if step == 2 and scenario in INJECTED:
                # by its module's name: workers cannot unpickle a function of the driver's __main__
                remote_arm = importlib.import_module("experiments.faults").arm
                world.on_hosts(remote_arm, [(INJECTED[scenario],)], "arming worker1", workers=[1])
                print(f"FAULT {time.time()}", flush=True)
            try:
                net.train_step(x, y, torch.nn.CrossEntropyLoss())
            except bigconv.WorkerFailure as exc:
                print(f"ERROR {time.time()} {exc}", flush=True)
                raise SystemExit(3) from None
            records.append(log_path, {"step": step})
            print(f"STEP {step}", flush=True)


# -- the orchestrator ---------------------------------------------------------------------------
def alive(pids: list[int]) -> list[int]:
    left = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
        except psutil.NoSuchProcess:
            pass
    return left


def run(scenario: str, timeout: float, folder: str) -> dict:
    log_path = os.path.join(folder, f"faults_{scenario}_steps.jsonl")
    if os.path.exists(log_path):
        os.unlink(log_path)
    cmd = [sys.executable, "-m", "experiments.faults", "--drive", scenario, "--log", log_path,
           "--timeout", str(timeout)]
    # The workers inherit the driver's stdout: read it on a thread, which a stuck pipe cannot block.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(line.strip() for line in proc.stdout), daemon=True)
    reader.start()
    pids: list[int] = []
    fault_t = None
    start = time.time()
    while fault_t is None and time.time() - start < 300 and proc.poll() is None:
        seen = list(lines)
        ready = [s for s in seen if s.startswith("READY")]
        if ready and not pids:
            info = json.loads(ready[0][6:])
            pids = [info["driver"], *info["workers"]]
        faults = [s for s in seen if s.startswith("FAULT")]
        if faults:
            fault_t = float(faults[0].split()[1])
        elif scenario not in INJECTED and "STEP 2" in seen:
            target = pids[2] if scenario == "worker_stop" else pids[0]
            fault_t = time.time()
            os.kill(target, {"worker_stop": signal.SIGSTOP, "driver_kill": signal.SIGKILL,
                             "driver_int": signal.SIGINT}[scenario])
        time.sleep(0.02)
    if fault_t is None:
        raise RuntimeError(f"{scenario}: the driver never reached the fault: {lines[-5:]}")
    end_t = None
    while time.time() < fault_t + 60:
        errors = [s for s in list(lines) if s.startswith("ERROR")]
        if scenario.startswith("driver"):
            if not alive(pids):
                end_t = end_t or time.time()
                break
        elif errors and end_t is None:
            end_t = float(errors[0].split()[1])
        if end_t is not None and not alive(pids):
            break
        time.sleep(0.1)
    while time.time() < fault_t + 60 and alive(pids):  # what is left a minute after the fault
        time.sleep(0.2)
    left = alive(pids)
    for pid in left:  # clean up after the measurement
        try:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    reader.join(10)
    stderr = proc.stderr.read()
    errors = [s for s in lines if s.startswith("ERROR")]
    done = sum(1 for s in lines if s.startswith("STEP"))
    kept = len(records.load(log_path)) if os.path.exists(log_path) else 0
    if os.path.exists(log_path):
        os.unlink(log_path)
    return {"bench": "faults", "scenario": scenario, "timeout_s": timeout,
            "seconds_to_error": round(end_t - fault_t, 2) if end_t else None,
            "error": errors[0].split(" ", 2)[2] if errors else None, "processes_left_after_60s": len(left),
            "steps_reported": done, "records_kept": kept, "records_lost": max(0, done - kept),
            "driver_exit_code": proc.returncode, "driver_stderr_tail": stderr.strip().splitlines()[-3:]}


def main(argv=None) -> None:
    parser = cli.parser("experiments.faults", __doc__)
    parser.add_argument("--only", default=",".join(SCENARIOS), help="comma-separated scenarios")
    parser.add_argument("--timeout", type=float, default=30.0, help="the World's timeout (seconds)")
    parser.add_argument("--out", default="results/faults.jsonl", help="results file the records are appended to")
    parser.add_argument("--drive", choices=SCENARIOS, help=argparse.SUPPRESS)
    parser.add_argument("--log", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=1000, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.drive:
        drive(args.drive, args.log, args.timeout, args.steps)
        return
    env = environment()
    folder = os.path.dirname(os.path.abspath(args.out))
    print("| scenario | seconds to error | processes left after 60 s | records lost | error |\n|---|---|---|---|---|")
    for scenario in args.only.split(","):
        r = {**run(scenario, args.timeout, folder), "env": env, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        records.append(args.out, r)
        print(f"| {scenario} | {r['seconds_to_error']} | {r['processes_left_after_60s']} | {r['records_lost']} | "
              f"{(r['error'] or '-')[:90]} |", flush=True)


if __name__ == "__main__":
    main()
