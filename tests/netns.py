"""Two 'hosts' on one machine: network namespaces joined by a veth pair (needs root / CAP_NET_ADMIN).

Each namespace has only its loopback and its end of the pair, with an address from a private /24
that exists nowhere else (10.213.7.0/24), so a process started in one (``ip netns exec``) can reach
the other only through that link, as on two real nodes. Deleting a namespace also deletes the
veth end inside it, and with it the peer; ``teardown`` also removes a pair left in the root
namespace by a half-finished setup.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

SUBNET = "10.213.7"  # a private /24 used only inside the namespaces made here


@dataclass(frozen=True)
class Host:
    netns: str
    ifname: str  # the veth end inside this namespace (GLOO_SOCKET_IFNAME)
    addr: str

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns]


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (None when they can): probed by making and deleting one."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"dtprobe{os.getpid()}"
    made = _ip("netns", "add", probe)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted (needs root or CAP_NET_ADMIN): {made.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


def teardown(hosts: list[Host]) -> None:
    for host in hosts:
        _ip("netns", "del", host.netns)
        _ip("link", "del", host.ifname)  # only present if setup stopped before moving it; an error otherwise


@contextmanager
def two_hosts(tag: str | None = None) -> Iterator[tuple[Host, Host]]:
    """Namespaces dt<tag>a/dt<tag>b with veth ends dt<tag>a/dt<tag>b at SUBNET.1 and SUBNET.2."""
    tag = tag or str(os.getpid())
    hosts = [Host(f"dt{tag}{side}", f"dt{tag}{side}"[:15], f"{SUBNET}.{i}") for i, side in ((1, "a"), (2, "b"))]
    try:
        for host in hosts:
            _check(_ip("netns", "add", host.netns))
        a, b = hosts
        _check(_ip("link", "add", a.ifname, "netns", a.netns, "type", "veth", "peer", "name", b.ifname,
                   "netns", b.netns))
        for host in hosts:
            _check(_ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", host.ifname))
            _check(_ip("-n", host.netns, "link", "set", host.ifname, "up"))
            _check(_ip("-n", host.netns, "link", "set", "lo", "up"))
        yield a, b
    finally:
        teardown(hosts)


def _check(proc: subprocess.CompletedProcess[str]) -> None:
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(proc.args)} failed ({proc.returncode}): {proc.stderr.strip()}")
