"""The runtime: a driver process plus worker processes joined by RPC and a gradient process group.

The store: the driver hosts one; the workers' gradient group (gloo or nccl) and the RPC rendezvous each
use it under their own key prefix (``bigconv.runtime.netbind``). A local World's is a file only this account
can open (``netbind.StoreFile``); a launched world's a TCP store at ``port``. The driver holds no shard and
is not in the gradient group.

Security: RPC runs pickled Python for whoever connects. Every socket of a local world listens on
127.0.0.1 only; a cluster world listens on the interface of its launch address only
(``bigconv.runtime.netbind``), and belongs on a trusted network all the same. Each World has a secret
(128 random bits, handed to its workers over RPC, never through the store) that names the keys of its
goodbye (``host.goodbye_keys``), so no other process can end a run through a store it can reach.
What stays open to other accounts of a host: docs/design.md, "Who can reach a world".
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import subprocess
import sys
import threading
import time
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch.distributed.rpc as rpc
import torch.distributed.rpc.api as rpc_api

from . import launch_env, netbind
from .agent import RPC_STORE_KEY, WorldClosedError, check_gpus_per_rank, quiet_rpc_init, rpc_options
from ..geometry.boxes import check_positive_int
from .host import WorkerHost, goodbye_keys, on_host, on_part
from ..transport import WorkerFailure, worker_name
from ..transport.comm_checks import CommChecks, order_mismatches

log = logging.getLogger(__name__)

DRIVER = "driver"
DEAD_CHECK_S = 0.05
"""How often a driver waiting on its workers looks for a dead worker process."""
STARTUP_S = 60.0
"""The least time the workers' hosts get to start (their first collective), whatever the World's timeout."""

# Allocator settings for CPU workers (measured in experiments/bench_core.py):
# - A worker runs each forward on whichever RPC thread is free and its backward on autograd's
#   threads; glibc then kept freed activations in per-thread arenas (and raised its mmap threshold
#   after the first large free), so resident memory grew to several times the live tensors. A fixed
#   threshold returns every large tensor to the OS when it is freed.
# - Fresh pages for every large tensor then cost a page fault per 4 KiB, which doubled step times;
#   PyTorch's THP_MEM_ALLOC_ENABLE backs large tensors with 2 MiB transparent huge pages instead.
# - MKL's memory manager keeps a buffer (4.8 MiB for a 16-channel 3x3x3 kernel) in every thread
#   that ever ran one of its GEMMs, which oneDNN uses for thin or small convolutions such as a
#   shard's halo slabs. A worker runs each forward on whichever RPC thread is free, so a CNN3D worker
#   grew by 8 MiB a step, up to one buffer per pool thread (experiments/memory_probe.py measures it).
#   MKL_DISABLE_FAST_MM frees each buffer after its call; no step-time cost was measurable.
# Variables already set in the driver's environment win.
WORKER_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024), "THP_MEM_ALLOC_ENABLE": "1", "MKL_DISABLE_FAST_MM": "1"}


_REMOTE_ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?(\w+(?:Error|Failure|Exception|Operation)): (.+)$")


def remote_summary(exc: BaseException) -> str:
    """The remote exception's own one-line message, without the RPC layer's traceback dump.

    The full text stays on the raised error's ``__cause__``.
    """
    for line in reversed(str(exc).splitlines()):
        match = _REMOTE_ERROR_LINE.match(line.strip())
        if match:
            return f"{match.group(1)}: {match.group(2)}"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _fresh_rpc_counters() -> None:
    """RPC keeps per-process counters: init_rpc prefixes its rendezvous keys with a count of earlier
    inits, and its all-gathers number their rounds per set of worker names. Workers are always fresh
    processes, so a driver that starts another World must count from zero again.
    """
    with rpc._init_counter_lock:
        rpc._init_counter = 0
    rpc_api._all_gather_sequence_id.clear()
    rpc_api._all_gather_sequence_id_to_states.clear()


def _claim_process() -> None:
    """One World per process: a process holds one RPC agent (``torch.distributed.rpc``), and torch knows
    whether it has one."""
    if rpc.api._is_current_rpc_agent_set():
        raise ValueError(
            "this process already has an open World (or an RPC agent torch.distributed.rpc started for other "
            "code); a process can hold one RPC agent, so close it first (world.close(), or open worlds with "
            "`with bigconv.World(...) as world:`)"
        )


# What TensorPipe writes to stderr when a peer closes a pipe while the agent still reads from it.
# After a clean goodbye every agent does exactly that: each closes its pipes as it stops, and none
# is told that the others are stopping (the agent's own join would tell them, but it numbers its
# barrier rounds per process, so a driver's second World would wait forever).
_EXPECTED_AT_SHUTDOWN = re.compile(rb"encountered error when reading incoming request from \w+: (pipe closed|EOF)")


@contextlib.contextmanager
def expected_shutdown_noise_hidden() -> Iterator[None]:
    """Drop TensorPipe's closed-pipe lines from this process's stderr (fd 2) during the block.

    Only for the shutdown of a healthy world; every other line passes through unchanged, so a real
    error is still seen.
    """
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to filter
        yield
        return
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)

    def forward() -> None:
        with os.fdopen(read_end, "rb") as lines:
            for line in lines:
                if not _EXPECTED_AT_SHUTDOWN.search(line):
                    os.write(saved, line)

    relay = threading.Thread(target=forward, daemon=True, name="bigconv-stderr-relay")
    relay.start()
    try:
        yield
    finally:
        os.dup2(saved, 2)  # closes the pipe's last write end: the relay drains and ends
        relay.join(5.0)
        os.close(saved)


def _checks(value: CommChecks | str | None) -> CommChecks:
    if isinstance(value, CommChecks):
        return value
    return CommChecks.from_env() if value is None else CommChecks.parse(value)


class World:
    """A driver (this process) and ``workers`` worker processes.

    Use as a context manager: leaving it shuts RPC down, then the gradient group, also after an
    exception. ``timeout`` bounds every wait of a step (seconds); a dead or stuck worker becomes a
    ``WorkerFailure`` naming it. ``worker_env`` adds environment variables for the workers (default:
    ``WORKER_ENV``; variables already set in this process win). ``comm_checks`` (default:
    ``BIGCONV_COMM_CHECKS``) turns on the test modes of ``bigconv.transport.comm_checks``.

    ``device="cuda"`` needs a GPU for every worker (NCCL refuses two ranks on one GPU); ``"auto"`` takes
    the GPUs only when there are that many.
    """

    def __init__(
        self,
        workers: int,
        *,
        device: str = "cpu",
        threads_per_worker: int | None = None,
        timeout: float = 300.0,
        startup_timeout: float = 180.0,
        worker_env: dict[str, str] | None = None,
        comm_checks: CommChecks | str | None = None,
    ) -> None:
        check_positive_int(workers, "workers")
        if device not in ("cpu", "cuda", "auto"):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'auto', got {device!r}")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if threads_per_worker is not None:
            check_positive_int(threads_per_worker, "threads_per_worker")
        self.checks = _checks(comm_checks)
        if device == "cuda":  # before any process or group exists
            import torch

            check_gpus_per_rank(workers, torch.cuda.device_count() if torch.cuda.is_available() else 0)
        self.workers = workers
        self.timeout = float(timeout)
        self.device = device
        self.threads_per_worker = threads_per_worker or max(1, (os.cpu_count() or 1) // workers)
        self._start_bookkeeping()
        self._store = None
        self.worker_env = dict(WORKER_ENV if worker_env is None else worker_env)
        _claim_process()
        self._start_local(startup_timeout)

    def _start_bookkeeping(self) -> None:
        """What every new world starts with, whether it spawned its workers or a launcher did."""
        self.broken: str | None = None
        self._procs: list[subprocess.Popen] = []
        self._closed = self._closing = False
        self._orphan_contexts: list[int] = []  # contexts left when the world broke; see autograd_context
        self._retired_parts: list[int] = []  # parts whose owner is gone on the driver; see retire
        self._next_part = 0  # one id space for every part on this world's workers
        self._hosts: list = []  # each worker's WorkerHost, as an RRef (bigconv.runtime.host)
        # Known to this World's processes only: the workers get it over RPC with their hosts.
        self._secret = secrets.token_hex(16)
        self._store_file: netbind.StoreFile | None = None  # a local World's store (netbind.StoreFile)

    # -- startup -----------------------------------------------------------------------------
    def _start_local(self, startup_timeout: float) -> None:
        addr = "127.0.0.1"
        ifname = netbind.loopback_interface()
        store_file = netbind.StoreFile()  # no port: see netbind
        weakref.finalize(self, store_file.remove)  # also for a World never closed
        self._store_file = store_file
        self._store = netbind.file_store(store_file.path, startup_timeout)
        env = dict(os.environ)
        # TensorPipe logs every pipe closed at shutdown as a warning; keep workers' logs for real trouble.
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        env.update({k: v for k, v in self.worker_env.items() if k not in os.environ})
        env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")])
        # torch.set_num_threads only binds the calling thread's OpenMP pool; RPC and autograd threads
        # would otherwise start one OpenMP thread per core each and oversubscribe a shared host.
        env.setdefault("OMP_NUM_THREADS", str(self.threads_per_worker))
        for index in range(self.workers):
            spec = dict(rank=index + 1, world_size=self.workers + 1, addr=addr, port=0, local_rank=index,
                        device=self.device, threads=self.threads_per_worker, timeout=self.timeout,
                        startup_timeout=startup_timeout, ifname=ifname, local_size=self.workers,
                        checks=self.checks.text(), store_file=store_file.path, driver_pid=os.getpid())
            env["BIGCONV_WORKER"] = json.dumps(spec)
            entry = "from bigconv.runtime.worker import main; main()"
            self._procs.append(subprocess.Popen([sys.executable, "-c", entry], env=env))
        try:
            with netbind.bound_to(ifname):
                self._init_driver_rpc(startup_timeout)
            self._start_hosts()
        except BaseException:
            self._kill_local()
            store_file.remove()
            raise

    def _init_driver_rpc(self, startup_timeout: float) -> None:
        errors: list[BaseException] = []

        _fresh_rpc_counters()
        options = rpc_options(netbind.rendezvous_url(self._store, RPC_STORE_KEY), self.workers, self.timeout)

        def init() -> None:
            try:
                with quiet_rpc_init():
                    rpc.init_rpc(DRIVER, rank=0, world_size=self.workers + 1, rpc_backend_options=options)
            except BaseException as exc:  # surfaced in the caller's thread
                errors.append(exc)

        thread = threading.Thread(target=init, daemon=True, name="bigconv-rpc-init")
        thread.start()
        deadline = time.monotonic() + startup_timeout
        while thread.is_alive():
            thread.join(0.1)
            dead = self.dead_workers()
            if dead:
                raise WorkerFailure(f"{dead[0]} exited while the world was starting; see its output above")
            if time.monotonic() > deadline:
                raise WorkerFailure(f"the world did not start within {startup_timeout:g}s")
        if errors:
            raise errors[0]

    @classmethod
    def from_env(cls, *, mode: str = "driver", device: str = "auto", timeout: float = 300.0,
                 exit_workers: bool = True, env: dict[str, str] | None = None):
        """Join a world started by torchrun, srun or jsrun.

        ``mode="spmd"``: every rank returns a ``bigconv.spmd.SpmdWorld`` and runs the rest of the
        script itself (no driver; halos by point-to-point, see ``bigconv.spmd``).

        ``mode="driver"`` (the default):

        Rank 0 returns the driver's ``World``. Every other rank serves until the driver shuts
        down, then exits the process (or returns None with ``exit_workers=False``), so a script
        run on every rank continues on the driver only. The world's store listens on
        ``launch_env.LaunchInfo.port`` (clear of torchrun's own store) at the launch address only;
        every rank's RPC, gloo and NCCL sockets listen on one interface: ``BIGCONV_IFNAME``, else
        ``GLOO_SOCKET_IFNAME``/``TP_SOCKET_IFNAME``, else the one that routes to the launch address.
        ``device="cuda"`` needs a GPU per rank of a node (checked here, before any group exists).
        """
        if mode == "spmd":
            from .spmd_world import SpmdWorld

            return SpmdWorld.from_env(device=device, timeout=timeout, env=env)
        if mode != "driver":
            raise ValueError(f"mode must be 'driver' or 'spmd', got {mode!r}")
        info = launch_env.detect(env)
        netbind.check_launch_address(info.master_addr, env)
        if device == "cuda":  # every rank, the driver too, refuses before any group or RPC agent exists
            import torch

            check_gpus_per_rank(info.local_world_size, torch.cuda.device_count() if torch.cuda.is_available() else 0)
        threads = max(1, (os.cpu_count() or 1) // max(1, info.local_world_size))
        ifname = netbind.cluster_interface(info.master_addr, env)
        if info.rank != 0:
            from .worker import serve

            serve(rank=info.rank, world_size=info.world_size, addr=info.master_addr, port=info.port,
                  local_rank=info.local_rank, device=device, threads=threads, timeout=timeout,
                  startup_timeout=timeout, ifname=ifname, local_size=info.local_world_size,
                  checks=CommChecks.from_env(env).text())
            if exit_workers:
                sys.exit(0)
            return None
        self = cls.__new__(cls)
        self.checks = CommChecks.from_env(env)
        self.workers = info.world_size - 1
        self.timeout = float(timeout)
        self.device = device
        self.threads_per_worker = threads
        self._start_bookkeeping()
        _claim_process()
        self._store = netbind.host_store(info.master_addr, info.port, timeout, netbind.wildcard_allowed(env))
        _fresh_rpc_counters()
        options = rpc_options(netbind.rendezvous_url(self._store, RPC_STORE_KEY), self.workers, timeout)
        with netbind.bound_to(ifname), quiet_rpc_init():
            rpc.init_rpc(DRIVER, rank=0, world_size=info.world_size, rpc_backend_options=options)
        self._start_hosts()
        return self

    # -- calls ----------------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return [worker_name(i) for i in range(self.workers)]

    @property
    def worker_pids(self) -> list[int]:
        """The process ids of the workers this World started (empty for a world a launcher started)."""
        return [p.pid for p in self._procs]

    def dead_workers(self) -> list[str]:
        return [f"{worker_name(i)} (pid {p.pid}, exit code {p.returncode})"
                for i, p in enumerate(self._procs) if p.poll() is not None]

    def _dead_soon(self, within: float = 2.0) -> list[str]:
        """Dead local workers, allowing a dying one a moment to be reaped."""
        deadline = time.monotonic() + (within if self._procs else 0.0)
        while True:
            dead = self.dead_workers()
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.05)

    @property
    def closed(self) -> bool:
        """Whether ``close()`` has run (or is running): no more remote calls can be made."""
        return self._closed

    def check_usable(self) -> None:
        if self._closed and not self._closing:
            raise WorldClosedError("this World is closed; open a new one (`with bigconv.World(...) as world:`) "
                                   "and parallelize the model on it")
        if self.broken:
            raise WorkerFailure(f"this World is broken ({self.broken}); close it and create a new one")

    @property
    def rpc_timeout(self) -> float:
        """The RPC layer's own limit: longer than ours, so our diagnosis (which worker) comes first."""
        return 2 * self.timeout + 10

    def call(self, fn: Callable, args_per_worker: Sequence[tuple], what: str) -> list[Any]:
        """Run ``fn`` on every worker (worker i gets ``args_per_worker[i]``) and wait for all."""
        self.check_usable()
        futures = [rpc.rpc_async(name, fn, args=args, timeout=self.rpc_timeout)
                   for name, args in zip(self.names, args_per_worker)]
        return self.wait(futures, what)

    # -- the workers' hosts and their parts (bigconv.runtime.host) ---------------------------------
    def _start_hosts(self) -> None:
        """Create every worker's host (at once: each creates the gradient group, a collective), then
        tell each every worker's mailbox. On failure the driver's RPC agent goes, so a new World can start."""
        try:
            self._connect_hosts()
        except BaseException:
            rpc.shutdown(graceful=False)
            raise

    def _connect_hosts(self) -> None:
        self._hosts = [rpc.remote(name, WorkerHost, args=(i, self.workers, self.timeout, self.checks.text(),
                                                          self._secret),
                                  timeout=self.rpc_timeout) for i, name in enumerate(self.names)]
        # Start-up (each host makes the gradient group, a collective) gets at least STARTUP_S, whatever the
        # World's timeout: a short timeout bounds a stalled step, not the processes' first collective on a
        # loaded machine.
        mailboxes = self.wait_named([self.launch_on_host(w, WorkerHost.mailbox) for w in range(self.workers)],
                                    "starting the workers' hosts", timeout=max(self.timeout, STARTUP_S))
        self.on_hosts(WorkerHost.connect, [(mailboxes,)] * self.workers, "connecting the workers")

    def launch_on_host(self, worker: int, fn: Callable, *args) -> tuple[str, Any]:
        """Start ``fn(host, *args)`` on ``worker`` (``fn``: a ``WorkerHost`` method or a module function
        taking the host first); a ``(name, future)`` pair for ``wait_named``."""
        self.check_usable()
        name = worker_name(worker)
        return name, rpc.rpc_async(name, on_host, args=(self._hosts[worker], fn, args), timeout=self.rpc_timeout)

    def on_hosts(self, fn: Callable, args_per_worker: Sequence[tuple], what: str,
                 workers: Sequence[int] | None = None) -> list[Any]:
        """``fn(host, *args)`` on every worker (or ``workers``), worker i with ``args_per_worker[i]``."""
        workers = range(self.workers) if workers is None else workers
        return self.wait_named([self.launch_on_host(w, fn, *a) for w, a in zip(workers, args_per_worker)], what)

    def launch_part(self, worker: int, part_id: int, method: str, *args) -> tuple[str, Any]:
        """Start ``method(*args)`` of part ``part_id`` on ``worker``; a ``(name, future)`` pair."""
        self.check_usable()
        name = worker_name(worker)
        return name, rpc.rpc_async(name, on_part, args=(self._hosts[worker], part_id, method, args),
                                   timeout=self.rpc_timeout)

    def call_part(self, part_id: int, method: str, args_per_worker: Sequence[tuple], what: str,
                  workers: Sequence[int] | None = None) -> list[Any]:
        workers = range(self.workers) if workers is None else workers
        return self.wait_named([self.launch_part(w, part_id, method, *a) for w, a in zip(workers, args_per_worker)],
                               what)

    @property
    def parts_installed(self) -> int:
        """How many parts this world has installed so far (the next one's id)."""
        return self._next_part

    def install(self, factory: Callable, args_per_worker: Sequence[tuple], what: str) -> int:
        """Install ``factory(host, *args)`` on every worker as one new part; its id."""
        part_id, self._next_part = self._next_part, self._next_part + 1
        self.drop_retired()  # before this part takes their memory
        self.on_hosts(WorkerHost.install, [(part_id, factory, *a) for a in args_per_worker], what)
        return part_id

    def uninstall(self, part_ids: Sequence[int]) -> None:
        self.on_hosts(WorkerHost.uninstall, [(list(part_ids),)] * self.workers, "removing parts")

    def installed_parts(self) -> list[list[int]]:
        """The ids of the parts each worker holds."""
        return self.on_hosts(WorkerHost.installed, [()] * self.workers, "listing the workers' parts")

    def reset_peaks(self) -> None:
        """Every worker starts a new memory peak and new traffic counts from what it holds now."""
        self.on_hosts(WorkerHost.reset_peaks, [()] * self.workers, "resetting memory peaks")

    def memory(self) -> list[dict]:
        """Each worker's peak memory since it started (or since ``reset_peaks``), above its idle baseline."""
        return self.on_hosts(WorkerHost.memory, [()] * self.workers, "reading memory")

    def traffic(self) -> list[dict]:
        """Each worker's halo traffic and read counters (``transport.new_stats``)."""
        return self.on_hosts(WorkerHost.traffic, [()] * self.workers, "reading traffic")

    def wait(self, futures: Sequence, what: str) -> list[Any]:
        """Wait for one future per worker, in worker order; see ``wait_named``."""
        return self.wait_named(list(zip(self.names, futures)), what)

    def wait_named(self, futures: Sequence[tuple[str, Any]], what: str, timeout: float | None = None) -> list[Any]:
        """The results of ``(worker name, future)`` pairs within the timeout, in order; raise naming a
        dead, failed or late worker. Any subset of workers may appear, some more than once.

        The driver waits a little longer than the workers' own waits, so that a worker stuck on a
        halo reports which peer it is waiting for before the driver gives up on everyone.
        """
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + 1.1 * timeout + 1.0
        # Woken by each future as it completes (no polling latency on a step's critical path), and at
        # least every DEAD_CHECK_S to notice a worker process that died.
        woken = threading.Event()
        for _, fut in futures:
            fut.add_done_callback(lambda _f: woken.set())
        self._waiting = True  # stays set if anything (Ctrl-C included) escapes this wait
        while True:
            dead = self.dead_workers()
            if dead:
                self.broken = f"{dead[0]} died during {what}"
                raise WorkerFailure(self.broken)
            for name, fut in futures:
                if fut.done():
                    try:
                        fut.wait()
                    except Exception as exc:
                        dead = self._dead_soon()
                        if dead:  # a broken pipe is usually a dead process; say which
                            self.broken = f"{dead[0]} died during {what}"
                            raise WorkerFailure(self.broken) from exc
                        message = f"{name} failed during {what}: {remote_summary(exc)}"
                        late = sorted({n for n, f in futures if not f.done()})
                        if late:  # the others are probably waiting on the ones still busy
                            message = f"{', '.join(late)} did not finish {what} ({message})"
                        # Broken only on a structured fact: the worker raised WorkerFailure (a peer died,
                        # stalled or left an exchange), never because its text says "timeout" (every
                        # traceback through the reader does). Whether the others are still in step is
                        # the caller's to judge from their futures (ParallelModel._wait).
                        if isinstance(exc, WorkerFailure):
                            self.broken = message
                        raise WorkerFailure(message) from exc
            if all(f.done() for _, f in futures):
                results = [f.wait() for _, f in futures]
                self._waiting = False
                return results
            if time.monotonic() > deadline:
                late = sorted({n for n, f in futures if not f.done()})
                self.broken = f"{', '.join(late)} did not finish {what} within {timeout:g}s"
                raise WorkerFailure(self.broken)
            woken.wait(DEAD_CHECK_S)
            woken.clear()

    def settled(self, futures: Sequence, grace: float) -> bool:
        """Whether every future is done within ``grace`` seconds (e.g. every worker has failed the same
        way after one failed), with no worker dead."""
        deadline = time.monotonic() + grace
        while not all(f.done() for f in futures):
            if time.monotonic() > deadline or self.dead_workers():
                return False
            time.sleep(0.01)
        return not self.dead_workers()

    @contextlib.contextmanager
    def autograd_context(self) -> Iterator[int]:
        """A distributed-autograd context, released on the way out unless the world broke inside it.

        Releasing notifies every worker the context touched; after a failure some of them are dead
        or stuck in a collective, and the release once held the driver for minutes after the
        WorkerFailure had been raised. A broken world cannot be used again, so ``close`` releases
        such a context after the RPC agent is down, when no message is sent any more (the release
        also clears this thread's current context, which a later world needs).
        """
        import torch.distributed.autograd as dist_autograd

        context_id = dist_autograd._new_context()._context_id()
        try:
            yield context_id
        finally:
            if self.broken:
                self._orphan_contexts.append(context_id)
            else:
                dist_autograd._release_context(context_id)

    def retire(self, part_id: int) -> None:
        """A part's owner is gone on the driver (a parallel model): the part can go too. Called from a
        finalizer, so it only takes note (no RPC from inside garbage collection); ``drop_retired`` sends it."""
        self._retired_parts.append(part_id)

    def drop_retired(self) -> None:
        """Free the workers' retired parts. Without this a long-lived world (a notebook, a search over
        models, a test session) keeps every model it ever ran, weights and optimizer state."""
        if not self._retired_parts or self._closed or self.broken:
            return
        ids, self._retired_parts = self._retired_parts, []
        self.uninstall(ids)

    def _release_orphan_contexts(self) -> None:
        import torch.distributed.autograd as dist_autograd

        for context_id in self._orphan_contexts:
            try:
                dist_autograd._release_context(context_id)
            except RuntimeError as exc:  # released already, or the context died with the agent
                log.debug("autograd context %d: %s", context_id, exc)
        self._orphan_contexts.clear()

    def backward(self, context_id: int, loss, what: str) -> None:
        """Distributed backward from ``loss``; a worker lost on the way becomes a WorkerFailure.

        Its RPCs carry the agent's timeout, so a stalled worker cannot hold it forever either.
        """
        import torch.distributed.autograd as dist_autograd

        try:
            dist_autograd.backward(context_id, [loss])
        except RuntimeError as exc:
            dead = self._dead_soon()
            self.broken = f"{dead[0]} died during {what}" if dead else f"{what} failed: {remote_summary(exc)}"
            raise WorkerFailure(self.broken) from exc

    def comm_order_mismatches(self) -> list[str]:
        """Under the ``order`` check: where the workers issued their collectives and batches since the last
        call in orders NCCL could not run (empty when they agree)."""
        if not self.checks.order:
            raise ValueError("this world records no order; create it with comm_checks='order' "
                             "(or BIGCONV_COMM_CHECKS=order)")
        logs = self.on_hosts(WorkerHost.comm_order_log, [()] * self.workers, "reading the order of communication")
        return order_mismatches(dict(enumerate(logs)))

    # -- shutdown ---------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = self._closing = True
        # Left in the middle of a wait (Ctrl-C, or any error raised into it): the workers may be inside
        # a forward or an allreduce that will never finish, and a goodbye would wait for its timeout.
        healthy = not self.broken and not self.dead_workers() and not getattr(self, "_waiting", False)
        try:
            if healthy and self._release_workers():
                with expected_shutdown_noise_hidden():
                    rpc.shutdown(graceful=False)
                    self._reap(grace=30.0)
            else:
                rpc.shutdown(graceful=False)
        except Exception as exc:  # a failed goodbye must not hide the driver's own error
            log.warning("RPC shutdown was not clean: %s", exc)
        finally:
            self._reap(grace=30.0 if healthy else 0.0)
            self._release_orphan_contexts()
            self._store = None
            if self._store_file is not None:
                self._store_file.remove()
            netbind.forget(RPC_STORE_KEY)
            self._closing = False

    def _release_workers(self) -> bool:
        """Say goodbye in the store (every worker waits on it, under keys named by this World's secret);
        whether all of them left in time."""
        release, released = goodbye_keys(self._secret)
        self._store.set(release, "1")
        deadline = time.monotonic() + min(self.timeout, 30.0)
        while time.monotonic() < deadline:
            if self._store.add(released, 0) >= self.workers:
                return True
            time.sleep(0.01)
        return False

    def _reap(self, grace: float) -> None:
        deadline = time.monotonic() + grace
        for p in self._procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._kill_local()

    def _kill_local(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def __enter__(self) -> "World":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"World(workers={self.workers}, device={self.device!r}, threads_per_worker={self.threads_per_worker})"
