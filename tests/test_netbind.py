"""Loopback means loopback: no socket of a local World listens beyond 127.0.0.1.

RPC runs pickled Python for whoever connects, so a listener on a wildcard address would let anyone
who can reach the machine run code in the driver or a worker.
"""

from __future__ import annotations

import ipaddress
import os
import warnings

import psutil
import pytest
import torch

import bigconv
from bigconv.runtime import netbind
from bigconv.models import CNN2D


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
    # Not vacuous: the driver hosts the store, every worker a TensorPipe and a gloo listener.
    assert found["driver"] and all(found[n] for n in world.names), found
    wide = {who: ips for who, ips in found.items() if not all(ipaddress.ip_address(ip).is_loopback for ip in ips)}
    assert not wide, f"listening beyond loopback: {wide}"


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
