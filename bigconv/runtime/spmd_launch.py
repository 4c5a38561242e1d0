"""Start N local SPMD ranks, as torchrun would, and collect what each returns (tests, benchmarks).

Each rank is a fresh process (``spawn``) with torchrun's variables set, calling ``fn(*args)``; the
parent waits at most ``timeout`` seconds, then kills every rank still running and names them, so a
hang in a rank is an error, never a hung test.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback

from .netbind import listening_socket


FAILED_GRACE_S = 15.0
"""After one rank failed, how long the others get to report before they are killed."""


class RankFailure(RuntimeError):
    """A rank raised, died or ran past the timeout; the message names it."""


def _free_port() -> int:
    sock = listening_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    return port


def _entry(fn, args, rank: int, size: int, env: dict, results) -> None:
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(size)})
    try:
        results.put((rank, "ok", fn(*args)))
    except BaseException as exc:
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run(fn, ranks: int, args: tuple = (), *, timeout: float = 300.0, threads: int = 1,
        env: dict | None = None, partial: bool = False) -> list:
    """``fn(*args)`` on ``ranks`` local ranks; their return values in rank order.

    With ``partial``, a rank that raised or died gives a ``RankFailure`` in its place instead of
    raising (to test failures); the timeout holds either way.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    from .world import WORKER_ENV

    # The allocator reads its settings at process start, so they go into the environment the ranks
    # inherit (the driver mode's workers and the benchmarks' plain runs get the same).
    base = {**WORKER_ENV, **{k: os.environ[k] for k in WORKER_ENV if k in os.environ}, "MASTER_ADDR": "127.0.0.1",
            "BIGCONV_PORT": str(_free_port()), "OMP_NUM_THREADS": str(threads), **(env or {})}
    procs = [ctx.Process(target=_entry, args=(fn, args, r, ranks, base, results), daemon=True,
                         name=f"bigconv-spmd-rank{r}") for r in range(ranks)]
    saved = dict(os.environ)
    os.environ.update(base)
    try:
        for p in procs:
            p.start()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    out, errors = {}, {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) + len(errors) < ranks:
            left = deadline - time.monotonic()
            if left <= 0 and errors and not partial:
                break
            if left <= 0:
                missing = [r for r in range(ranks) if r not in out and r not in errors]
                raise RankFailure(f"rank(s) {missing} did not finish within {timeout:g}s" +
                                  (f"; first error: {next(iter(errors.values()))}" if errors else ""))
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out and r not in errors]
                if dead:
                    time.sleep(0.5)  # a result may still be in the pipe
                    if results.empty():
                        if not partial:
                            raise RankFailure(f"rank(s) {dead} died (exit codes {[procs[r].exitcode for r in dead]})") \
                                from None
                        errors.update({r: f"died with exit code {procs[r].exitcode}" for r in dead})
                continue
            (out if status == "ok" else errors)[rank] = value
            if status != "ok" and not partial:
                # The others may wait on the failed rank until their own timeouts: do not wait for them.
                deadline = min(deadline, time.monotonic() + FAILED_GRACE_S)
        if partial:
            return [out[r] if r in out else RankFailure(f"rank {r}: {errors[r]}") for r in range(ranks)]
        if errors:
            rank = min(errors)
            raise RankFailure(f"rank {rank} failed: {errors[rank]}")
        return [out[r] for r in range(ranks)]
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
                p.join()
