"""Hosts for tests: network namespaces joined by a bridge, and Interleaf processes in them.

One hub namespace holds a bridge; each host is a namespace of its own with one veth
(`eth0`, its address on a private /24) whose other end is a port of that bridge. The
hosts reach each other and nothing else: no default route, and nothing is created in
the root namespace (each veth is made inside the hub with its peer moved straight into
its host), so no traffic can leave for another address. Cutting a host's cable sets its
bridge port down: its process stays alive, and every packet to or from it is dropped
silently, as on a partitioned network.

Names are unique per run (namespaces are global to the machine); `close` kills the
processes, then deletes every namespace, whatever happened before.
"""

from __future__ import annotations

import os
import pathlib
import secrets
import subprocess
import sys

from interleaf.clients.parent_death import PARENT_ENV
from interleaf.common.security import TOKEN_ENV

SUBNET = "10.213.0"
REPO = pathlib.Path(__file__).resolve().parent.parent


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30).stdout


class Hosts:
    def __init__(self, log_dir: pathlib.Path):
        self.prefix = f"il{secrets.token_hex(3)}"
        self.hub = f"{self.prefix}-hub"
        self.log_dir = log_dir
        self.namespaces: dict[str, str] = {}  # host -> its namespace
        self.addresses: dict[str, str] = {}  # host -> its address
        self.processes: list[subprocess.Popen] = []
        # Our children's token; no proxy: the hosts reach one another directly.
        self.env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        self.env[TOKEN_ENV] = secrets.token_urlsafe(32)
        _ip("netns", "add", self.hub)
        self.namespaces[""] = self.hub
        try:
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    def add(self, host: str) -> str:
        """A new host on the bridge; returns its address."""
        index = len(self.addresses) + 1
        namespace, port = f"{self.prefix}-{index}", f"port{index}"
        _ip("netns", "add", namespace)
        self.namespaces[host] = namespace
        _ip("-n", self.hub, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", namespace)
        _ip("-n", self.hub, "link", "set", port, "master", "br0", "up")
        address = f"{SUBNET}.{index}"
        _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", namespace, "link", "set", "eth0", "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        self.addresses[host] = address
        return address

    def routes(self, host: str) -> str:
        return _ip("-n", self.namespaces[host], "route", "show")

    def cut(self, host: str) -> None:
        """Pulls the host's cable: its bridge port goes down."""
        _ip("-n", self.hub, "link", "set", f"port{list(self.addresses).index(host) + 1}", "down")

    def heal(self, host: str) -> None:
        _ip("-n", self.hub, "link", "set", f"port{list(self.addresses).index(host) + 1}", "up")

    def command(self, host: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[host], *argv]

    def python(self, host: str, *args: str, log: str = "", stdout=subprocess.DEVNULL) -> subprocess.Popen:
        """`python ARGS` on the host, its stderr in LOG.log (default: the host's name).
        An `interleaf` command dies with this process (clients/parent_death.py: asked
        for by the child, as no preexec_fn may fork while gRPC runs here; `ip netns
        exec` execs the command in its place, so this process stays its parent)."""
        with open(self.log_dir / f"{log or host}.log", "ab") as stderr:
            process = subprocess.Popen(
                self.command(host, [sys.executable, *args]),
                cwd=REPO, env={**self.env, PARENT_ENV: str(os.getpid())}, stdout=stdout, stderr=stderr,
                start_new_session=True,
            )
        self.processes.append(process)
        return process

    def run(self, host: str, *args: str, timeout_s: float = 60) -> str:
        """A short `python ARGS` on the host; its stdout."""
        return subprocess.run(self.command(host, [sys.executable, *args]), cwd=REPO, env=self.env, check=True,
                              capture_output=True, text=True, timeout=timeout_s).stdout

    def log(self, host: str) -> str:
        return (self.log_dir / f"{host}.log").read_text()

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for process in self.processes:
            process.wait()
        for namespace in reversed(self.namespaces.values()):
            subprocess.run(["ip", "netns", "del", namespace], check=False, capture_output=True, timeout=30)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
