"""A second host on this machine for multi-node tests: its own network namespace with its own IP
address, joined to this one by a veth pair (10.213.N.1 here, 10.213.N.2 there), where the machine
allows it (root and `ip netns`); elsewhere the "second host" is this one, at the same address."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import socket
import subprocess

from shardlm.distributed.network import host_ip

SUBNET = f"10.213.{os.getpid() % 200 + 1}"
NS = f"shardlm-{os.getpid()}"
RESOLVER_DIR = f"/etc/netns/{NS}"        # `ip netns exec` mounts its resolv.conf over /etc/resolv.conf
HOST_IF, NODE_IF = f"shl{os.getpid() % 100000}h", f"shl{os.getpid() % 100000}n"


@dataclasses.dataclass(frozen=True)
class SecondHost:
    head_ip: str            # this host's address, as the second host reaches it
    ip: str                 # the second host's address
    prefix: tuple[str, ...]  # what runs a command there
    why_not_separate: str | None = None    # None: a network of its own

    @property
    def separate(self) -> bool:
        return self.why_not_separate is None

    def command(self, *cmd: str) -> list[str]:
        return [*self.prefix, *cmd]

    @contextlib.contextmanager
    def without_route(self):
        """The second host has no route to anything but its own subnet for the duration."""
        sh(*self.command("ip", "route", "del", "default"))
        try:
            yield
        finally:
            sh(*self.command("ip", "route", "add", "default", "via", self.head_ip), check=False)


    @contextlib.contextmanager
    def name_server_that_does_not_answer(self):
        """For the duration, the second host asks a name server (on this host, port 53) that takes
        each query and never answers: each lookup there waits out its 1 s timeout."""
        resolv_conf = os.path.join(RESOLVER_DIR, "resolv.conf")
        quiet = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)     # a bound port: no "refused" reply
        quiet.bind((self.head_ip, 53))
        with open(resolv_conf) as f:
            before = f.read()
        try:
            with open(resolv_conf, "w") as f:          # in place: the namespace's mount shows it at once
                f.write(f"nameserver {self.head_ip}\noptions timeout:1 attempts:1\n")
            yield
        finally:
            with open(resolv_conf, "w") as f:
                f.write(before)
            quiet.close()


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    run = subprocess.run(cmd, capture_output=True, text=True)
    if check and run.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {run.stderr}")
    return run


@contextlib.contextmanager
def second_host():
    if os.geteuid() != 0 or not shutil.which("ip") or sh("ip", "netns", "add", NS, check=False).returncode != 0:
        yield _this_host("needs root and `ip netns`")
        return
    try:
        try:
            _veth_pair()
        except RuntimeError as e:
            yield _this_host(f"this machine cannot build a veth pair: {e}")
            return
        # `ip netns exec` mounts this over /etc/resolv.conf: no name server, so a lookup fails at once.
        # This host's name server cannot be reached from there, and each lookup (torch's store looks
        # up its peers' names) would wait out the resolver's timeout: 10 s a process.
        os.makedirs(RESOLVER_DIR, exist_ok=True)
        with open(os.path.join(RESOLVER_DIR, "resolv.conf"), "w") as f:
            f.write("# the second host of shardlm's tests: no name server\n")
        yield SecondHost(f"{SUBNET}.1", f"{SUBNET}.2", ("ip", "netns", "exec", NS))
    finally:
        sh("ip", "netns", "del", NS, check=False)          # and its end of the veth pair, with it the other
        shutil.rmtree(RESOLVER_DIR, ignore_errors=True)


def _this_host(why: str) -> SecondHost:
    here = host_ip()
    return SecondHost(here, here, (), why)


def _veth_pair() -> None:
    head, node = f"{SUBNET}.1", f"{SUBNET}.2"
    sh("ip", "link", "add", HOST_IF, "type", "veth", "peer", "name", NODE_IF)
    sh("ip", "link", "set", NODE_IF, "netns", NS)
    sh("ip", "addr", "add", f"{head}/24", "dev", HOST_IF)
    sh("ip", "link", "set", HOST_IF, "up")
    for cmd in (["ip", "addr", "add", f"{node}/24", "dev", NODE_IF], ["ip", "link", "set", NODE_IF, "up"],
                ["ip", "link", "set", "lo", "up"], ["ip", "route", "add", "default", "via", head]):
        sh("ip", "netns", "exec", NS, *cmd)
