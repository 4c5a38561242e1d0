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


def pick_device(kind: str, local_rank: int) -> torch.device:
    if kind == "cpu" or (kind == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("device='cuda' was asked for but this worker sees no GPU")
    # Round-robin: several workers may share one GPU.
    return torch.device("cuda", local_rank % torch.cuda.device_count())


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
