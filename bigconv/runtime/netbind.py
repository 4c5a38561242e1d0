"""Where a world's sockets listen: one interface, never a wildcard; and a local world's store, which has none.

RPC runs pickled Python for whoever connects, so every listener a world opens must sit on the one
interface its peers use: loopback for a local world, the interface of the launch address for a
cluster world. Three kinds of sockets listen:

- the world's TCP store (rank 0), which ``torch.distributed.TCPStore`` binds to ``::`` unless it is
  handed a socket that is already bound (``master_listen_fd``);
- TensorPipe's transport listener (each process), on the interface named by ``TP_SOCKET_IFNAME``;
- gloo's pairs (each process), on the interface named by ``GLOO_SOCKET_IFNAME``;
- NCCL's bootstrap and socket transport (each CUDA process), on the interface named by
  ``NCCL_SOCKET_IFNAME`` (``=name``: that interface exactly, not every name it prefixes).

RPC's own ``tcp://`` rendezvous would host a second store on a wildcard; ``bigconv://`` instead
hands RPC the world's store (under its own key prefix), so a world has exactly one store port.

Loopback keeps other hosts out, not other accounts of this host: ``TCPStore`` has no authentication and
lists its keys to whoever connects. A local World's store is therefore no socket at all but a file only
this account can open (``StoreFile``); a launched world's store has to be a socket every node reaches.
A wildcard address (``0.0.0.0``, ``::``) is refused unless ``BIGCONV_ALLOW_WILDCARD=1``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import socket
import tempfile
import warnings
from datetime import timedelta
from typing import Iterator
from urllib.parse import urlparse

import torch.distributed as dist

IFNAME_VARS = ("TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
ALLOW_WILDCARD_VAR = "BIGCONV_ALLOW_WILDCARD"
NCCL_IFNAME_VAR = "NCCL_SOCKET_IFNAME"
_STORES: dict[str, dist.Store] = {}


def _interfaces() -> dict[str, list[str]]:
    """Interface name -> its IPv4/IPv6 addresses."""
    import psutil

    return {name: [a.address.split("%")[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]
            for name, addrs in psutil.net_if_addrs().items()}


def interface_with(ip: str) -> str | None:
    """The name of the local interface that holds address ``ip``."""
    for name, addrs in _interfaces().items():
        if ip in addrs:
            return name
    return None


def loopback_interface() -> str:
    found = interface_with("127.0.0.1")
    if found is None:
        raise RuntimeError("this machine has no interface with address 127.0.0.1; a local World needs loopback")
    return found


def resolve(host: str) -> str:
    """``host`` as an IP address (the first IPv4 one when it has several)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    v4 = [i[4][0] for i in infos if i[0] == socket.AF_INET]
    return (v4 or [infos[0][4][0]])[0]


def route_interface(host: str) -> str:
    """The local interface this process reaches ``host`` through (no packet is sent)."""
    ip = resolve(host)
    if ipaddress.ip_address(ip).is_loopback:
        return loopback_interface()
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((ip, 9))  # a UDP connect only picks the route
        local = probe.getsockname()[0]
    name = interface_with(local)
    if name is None:
        raise RuntimeError(f"cannot tell which interface reaches {host} ({ip}); set BIGCONV_IFNAME")
    return name


def cluster_interface(master_addr: str, env=None) -> str:
    """The interface a cluster rank binds to: ``BIGCONV_IFNAME``, else one the user named for gloo or
    TensorPipe, else the route to the launch address."""
    env = os.environ if env is None else env
    for key in ("BIGCONV_IFNAME", *IFNAME_VARS):
        if env.get(key):
            return env[key]
    return route_interface(master_addr)


def nccl_ifname(ifname: str) -> str:
    """``NCCL_SOCKET_IFNAME``'s value for exactly ``ifname`` (a bare name would match every interface
    whose name starts with it)."""
    return f"={ifname}"


@contextlib.contextmanager
def bound_to(ifname: str) -> Iterator[None]:
    """TensorPipe and gloo, created inside this block, listen on ``ifname`` only; so does NCCL, whose
    variable stays set after the block: NCCL creates its communicators (and reads the variable) lazily,
    at a group's first collective, long after the process group was made."""
    saved = {k: os.environ.get(k) for k in IFNAME_VARS}
    os.environ.update({k: ifname for k in IFNAME_VARS})
    os.environ[NCCL_IFNAME_VAR] = nccl_ifname(ifname)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def is_wildcard(host: str) -> bool:
    """Whether ``host`` names every interface (``0.0.0.0``, ``::``, ``0``, ``[::]``, an empty name)."""
    text = host.strip().strip("[]")
    if text in ("", "*"):
        return True
    try:
        return ipaddress.ip_address(text).is_unspecified
    except ValueError:
        pass
    try:
        return socket.inet_aton(text) == bytes(4)  # IPv4 shorthand such as "0" or "0.0"
    except OSError:
        return False


