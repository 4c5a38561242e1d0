"""What every process of a driver-mode world sets up the same way: its device and its RPC agent."""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Iterator

import torch
import torch.distributed.rpc as rpc


class WorldClosedError(ValueError, RuntimeError):
    """A closed World (of either mode) was used: bad input (a ValueError), and a RuntimeError as it
    always was."""


RPC_STORE_KEY = "bigconv-rpc"


def pick_device(kind: str, local_rank: int, local_size: int = 1) -> torch.device:
    """This rank's device: ``cuda:local_rank`` needs a GPU of its own for each of the node's ``local_size``
    ranks (NCCL refuses two ranks on one GPU: "Duplicate GPU detected"); ``auto`` takes the GPUs only
    when there are enough of them."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if kind == "cpu" or (kind == "auto" and gpus < max(1, local_size)):
        return torch.device("cpu")
    if gpus == 0:
        raise ValueError("device='cuda' was asked for but this process sees no GPU; use device='cpu'")
    check_gpus_per_rank(local_size, gpus)
    return torch.device("cuda", local_rank)


def check_gpus_per_rank(local_size: int, gpus: int) -> None:
    """One GPU per rank on a node, before any process group exists."""
    if local_size > gpus:
        raise ValueError(
            f"device='cuda' with {local_size} ranks on this node but only {gpus} visible GPU(s): NCCL needs a GPU "
            f"of its own for every rank. Start at most {gpus} rank(s) per node (e.g. torchrun --nproc-per-node "
            f"{gpus}, or World(workers={gpus})), or use device='cpu'")


def rpc_options(init_method: str, workers: int, timeout: float) -> rpc.TensorPipeRpcBackendOptions:
    # Each worker parks one thread per forward call and receives a message from every other shard
    # per exchange, so the pool grows with the world to never starve.
    # TensorPipe's shared-memory transport busy-polls: an idle process burnt ~0.65 of a core in our
    # measurement, which a worker's compute cannot spare when workers share a host's cores. The libuv
    # (TCP) transport waits on events instead; halos are small next to the compute they feed.
    # BIGCONV_RPC_TRANSPORTS (e.g. "ibv,uv" on InfiniBand) overrides it for the whole world.
    transports = os.environ.get("BIGCONV_RPC_TRANSPORTS", "uv").split(",")
    return rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=max(16, 2 * workers + 8), rpc_timeout=timeout, init_method=init_method,
        _transports=transports, _channels=["basic"] if transports == ["uv"] else None,
    )


@contextlib.contextmanager
def quiet_rpc_init() -> Iterator[None]:
    """RPC's init gathers device maps with ``all_gather_object`` on a raw gloo group, which torch
    itself then warns about as deprecated usage; nothing a user wrote, so not shown to them."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
        yield
