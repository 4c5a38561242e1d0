"""NCCL's rules, enforced on gloo (``bigconv.transport.comm_checks``), and the GPU path's choices, tested
without a GPU."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))  # the spawned ranks import nccl_cases from here
import nccl_cases  # noqa: E402

import bigconv  # noqa: E402
from bigconv.runtime import spmd_launch as launch  # noqa: E402
from bigconv.transport.comm_checks import CommChecks, order_mismatches  # noqa: E402

# -- one order of communication on every rank ----------------------------------------------------------
@pytest.mark.timeout(180)
def test_stride2_gradients_in_one_order_spmd():
    """The one-sided stride-2 exchange's gradient batch and the gradient allreduces: every rank issues
    them, per communicator, in one order (it did not: rank 0 posted two allreduces before the batch)."""
    per_rank = launch.run(nccl_cases.stride2_order, 2, timeout=150, env={"BIGCONV_COMM_CHECKS": "order,tag_free"})
    assert per_rank[0]["mismatches"] == per_rank[1]["mismatches"]
    assert per_rank[0]["mismatches"] == [], "\n".join(per_rank[0]["mismatches"])
    assert per_rank[0]["tag_free"]  # the world handed the mode down to its links


@pytest.mark.own_world
@pytest.mark.timeout(180)
def test_stride2_gradients_in_one_order_driver(exclusive):
    with bigconv.World(2, device="cpu", timeout=60, comm_checks="order") as world:
        world.call(nccl_cases.one_bucket_per_parameter, [()] * 2, "one bucket per parameter")
        net = bigconv.parallelize(nccl_cases.stride2_chain().double(), world, grid=(2, 1))
        world.comm_order_mismatches()
        nccl_cases.train_two_steps(net)
        problems = world.comm_order_mismatches()
    assert problems == [], "\n".join(problems)


def test_order_mismatches_compares_each_pair_per_group():
    ar = ("g", (0, 1, 2), "all_reduce", ((4,), "torch.float32"))
    batch01 = lambda me: ("g", (0, 1, 2), "p2p", {1 - me: (((2, 3),), ())} if me == 0 else {0: ((), ((2, 3),))})
    # rank 2 takes no part in the batch: only the pair (0, 1) must agree on where it sits
    same = {0: [ar, batch01(0)], 1: [ar, batch01(1)], 2: [ar]}
    assert order_mismatches(same) == []
    swapped = {0: [ar, batch01(0)], 1: [batch01(1), ar], 2: [ar]}
    (problem,) = order_mismatches(swapped)
    assert "ranks 0 and 1 differ at their operation 0" in problem
    h = ("h", (0, 1), "all_reduce", ())
    other_group = {0: [ar, batch01(0), h], 1: [h, ar, batch01(1)], 2: [ar]}
    assert order_mismatches(other_group) == []  # another communicator keeps its own order


def test_comm_checks_parse_names_the_modes():
    assert CommChecks.parse("order, tag_free") == CommChecks(order=True, tag_free=True)
    assert CommChecks.parse("") == CommChecks() and CommChecks.from_env({}) == CommChecks()
    assert CommChecks.parse("tag_free").text() == "tag_free"
    with pytest.raises(ValueError, match="BIGCONV_COMM_CHECKS takes .*order, tag_free.*'tagfree'"):
        CommChecks.parse("tagfree")


# -- NCCL matching: one tag for every message ----------------------------------------------------------
def _captured_batch(monkeypatch, **link_kw):
    import torch.distributed as dist

    from bigconv.transport.p2p import P2PLink

    seen = []
    monkeypatch.setattr(dist, "P2POp", lambda op, t, peer, group, tag: SimpleNamespace(tag=tag))
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: seen.extend(ops) or [])
    link = P2PLink(None, [0, 1], 0, 5.0, {"messages": 0, "bytes": 0, "recv_bytes": 0}, **link_kw)
    link.batch([(1, 7, torch.zeros(3)), (1, 8, torch.zeros(2))], [(1, 9, torch.zeros(4))])
    return seen


def test_tag_free_link_sends_every_message_with_one_tag(monkeypatch):
    assert [op.tag for op in _captured_batch(monkeypatch)] == [7, 8, 9]
    assert [op.tag for op in _captured_batch(monkeypatch, tag_free=True)] == [0, 0, 0]


# -- placement ------------------------------------------------------------------------------------------
def test_wire_refuses_tensors_off_the_device_or_strided(monkeypatch):
    from bigconv.transport import check_wire
    from bigconv.transport.p2p import P2PLink

    check_wire([torch.zeros(2, 3)], torch.device("cpu"), "x")
    with pytest.raises(RuntimeError, match="not contiguous.*must be contiguous and on cpu"):
        check_wire([torch.zeros(3, 2).t()], torch.device("cpu"), "a halo exchange")
    with pytest.raises(RuntimeError, match="on meta .*must be contiguous and on cpu"):
        check_wire([torch.zeros(2, device="meta")], torch.device("cpu"), "a halo exchange")
    link = P2PLink(None, [0, 1], 0, 5.0, {}, device="cuda")  # a CUDA world handed a CPU halo
    with pytest.raises(RuntimeError, match="a halo exchange: .* on cpu .*on cuda"):
        link.batch([(1, 0, torch.zeros(2))], [])


def _fake_gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_more_ranks_than_gpus_is_refused_before_any_process_group(monkeypatch):
    import psutil
    import torch.distributed as dist

    from bigconv.runtime.agent import pick_device
    from bigconv.runtime.spmd_world import SpmdWorld

    _fake_gpus(monkeypatch, 1)
    before = psutil.Process().children()
    with pytest.raises(ValueError, match="2 ranks on this node but only 1 visible GPU.*World\\(workers=1\\)"):
        bigconv.World(workers=2, device="cuda")
    assert psutil.Process().children() == before  # no worker was started
    with pytest.raises(ValueError, match="2 ranks on this node but only 1 visible GPU"):
        SpmdWorld(0, 2, 0, 2, "127.0.0.1", 1, device="cuda")
    assert not dist.is_initialized()
    launched = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for mode in ("driver", "spmd"):
        with pytest.raises(ValueError, match="4 ranks on this node but only 1 visible GPU"):
            bigconv.World.from_env(mode=mode, device="cuda", env=launched)
        assert not dist.is_initialized()
    assert pick_device("auto", 1, 2) == torch.device("cpu")  # auto: the GPUs only when there are enough
    _fake_gpus(monkeypatch, 2)
    assert pick_device("auto", 1, 2) == torch.device("cuda", 1) == pick_device("cuda", 1, 2)
    _fake_gpus(monkeypatch, 0)
    with pytest.raises(ValueError, match="sees no GPU; use device='cpu'"):
        pick_device("cuda", 0, 1)


# -- waits ----------------------------------------------------------------------------------------------
class _Work:
    def __init__(self) -> None:
        self.calls = []

    def wait(self, *args):
        self.calls.append(args)
        return True


def test_cuda_waits_do_not_spin_and_the_group_outlives_the_link():
    from datetime import timedelta

    from bigconv.transport import process_group_timeout, wait_timeout, wait_work

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert wait_timeout(cpu, 30) == timedelta(seconds=30)
    assert wait_timeout(cuda, 30) is None
    for device, expected in ((cpu, [(timedelta(seconds=30),)]), (cuda, [()])):
        work = _Work()
        wait_work(work, device, 30)
        assert work.calls == expected
    assert process_group_timeout(cpu, 30) == timedelta(seconds=30)
    # the driver gives up at 1.1 × timeout + 1 s, naming the late worker: NCCL's watchdog must be later
    assert process_group_timeout(cuda, 30).total_seconds() > 1.1 * 30 + 1


# -- NCCL's sockets on the world's interface --------------------------------------------------------------
def test_bound_to_sets_nccl_socket_ifname_and_keeps_it(monkeypatch):
    from bigconv.runtime import netbind

    for var in (*netbind.IFNAME_VARS, netbind.NCCL_IFNAME_VAR):
        monkeypatch.delenv(var, raising=False)
    with netbind.bound_to("lo"):
        assert os.environ["NCCL_SOCKET_IFNAME"] == "=lo" and os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    assert os.environ["NCCL_SOCKET_IFNAME"] == "=lo"  # NCCL reads it at its first collective, later


@pytest.mark.world(1)
@pytest.mark.timeout(120)
def test_local_workers_bind_nccl_to_loopback(world):
    from bigconv.runtime import netbind

    (value,) = world.call(nccl_cases.environment_variable, [("NCCL_SOCKET_IFNAME",)], "reading the environment")
    assert value == "=" + netbind.loopback_interface()


def test_spmd_groups_made_after_startup_bind_to_the_world_interface(monkeypatch):
    """Gloo reads GLOO_SOCKET_IFNAME at every group's creation: the mesh's groups (made at parallelize)
    must be made inside the world's binding too, not on whatever the host name resolves to."""
    import torch.distributed as dist

    from bigconv.runtime.spmd_world import SpmdWorld

    seen = []
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(dist, "new_group", lambda ranks: seen.append(os.environ.get("GLOO_SOCKET_IFNAME")) or "g")
    assert SpmdWorld._new_group(SimpleNamespace(ifname="ib7"), [0, 1]) == "g"
    assert seen == ["ib7"] and "GLOO_SOCKET_IFNAME" not in os.environ


def test_object_collectives_are_described_alike_on_source_and_placeholder_ranks(monkeypatch):
    """The source's list holds its objects, the others' placeholders: both record the same entry (a store's
    (path, tmp) pair against None once failed CI's order check although NCCL runs it)."""
    from bigconv.transport.comm_checks import OrderRecorder

    monkeypatch.setattr(dist, "broadcast_object_list", lambda objs, src=0, group=None: None)
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None: None)
    monkeypatch.setattr("bigconv.transport.comm_checks._group_key", lambda group: ("g", (0, 1)))
    recorder = OrderRecorder().install()
    try:
        dist.broadcast_object_list([(("a.zarr", "a.zarr.tmp"), None)], src=0)
        dist.broadcast_object_list([(None, None)], src=0)
        dist.all_reduce(torch.zeros(3))
    finally:
        recorder.uninstall()
    source, placeholder, tensor = recorder.take()
    assert source == placeholder == ("g", (0, 1), "broadcast_object_list", (1,))
    assert tensor[-1] == ((3,), "torch.float32")  # tensors are still described by shape and dtype