def wildcard_allowed(env=None) -> bool:
    """The user's opt-in to a store on every interface (``BIGCONV_ALLOW_WILDCARD=1``)."""
    return (os.environ if env is None else env).get(ALLOW_WILDCARD_VAR, "") not in ("", "0")


def check_launch_address(host: str, env=None, name: str = "MASTER_ADDR") -> None:
    """Every rank of a launched world, before it connects: refuse a wildcard launch address, which would put
    rank 0's store on every interface of its host, unless the user opted in (``BIGCONV_ALLOW_WILDCARD=1``;
    rank 0 then warns as it listens)."""
    if is_wildcard(host) and not wildcard_allowed(env):
        raise ValueError(_wildcard_refusal(name, host))


def _wildcard_refusal(name: str, host: str) -> str:
    return (f"{name}={host!r} is a wildcard address: the world's store would listen on every interface of this "
            "host, for any host that reaches it (a store admits whoever connects, and RPC runs pickled Python). "
            f"Set {name} to the address of rank 0's host that the other ranks reach (127.0.0.1 for a run on one "
            f"node), or set {ALLOW_WILDCARD_VAR}=1 to listen on every interface anyway")


def listening_socket(host: str, port: int = 0, allow_wildcard: bool | None = None) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0: any free port) and listening; never on a wildcard address
    unless the user opted in (``allow_wildcard``; None: ``BIGCONV_ALLOW_WILDCARD=1``), with a warning."""
    ip = resolve(host) if host.strip() else "0.0.0.0"
    if is_wildcard(ip):
        if not (wildcard_allowed() if allow_wildcard is None else allow_wildcard):
            raise ValueError(_wildcard_refusal("the store's address", host))
        warnings.warn(f"listening on {ip}:{port or 'a free port'}, every interface of this host ({ALLOW_WILDCARD_VAR} "
                      "is set): any host that reaches it can use this world's store", stacklevel=2)
    sock = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((ip, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {ip}:{port} ({exc.strerror}); set BIGCONV_PORT to a free port") from exc
    sock.listen(512)
    return sock


def host_store(host: str, port: int, timeout: float, allow_wildcard: bool | None = None) -> dist.TCPStore:
    """The world's store, hosted by this process on ``host:port`` alone (port 0: a free one; a wildcard
    address only as ``listening_socket`` allows)."""
    sock = listening_socket(host, port, allow_wildcard)
    port = sock.getsockname()[1]
    return dist.TCPStore(resolve(host), port, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout), master_listen_fd=sock.detach())


class StoreFile:
    """A local World's store: a file only this account can open, in a folder of its own (mode 0700, under
    ``tempfile.gettempdir()``; the file 0600). No port: another account of this host has nothing to
    connect to, and cannot read or set a key. The workers get its path in their environment."""

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="bigconv-world-")  # 0700, owned by this account
        self.path = os.path.join(self.folder, "store")
        os.close(os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0), 0o600))

    def remove(self) -> None:
        """Remove the folder this object made (and only that)."""
        shutil.rmtree(self.folder, ignore_errors=True)

    @staticmethod
    def remove_at(path: str) -> None:
        """A worker whose driver died (no ``close`` ran) removes the folder of the store file at ``path``."""
        folder = os.path.dirname(path)
        if os.path.basename(folder).startswith("bigconv-world-"):
            shutil.rmtree(folder, ignore_errors=True)


def file_store(path: str, timeout: float) -> dist.FileStore:
    """The store of a local World at ``path`` (``StoreFile``), opened by the driver or a worker."""
    store = dist.FileStore(path, -1)  # -1: the World removes the file, not the last process to leave
    store.set_timeout(timedelta(seconds=timeout))
    return store


def rendezvous_url(store: dist.Store, key: str) -> str:
    """An RPC ``init_method`` that hands RPC ``store`` (registered under ``key`` in this process)."""
    _STORES[key] = store
    return f"bigconv://{key}"


def forget(key: str) -> None:
    _STORES.pop(key, None)


def _rendezvous(url: str, timeout=None, **kwargs):
    parsed = urlparse(url)
    query = dict(part.split("=", 1) for part in parsed.query.split("&") if "=" in part)
    key = parsed.netloc
    if key not in _STORES:
        raise ValueError(f"no store registered for {url}; it is created by bigconv.World only")
    yield _STORES[key], int(query.get("rank", -1)), int(query.get("world_size", -1))


dist.register_rendezvous_handler("bigconv", _rendezvous)
