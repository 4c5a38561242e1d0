"""Where this process sits in a world started by a cluster launcher.

Detection tries torchrun, then SLURM, then LSF/jsrun; each is one small function of an environment
mapping, so the parsing is unit-tested with fake variables. Rank 0 is the driver.

Ports: the world takes one, ``port``, for its store (the gradient group and the RPC rendezvous
share it under their own key prefixes). It is ``MASTER_PORT``, except under torchrun: torchrun's
agent already hosts its own store at ``MASTER_PORT``, so the world takes ``MASTER_PORT + 2``.
``BIGCONV_PORT`` overrides both rules (e.g. when that port is taken on the launch node).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_PORT = 29500
AGENT_PORT_OFFSET = 2
"""Under torchrun the world's ports start this far above ``MASTER_PORT`` (the agent's store)."""


@dataclass(frozen=True)
class LaunchInfo:
    """One process's place in a launched world."""

    launcher: str
    """Which launcher set the environment: ``torchrun``, ``slurm`` or ``lsf``."""
    rank: int
    """Global rank; 0 is the driver, rank r > 0 is ``worker{r-1}``."""
    world_size: int
    """Driver plus workers."""
    local_rank: int
    """Rank among the processes on this host; picks the GPU."""
    local_world_size: int
    """Processes on this host; divides the host's cores into intra-op threads."""
    master_addr: str
    """Host of rank 0, where the gradient store and the RPC rendezvous live."""
    master_port: int
    """The launcher's ``MASTER_PORT`` (default 29500)."""
    port: int
    """The world's store port. Not ``master_port`` under torchrun, whose agent holds a store there;
    ``BIGCONV_PORT`` sets it outright."""
    agent_store: bool = False
    """A torchrun agent hosts a store at ``master_port`` (``TORCHELASTIC_RUN_ID`` is set)."""


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise ValueError(f"environment variable {key}={env[key]!r} is not an integer") from None


def _port(env: Mapping[str, str]) -> int:
    return _int(env, "MASTER_PORT") if "MASTER_PORT" in env else DEFAULT_PORT


def _world_port(env: Mapping[str, str], agent_store: bool) -> int:
    """The world's first port: ``BIGCONV_PORT``, else clear of a torchrun agent's store."""
    if "BIGCONV_PORT" in env:
        return _int(env, "BIGCONV_PORT")
    return _port(env) + (AGENT_PORT_OFFSET if agent_store else 0)


def from_torchrun(env: Mapping[str, str]) -> LaunchInfo | None:
    if not {"RANK", "WORLD_SIZE"} <= env.keys():
        return None
    world = _int(env, "WORLD_SIZE")
    # torchrun (torch.distributed.run / the elastic agent) names its run in every rank; plain
    # RANK/WORLD_SIZE set by hand or by another wrapper leave MASTER_PORT to the world.
    agent = "TORCHELASTIC_RUN_ID" in env
    return LaunchInfo(
        "torchrun",
        _int(env, "RANK"),
        world,
        _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
        _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world,
        env.get("MASTER_ADDR", "127.0.0.1"),
        _port(env),
        _world_port(env, agent),
        agent,
    )


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM nodelist such as ``gpu[003-005,9],login1``."""
    head = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if head is None:
        raise ValueError(f"cannot parse SLURM_NODELIST={nodelist!r}")
    prefix, _, ranges = head.groups()
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def from_slurm(env: Mapping[str, str]) -> LaunchInfo | None:
    if not {"SLURM_PROCID", "SLURM_NTASKS"} <= env.keys():
        return None
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or env.get("SLURM_JOB_NODELIST")
    addr = env.get("MASTER_ADDR") or (first_slurm_host(nodelist) if nodelist else "127.0.0.1")
    tasks_per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    local_world = re.match(r"\d+", tasks_per_node)
    world = _int(env, "SLURM_NTASKS")
    return LaunchInfo(
        "slurm",
        _int(env, "SLURM_PROCID"),
        world,
        _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
        int(local_world.group()) if local_world else world,
        addr,
        _port(env),
        _world_port(env, False),
    )


def _lsf_first_host(env: Mapping[str, str]) -> str:
    for key in ("LSB_DJOB_RANKFILE", "LSB_DJOB_HOSTFILE"):
        path = env.get(key)
        if path and os.path.exists(path):
            with open(path) as fh:
                hosts = [line.split()[0] for line in fh if line.strip()]
            # The first line is the launch (batch) node, which runs no rank under jsrun.
            if len(hosts) > 1:
                return hosts[1]
            if hosts:
                return hosts[0]
    hosts = env.get("LSB_HOSTS", "").split()
    return hosts[1] if len(hosts) > 1 else "127.0.0.1"


def from_lsf(env: Mapping[str, str]) -> LaunchInfo | None:
    if not {"JSM_NAMESPACE_RANK", "JSM_NAMESPACE_SIZE"} <= env.keys():
        return None
    world = _int(env, "JSM_NAMESPACE_SIZE")
    return LaunchInfo(
        "lsf",
        _int(env, "JSM_NAMESPACE_RANK"),
        world,
        _int(env, "JSM_NAMESPACE_LOCAL_RANK") if "JSM_NAMESPACE_LOCAL_RANK" in env else 0,
        _int(env, "JSM_NAMESPACE_LOCAL_SIZE") if "JSM_NAMESPACE_LOCAL_SIZE" in env else world,
        env.get("MASTER_ADDR") or _lsf_first_host(env),
        _port(env),
        _world_port(env, False),
    )


def detect(env: Mapping[str, str] | None = None, min_size: int = 2) -> LaunchInfo:
    """Parse the launcher environment, or explain which variables are missing. The driver mode needs
    ``min_size=2`` (a driver and a worker); the SPMD mode runs on one rank too."""
    env = os.environ if env is None else env
    for parse in (from_torchrun, from_slurm, from_lsf):
        info = parse(env)
        if info is not None:
            if not 0 <= info.rank < info.world_size:
                raise ValueError(f"{info.launcher}: rank {info.rank} is outside world size {info.world_size}")
            if info.world_size < min_size:
                raise ValueError(
                    f"{info.launcher} started {info.world_size} process; bigconv needs a driver and at least "
                    "one worker, so launch at least 2 processes"
                )
            return info
    raise ValueError(
        "World.from_env() found no launcher: set RANK/WORLD_SIZE (torchrun), SLURM_PROCID/SLURM_NTASKS "
        "(srun) or JSM_NAMESPACE_RANK/JSM_NAMESPACE_SIZE (jsrun); for a local run use World(workers=N)"
    )
