"""A worker process: joins the process group and RPC, then serves the driver until it is released.

What the worker holds lives in its ``WorkerHost`` (``bigconv.runtime.host``), which the driver creates
and calls over RPC; this module only starts the process and waits for the goodbye.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from . import netbind
from .agent import RPC_STORE_KEY, pick_device, quiet_rpc_init, rpc_options
from .host import DEVICE_ENV, expected_goodbye
from ..transport import process_group_timeout, worker_name

GRAD_PREFIX = "bigconv-grad"
log = logging.getLogger(__name__)
WAIT_S = 2.0
"""How often a waiting worker looks whether its driver is still there."""


def serve(*, rank: int, world_size: int, addr: str, port: int, local_rank: int, device: str, threads: int,
          timeout: float, startup_timeout: float, ifname: str, local_size: int = 1, checks: str = "",
          store_file: str | None = None, driver_pid: int | None = None) -> None:
    """Join the world and serve until the driver releases this worker. The worker's state lives in its
    ``WorkerHost``, which the driver creates over RPC (``bigconv.runtime.host``); ``checks`` (the test
    modes of ``transport.comm_checks``) reach it from the driver too. A local World's worker opens the
    store file ``store_file`` and watches its parent ``driver_pid``; a launched one the TCP store at
    ``addr:port``."""
    torch.set_num_threads(threads)
    dev = pick_device(device, local_rank, local_size)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    os.environ[DEVICE_ENV] = str(dev)
    if store_file is not None:
        store = netbind.file_store(store_file, startup_timeout)
    else:
        store = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=startup_timeout))
    with netbind.bound_to(ifname):
        # The process group is initialised before RPC, so once the driver's init_rpc returns every
        # worker can already create the gradient group (collective) in its host.
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo",
                                store=dist.PrefixStore(GRAD_PREFIX, store),
                                rank=rank - 1, world_size=world_size - 1, timeout=process_group_timeout(dev, timeout))
        options = rpc_options(netbind.rendezvous_url(store, RPC_STORE_KEY), world_size - 1, timeout)
        with quiet_rpc_init():
            rpc.init_rpc(worker_name(rank - 1), rank=rank, world_size=world_size, rpc_backend_options=options)
    # Serve until the driver says goodbye in its store, under keys its secret names (this worker learns them
    # when the driver creates its host). Waiting inside rpc.shutdown() instead would hit its barrier timeout on
    # any world that lives longer than rpc_timeout.
    while True:
        keys = expected_goodbye()
        if keys is not None and _released(store, keys[0]):
            break
        if keys is None:
            time.sleep(0.05)
        if not _driver_alive(store, driver_pid):
            log.error("%s: the driver is gone; exiting", worker_name(rank - 1))
            # The last worker to leave removes the store's folder (no close() ran; one removed early would
            # hold the others' next store call in its wait for the file to reappear).
            if store_file is not None and store.add("bigconv-orphans", 1) == world_size - 1:
                netbind.StoreFile.remove_at(store_file)
            os._exit(1)
    store.add(keys[1], 1)
    time.sleep(0.1)  # let the driver see the count before the agent stops
    rpc.shutdown(graceful=False)
    dist.destroy_process_group()


def _driver_alive(store, driver_pid: int | None) -> bool:
    """A local World's driver is this process's parent; a launched one hosts the store (if it is gone, so is
    the world)."""
    if driver_pid is not None:
        return os.getppid() == driver_pid
    try:
        store.check(["alive"])
        return True
    except Exception:
        return False


def _released(store, key: str, wait_s: float = WAIT_S) -> bool:
    try:
        store.wait([key], timedelta(seconds=wait_s))
        return True
    except Exception:  # not yet (or the store is gone: the caller checks)
        return False


def main() -> None:
    # `kill -USR1 <pid>` prints every thread's stack: the first thing to look at when a worker hangs.
    faulthandler.register(signal.SIGUSR1)
    # Before any model is unpickled here: a torchvision model must import on a CPU-only torch.
    from ..engine import checkpointing
    from ..compat import allow_torchvision_without_ops

    allow_torchvision_without_ops()
    checkpointing.install()
    spec = json.loads(os.environ["BIGCONV_WORKER"])
    serve(**spec)


if __name__ == "__main__":
    main()
