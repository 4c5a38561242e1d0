"""Launcher detection for World.from_env(), with fake environments (no cluster needed).

A wrong parse here puts the driver on the wrong host or two processes on one rank; a wrong port
collides with torchrun's own store (the world then never starts under a real torchrun). A wildcard
launch address (``MASTER_ADDR=0.0.0.0``) would put rank 0's store on every interface: every rank
refuses it before it connects (``netbind.check_launch_address``), unless the user opts in.
"""

from __future__ import annotations

import pytest

import bigconv
from bigconv.runtime import netbind
from bigconv.runtime.launch_env import AGENT_PORT_OFFSET, detect, first_slurm_host


def test_torchrun():
    info = detect({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                   "MASTER_ADDR": "node7", "MASTER_PORT": "1234"})
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size) == \
        ("torchrun", 3, 8, 1, 4)
    assert (info.master_addr, info.master_port, info.port, info.agent_store) == ("node7", 1234, 1234, False)


def test_torchrun_agent_store_port_is_left_alone():
    """torchrun's agent hosts a TCPStore at MASTER_PORT: the world's store must lie above it."""
    info = detect({"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "node7", "MASTER_PORT": "29650",
                   "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert info.agent_store and info.master_port == 29650
    assert info.port == 29650 + AGENT_PORT_OFFSET
    assert info.master_port != info.port


@pytest.mark.parametrize("extra", [{}, {"TORCHELASTIC_RUN_ID": "x"}, {"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}])
def test_bigconv_port_overrides(extra):
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "1000", "BIGCONV_PORT": "4000", **extra}
    assert detect(env).port == 4000
    slurm = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "BIGCONV_PORT": "4000"}
    assert detect(slurm).port == 4000 and detect(slurm).master_port == 29500


def test_slurm_uses_first_node_of_nodelist():
    info = detect({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                   "SLURM_NODELIST": "gpu[003-004,9]", "SLURM_TASKS_PER_NODE": "4(x2)"})
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == ("slurm", 5, 8, 1)
    assert info.master_addr == "gpu003" and info.local_world_size == 4 and info.master_port == info.port == 29500


@pytest.mark.parametrize("nodelist,first", [("login1", "login1"), ("a[1-3]", "a1"), ("n[07,9],m2", "n07")])
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_lsf_skips_launch_node(tmp_path):
    rankfile = tmp_path / "ranks"
    rankfile.write_text("batch1\nh41n01\nh41n01\nh41n02\n")
    info = detect({"JSM_NAMESPACE_RANK": "2", "JSM_NAMESPACE_SIZE": "12", "JSM_NAMESPACE_LOCAL_RANK": "2",
                   "JSM_NAMESPACE_LOCAL_SIZE": "6", "LSB_DJOB_RANKFILE": str(rankfile)})
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size) == \
        ("lsf", 2, 12, 2, 6)
    assert info.master_addr == "h41n01"


def test_torchrun_wins_over_slurm():
    assert detect({"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}).launcher == "torchrun"


@pytest.mark.parametrize("env,match", [
    ({}, "found no launcher"),
    ({"RANK": "0", "WORLD_SIZE": "1"}, "at least 2 processes"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "not an integer"),
    ({"RANK": "4", "WORLD_SIZE": "2"}, "outside world size"),
])
def test_bad_environments(env, match):
    with pytest.raises(ValueError, match=match):
        detect(env)


@pytest.mark.parametrize("host,wild", [("0.0.0.0", True), ("::", True), ("[::]", True), ("0", True), ("0.0", True),
                                       ("", True), ("::0", True), ("127.0.0.1", False), ("node7", False),
                                       ("10.0.0.1", False), ("::1", False)])
def test_wildcard_spellings(host, wild):
    assert netbind.is_wildcard(host) == wild


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["spmd", "driver"])
@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_wildcard_launch_address_is_refused_on_every_rank_with_the_fix(mode, rank):
    """Issue 52: ``MASTER_ADDR=0.0.0.0`` was accepted and the store listened on every interface."""
    env = {"RANK": rank, "WORLD_SIZE": "2", "LOCAL_RANK": rank, "MASTER_ADDR": "0.0.0.0", "BIGCONV_PORT": "29999"}
    with pytest.raises(ValueError, match=r"MASTER_ADDR='0.0.0.0' is a wildcard address.*Set MASTER_ADDR to the "
                                         r"address of rank 0's host.*127.0.0.1.*or set BIGCONV_ALLOW_WILDCARD=1"):
        bigconv.World.from_env(mode=mode, device="cpu", timeout=3, env=env)
    netbind.check_launch_address("0.0.0.0", {"BIGCONV_ALLOW_WILDCARD": "1"})  # the opt-in (rank 0 warns as it binds)
