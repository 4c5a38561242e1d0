"""The context sweep's ``--jobs``: runs in fresh processes side by side, each taking as many cores as it uses.

A run is one child process (``python -c 'from experiments.context import child; child()'``, or the ``child`` command
given, its spec as JSON on stdin, its result as JSON on a line of stdout after ``RESULT``); only this parent writes
records, so a records file never holds two runs' lines interleaved. A whole-image run takes ``processes`` slots (its
workers, one thread each), every other run one; the queue is served in order, never overtaken, so a long run at its
head waits for its slots instead of being starved by short ones behind it. A failed run is named with the end of its
output and recorded nowhere; the others go on, and the sweep raises at the end naming every failure.

Pausing: the children and their World's workers stay in the sweep's process group, so ``kill -STOP -- -PGID``
pauses the whole sweep at once and ``kill -CONT -- -PGID`` resumes it. Time spent stopped does not count towards
a run's timeout: a poll that finds more than ``PAUSE_GAP`` seconds since the last one (the parent was stopped too)
moves every running run's start forward by that gap; ``cpu_timeout`` bounds a run by the CPU its process tree used,
which neither a pause nor a starved share (``nice``) inflates. A run is stopped with its whole process tree
(``_stop``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

CHILD = "from experiments.context import child; child()"
RESULT = "context-run-result: "
PAUSE_GAP = 10.0
"""Seconds between two polls (every ``poll``, 0.2 s) beyond which the sweep counts itself paused, not running."""
"""The child's result line starts with this (workers print to the same stdout)."""


@dataclass
class Job:
    spec: dict
    """What the child runs (``experiments.context.child`` reads it)."""
    slots: int
    """Cores it takes."""
    label: str
    """How messages name it."""
    item: object = None
    """The caller's own handle on it (given back to ``done``)."""


class RunFailed(RuntimeError):
    pass


def _tail(path: str, lines: int = 15) -> str:
    with open(path, errors="replace") as fh:
        return "".join(fh.readlines()[-lines:])


def run_jobs(jobs: list[Job], width: int, done: Callable[[Job, dict, float], None], echo=print,
             poll: float = 0.2, timeout: float | None = None, child: str = CHILD,
             cpu_timeout: float | None = None) -> None:
    """Run every job, at most ``width`` slots busy at once (a job wider than ``width`` runs alone); ``done(job,
    result, seconds)`` as each ends. A job still running after ``timeout`` seconds (time paused excluded), or whose
    process tree has used more than ``cpu_timeout`` CPU seconds (what a run costs, however starved or paused it
    was), is stopped with its own processes (a World's workers) and counted failed. Raises ``RunFailed`` naming
    every job that failed, after the others. ``child``: the Python code each run's process executes."""
    if width < 1:
        raise ValueError(f"jobs must be a positive integer, got {width!r}")
    queue = list(jobs)
    running: list[tuple[Job, subprocess.Popen, str, float]] = []
    failed: list[str] = []
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["OMP_NUM_THREADS"] = "1"
    # SIGTERM (a `timeout`, a scheduler's end of allocation) unwinds through the finally below, so no child
    # outlives the sweep; the records already written stay, and a rerun goes on from them.
    old = signal.signal(signal.SIGTERM, _raise_exit)
    last = time.perf_counter()
    used: dict[int, float] = {}  # CPU seconds of each run's process tree, sampled every CPU_POLL seconds
    sampled = 0.0
    try:
        while queue or running:
            busy = sum(min(j.slots, width) for j, *_ in running)
            while queue and busy + min(queue[0].slots, width) <= width:
                job = queue.pop(0)
                fd, log = tempfile.mkstemp(prefix="context_run_", suffix=".log")
                out = os.fdopen(fd, "w")
                # In the sweep's process group (a pause reaches it); ``_stop`` ends its process tree.
                proc = subprocess.Popen([sys.executable, "-c", child], stdin=subprocess.PIPE, stdout=out,
                                        stderr=subprocess.STDOUT, env=env, text=True)
                out.close()
                proc.stdin.write(json.dumps(job.spec))
                proc.stdin.close()
                running.append((job, proc, log, time.perf_counter()))
                busy += min(job.slots, width)
            time.sleep(poll)
            now = time.perf_counter()
            if now - last > PAUSE_GAP:  # the sweep was stopped (SIGSTOP) for this long: the runs were too
                running = [(j, p, lg, t0 + (now - last)) for j, p, lg, t0 in running]
            last = now
            if cpu_timeout and now - sampled > CPU_POLL:
                used = {p.pid: _tree_cpu(p.pid) for _, p, _, _ in running}
                sampled = now
            for item in [r for r in running if r[1].poll() is not None or (timeout and now - r[3] > timeout)
                         or (cpu_timeout and used.get(r[1].pid, 0.0) > cpu_timeout)]:
                running.remove(item)
                job, proc, log, t0 = item
                if proc.poll() is None:
                    _stop(proc)
                    why = (f"still running after its {timeout:g} s, stopped with its workers"
                           if timeout and now - t0 > timeout else
                           f"used more than its {cpu_timeout:g} CPU seconds, stopped with its workers")
                else:
                    why = f"exit status {proc.returncode}"
                result = _result(log) if proc.returncode == 0 else None
                if result is None:
                    failed.append(f"{job.label} ({why}):\n{_tail(log)}")
                    echo(f"  FAILED {job.label}: {why}; its output ends:\n{_tail(log)}")
                else:
                    done(job, result, time.perf_counter() - t0)
                os.unlink(log)
    finally:
        signal.signal(signal.SIGTERM, old)
        for _, proc, log, _ in running:
            _stop(proc)
            if os.path.exists(log):
                os.unlink(log)
    if failed:
        raise RunFailed(f"{len(failed)} run(s) failed; the others are recorded, and a rerun retries only these:\n"
                        + "\n".join(failed))


CPU_POLL = 5.0
"""Seconds between two samples of the runs' CPU time (``cpu_timeout``)."""


def _tree_cpu(pid: int) -> float:
    """CPU seconds used by a process, its reaped children and its live descendants (0 once it is gone)."""
    import psutil

    try:
        root = psutil.Process(pid)
        t = root.cpu_times()
        total = t.user + t.system + t.children_user + t.children_system
        for c in root.children(recursive=True):
            try:
                ct = c.cpu_times()
                total += ct.user + ct.system
            except psutil.NoSuchProcess:
                pass
        return total
    except psutil.NoSuchProcess:
        return 0.0


def _stop(proc: subprocess.Popen) -> None:
    """End a run and its process tree (its World's workers): SIGTERM, then SIGKILL after 30 s."""
    import psutil

    try:
        tree = [psutil.Process(proc.pid)]
        tree += tree[0].children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in tree:
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(tree, timeout=30)
        if not alive:
            break
        tree = alive
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


def _result(log: str) -> dict | None:
    with open(log, errors="replace") as fh:
        lines = [line[len(RESULT):] for line in fh.read().splitlines() if line.startswith(RESULT)]
    try:
        return json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None
