"""Loopback means loopback: no socket of a local World listens beyond 127.0.0.1; and nobody else in.

RPC runs pickled Python for whoever connects, so a listener on a wildcard address would let anyone
who can reach the machine run code in the driver or a worker. Loopback keeps other hosts out, not the
other accounts of this host (issue 52): a local World's store is a file only this account can open, and
the goodbye that ends the workers is named by the World's secret, so a process that reaches a store
(a launched world's TCP store) cannot end or steer the run through it. What stays open is in
docs/design.md, "Who can reach a world". A failure points at ``bigconv/runtime/netbind.py``
(``StoreFile``) or ``host.goodbye_keys``.
"""

from __future__ import annotations

import ipaddress
import os
import stat
import subprocess
import sys
import warnings

import psutil
import pytest
import torch

import bigconv
from bigconv.runtime import netbind
from bigconv.runtime.host import goodbye_keys
from bigconv.models import CNN1D, CNN2D

STRANGER = """
import datetime, json, sys
import torch.distributed as dist
found = {}
for port in json.loads(sys.argv[1]):
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=5))
    keys = store.list_keys()
    for key in ["bigconv-release", *[k for k in keys if "release" in k]]:
        store.set(key, "1")  # the goodbye every worker waited on
    for key in ["bigconv-released", *[k for k in keys if "released" in k]]:
        store.add(key, 100)
    found[port] = keys
print(json.dumps(found))
"""
"""Another account of the host, as issue 52 found it: it connects to a store port with no credential, lists
the keys, sets every goodbye it can name and counts every worker as gone."""


def stranger(ports: list[int]) -> dict:
    import json

    done = subprocess.run([sys.executable, "-c", STRANGER, json.dumps(ports)], capture_output=True, text=True,
                          timeout=60, check=True)
    return json.loads(done.stdout)


def listeners(pid: int) -> list[str]:
    return [c.laddr.ip for c in psutil.Process(pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN]


@pytest.mark.world(2)
@pytest.mark.timeout(120)
def test_local_world_listens_on_loopback_only(world):
    net = bigconv.parallelize(CNN2D(1, 2), world, grid=(1, 2))
    net.optimizer(torch.optim.SGD, lr=0.1)
    net.train_step(torch.randn(1, 1, 16, 16), torch.tensor([1]), torch.nn.CrossEntropyLoss())  # gloo pairs up
    found = {"driver": listeners(os.getpid())}
    found.update({name: listeners(p.pid) for name, p in zip(world.names, world._procs)})
    # Not vacuous: the driver listens for RPC, every worker for RPC and gloo.
    assert found["driver"] and all(found[n] for n in world.names), found
    wide = {who: ips for who, ips in found.items() if not all(ipaddress.ip_address(ip).is_loopback for ip in ips)}
    assert not wide, f"listening beyond loopback: {wide}"


@pytest.mark.world(2)
@pytest.mark.timeout(120)
def test_another_account_finds_no_store_of_a_local_world(world):
    """The driver listens on its RPC agent's port only: the store is a 0600 file in a 0700 folder of its own,
    which no other account can open. A stranger at every other port the driver listens on (the old store's)
    finds nothing, and the World trains on."""
    net = bigconv.parallelize(CNN2D(1, 2), world, grid=(1, 2))
    net.optimizer(torch.optim.SGD, lr=0.1)
    x, y = torch.randn(1, 1, 16, 16), torch.tensor([1])
    net.train_step(x, y, torch.nn.CrossEntropyLoss())
    agent = int(world._store.get("rpc_prefix_0/addrs/driver").decode().rsplit(":", 1)[1])
    others = sorted({c.laddr.port for c in psutil.Process().net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port != agent})
    found = stranger(others)
    net.train_step(x, y, torch.nn.CrossEntropyLoss())  # the workers are still there
    assert not world.broken and not world.dead_workers()
    assert others == [] and found == {}, f"the driver listens beyond its RPC agent: {found}"
    folder, path = os.stat(world._store_file.folder), os.stat(world._store_file.path)
    assert stat.S_IMODE(folder.st_mode) == 0o700 and stat.S_IMODE(path.st_mode) == 0o600
    assert folder.st_uid == path.st_uid == os.getuid()


@pytest.mark.own_world
@pytest.mark.timeout(180)
def test_a_stranger_at_a_launched_worlds_store_cannot_end_the_run(exclusive):
    """A launched world's store is a TCP port any account of rank 0's host reaches. The stranger lists its
    keys and sets every goodbye it can name: the goodbye keys are named by the World's secret (handed to the
    workers over RPC), so none of the listed keys is one and the run goes on, then ends cleanly."""
    from bigconv.runtime.netbind import listening_socket

    with listening_socket("127.0.0.1") as probe:
        port = probe.getsockname()[1]
    common = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "LOCAL_WORLD_SIZE": "2"}
    env = {**os.environ, **common, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "RANK": "1",
           "LOCAL_RANK": "1"}
    served = subprocess.Popen([sys.executable, "-c", "import bigconv; bigconv.World.from_env(device='cpu')"], env=env)
    try:
        with bigconv.World.from_env(device="cpu", timeout=60, env={**common, "RANK": "0", "LOCAL_RANK": "0"}) as world:
            net = bigconv.parallelize(CNN1D(1, 3), world)
            net.optimizer(torch.optim.SGD, lr=0.1)
            x, y = torch.randn(2, 1, 19), torch.tensor([0, 2])
            net.train_step(x, y, torch.nn.CrossEntropyLoss())
            keys = stranger([port])[str(port)]
            assert keys, "not vacuous: the stranger reached the store"
            net.train_step(x, y, torch.nn.CrossEntropyLoss())  # the worker is still there
            assert not any(k in key for k in goodbye_keys(world._secret) for key in keys)
            assert world._secret not in "".join(keys)
        assert served.wait(timeout=60) == 0, "the served rank did not leave cleanly"
    finally:
        if served.poll() is None:
            served.kill()


