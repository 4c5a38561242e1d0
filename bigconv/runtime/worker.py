"""A worker process: joins the gradient group and RPC, then serves the driver until shutdown.

The functions below ``serve`` are the RPC entry points the driver calls; they are thin wrappers
around the worker's ``Replica`` objects.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import logging
import os
import signal
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from .. import transport
from ..memory import PeakMeter
from . import netbind
from .agent import RPC_STORE_KEY, pick_device, quiet_rpc_init, rpc_options
from ..transport import WorkerRuntime, process_group_timeout, worker_name
from ..transport.comm_checks import CommChecks, OrderRecorder
from ..transport.rpc import RpcLink

GRAD_PREFIX = "bigconv-grad"
log = logging.getLogger(__name__)


def serve(*, rank: int, world_size: int, addr: str, port: int, local_rank: int, device: str, threads: int,
          timeout: float, startup_timeout: float, ifname: str, local_size: int = 1, checks: str = "") -> None:
    """``checks``: the test modes of ``transport.comm_checks`` (a ``BIGCONV_COMM_CHECKS`` text)."""
    global _RECORDER
    torch.set_num_threads(threads)
    dev = pick_device(device, local_rank, local_size)
    comm_checks = CommChecks.parse(checks)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    store = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=startup_timeout))
    with netbind.bound_to(ifname):
        # The gradient group is initialised before RPC, so once the driver's init_rpc returns every
        # worker can already allreduce.
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo",
                                store=dist.PrefixStore(GRAD_PREFIX, store),
                                rank=rank - 1, world_size=world_size - 1, timeout=process_group_timeout(dev, timeout))
        _RECORDER = OrderRecorder().install() if comm_checks.order else None
        rt = WorkerRuntime(index=rank - 1, workers=world_size - 1, device=dev, timeout=timeout,
                           checks=comm_checks, grad_group=_own_grad_group(world_size - 1))
        rt.link = RpcLink(rt)  # the rpc transport's and the halo probes' (p2p replicas make their own)
        transport.set_runtime(rt)
        global _METER
        _METER = PeakMeter(dev)  # the idle baseline: imports, RPC and the process group, no model yet
        options = rpc_options(netbind.rendezvous_url(store, RPC_STORE_KEY), world_size - 1, timeout)
        with quiet_rpc_init():
            rpc.init_rpc(worker_name(rank - 1), rank=rank, world_size=world_size, rpc_backend_options=options)
    # Serve until the driver says goodbye. Waiting inside rpc.shutdown() instead would hit its
    # barrier timeout on any world that lives longer than rpc_timeout.
    while not _RELEASED.wait(2.0):
        try:
            store.check(["alive"])  # the driver hosts the store: if it is gone, so is the world
        except Exception:
            log.error("%s: the driver is gone; exiting", worker_name(rank - 1))
            os._exit(1)
    time.sleep(0.1)  # let the reply to release() leave before the agent stops
    rpc.shutdown(graceful=False)
    dist.destroy_process_group()


def _own_grad_group(workers: int):
    """The gradient sums' own communicator (see ``runtime.spmd_world``: never the halos' one)."""
    return dist.new_group(list(range(workers)))


_RELEASED = threading.Event()
_RECORDER: OrderRecorder | None = None


def comm_order_log() -> list | None:
    """What this worker issued since the last call, under the ``order`` check (None without it)."""
    return _RECORDER.take() if _RECORDER is not None else None


def release() -> None:
    """The driver's goodbye: every worker leaves serve() and joins the shutdown barrier."""
    _RELEASED.set()


# -- RPC entry points ------------------------------------------------------------------------------
def install(model_id: int, payload: bytes, transport_name: str = "p2p", seed: int = 0, compile: bool = False) -> None:
    from .replica import Replica

    transport.runtime().models[model_id] = Replica.from_payload(payload, transport_name, seed, compile)


def uninstall(model_ids: list[int]) -> None:
    models = transport.runtime().models
    for model_id in model_ids:
        models.pop(model_id, None)
    gc.collect()  # a replica's module tree holds reference cycles (hooks, the module path)


def installed_models() -> list[int]:
    return sorted(transport.runtime().models)


def replica(model_id: int):
    return transport.runtime().models[model_id]


def forward(model_id: int, *args):
    return replica(model_id).forward(*args)


def predict(model_id: int, *args) -> None:
    replica(model_id).predict(*args)


def prefetch(reads: list) -> None:
    from ..data import prefetch as ahead

    ahead.start(reads)


def step(model_id: int, cmd) -> float | tuple | None:
    return replica(model_id).step(cmd)


def keep_forward(model_id: int, *args):
    return replica(model_id).keep_forward(*args)


def step_from_context(model_id: int, context_id: int) -> None:
    replica(model_id).step_from_context(context_id)


def gradients(model_id: int, context_id: int):
    return replica(model_id).gradients(context_id)


def make_optimizer(model_id: int, cls, kwargs: dict) -> None:
    replica(model_id).make_optimizer(cls, kwargs)


def state_dict(model_id: int) -> dict:
    return replica(model_id).state_dict()


def checkpoint_state(model_id: int, full: bool) -> dict:
    return replica(model_id).checkpoint_state(full)


def load_checkpoint(model_id: int, model_state: dict, optimizer_state: dict | None, rng: dict | None) -> None:
    replica(model_id).load_checkpoint(model_state, optimizer_state, rng)


def set_training(model_id: int, mode: bool) -> None:
    replica(model_id).model.train(mode)


def transport_stats() -> dict:
    return dict(transport.runtime().stats)


_METER: PeakMeter | None = None


def reset_memory() -> None:
    """Start a new peak, and new traffic counts, from what this worker holds now (e.g. after a warm-up)."""
    _METER.reset()
    stats = transport.runtime().stats
    for key in stats:
        stats[key] = type(stats[key])()


def memory() -> dict:
    """This worker's peak memory above its idle baseline, with the device and sources used."""
    record = _METER.read()
    record["device"] = str(transport.runtime().device)
    return record


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