@pytest.mark.world(2)
def test_a_second_world_in_one_process_is_refused_before_starting(world):
    before = psutil.Process().children()
    with pytest.raises(ValueError, match="already has an open World.*close it first"):
        bigconv.World(workers=1)
    assert psutil.Process().children() == before  # nothing was spawned


def test_cluster_interface_prefers_what_the_user_named():
    assert netbind.cluster_interface("10.1.2.3", {"BIGCONV_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "eth0"}) == "ib0"
    assert netbind.cluster_interface("10.1.2.3", {"GLOO_SOCKET_IFNAME": "eth0"}) == "eth0"
    assert netbind.cluster_interface("127.0.0.1", {}) == netbind.loopback_interface()


def test_the_route_to_a_local_address_is_its_own_interface():
    for name, ips in netbind._interfaces().items():
        for ip in ips:
            if ":" not in ip:  # link-local IPv6 needs a scope; IPv4 is enough here
                assert netbind.route_interface(ip) == (netbind.loopback_interface()
                                                       if ipaddress.ip_address(ip).is_loopback else name)


def test_store_binds_the_named_address_only():
    store = netbind.host_store("127.0.0.1", 0, timeout=5)
    ips = [c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
           if c.status == psutil.CONN_LISTEN and c.laddr.port == store.port]
    assert ips == ["127.0.0.1"]
    del store


def test_a_taken_port_names_the_fix():
    with netbind.listening_socket("127.0.0.1") as taken:
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match="BIGCONV_PORT"):
            netbind.listening_socket("127.0.0.1", port)


def test_a_wildcard_listener_is_refused_unless_the_user_opts_in():
    for host in ("0.0.0.0", "::", "0", ""):
        with pytest.raises(ValueError, match="wildcard address.*BIGCONV_ALLOW_WILDCARD=1"):
            netbind.listening_socket(host)
    with pytest.warns(UserWarning, match="every interface of this host"):
        sock = netbind.listening_socket("0.0.0.0", allow_wildcard=True)
    with sock:
        assert sock.getsockname()[0] == "0.0.0.0"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        netbind.listening_socket("127.0.0.1").close()  # a named address: no word
