"""`--local N`: a coordinator and N stage servers as child processes of this one.

Children die with us: they run in their own session (a terminal's Ctrl-C reaches only
this process, which then stops them in order), and each asks the kernel to send it
SIGTERM should this process vanish without cleaning up.

The cluster is guarded as any deployment is: a random token of its own (unless given
one), handed to the children in their environment, never on their command lines (which
every user of the machine can read in /proc), and TLS when given certificates.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from functools import partial
from typing import Callable

import torch

from interleaf.clients.api import Client as ApiClient
from interleaf.clients.client import Client
from interleaf.clients.parent_death import PARENT_ENV
from interleaf.common.security import TOKEN_ENV, Security
from interleaf.stageserver.device import device_memory_bytes, physical_memory_bytes


LOG_TAIL_BYTES = 4000  # of a child's log, quoted when it dies during start


def local_devices(device: str, servers: int) -> list[str]:
    """One device per local server: GPU i for server i, or the CPU for all. auto takes
    the GPUs when there is one per server (NCCL refuses two ranks on one GPU) and CuPy's
    NCCL is installed to move tensors between them."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "auto":
        device = "cuda" if gpus >= servers and _nccl_installed() else "cpu"
    if device == "cpu":
        return ["cpu"] * servers
    if device != "cuda":
        raise ValueError(f"device={device!r} must be auto, cpu or cuda for local servers")
    if gpus < servers:
        raise ValueError(f"device='cuda' needs one GPU per local server: {servers} server{'s' * (servers != 1)}, "
                         f"{gpus} GPU{'s' * (gpus != 1)}")
    return [f"cuda:{i}" for i in range(servers)]


def memory_per_local_server(devices: list[str]) -> int:
    """What each local server offers: its GPU's memory, or its share of this machine's."""
    if devices[0] != "cpu":
        return device_memory_bytes(torch.device(devices[0]))
    return physical_memory_bytes() // len(devices)


def threads_per_local_server(servers: int, cores: int | None = None) -> int:
    """The torch threads each of `servers` local servers gets by default: the host's
    `cores` (this machine's by default) shared out, at least one each."""
    return max(1, (cores or os.cpu_count() or 1) // servers)


def _nccl_installed() -> bool:
    try:
        from cupy.cuda import nccl  # noqa: F401
    except ImportError:
        return False
    return True


class LocalCluster:
    def __init__(self, servers: int, threads_per_server: int | None = None, log_dir: str | None = None,
                 steps_per_call: int | None = None, memory_per_server: int | None = None,
                 device: str = "cpu", server_command: Callable[[int, list[str]], list[str]] | None = None,
                 security: Security | None = None, state_db: str | None = None, metrics: bool = True,
                 keep_jobs: int | None = None):
        self.count = servers
        # False: the stage servers keep no metrics (--metrics-port -1); the coordinator's stay.
        self.metrics = metrics
        # Every process of the cluster serves and calls with these: one certificate
        # (valid as server and client) and one token, a fresh random one by default.
        security = security or Security()
        self.security = dataclasses.replace(security, token=security.token or secrets.token_urlsafe(32))
        # Rewrites server i's command line (e.g. to start it in a namespace of its own).
        self.server_command = server_command or (lambda i, command: command)
        self.devices = local_devices(device, servers)
        self.threads = threads_per_server or threads_per_local_server(servers)
        # Each child's stderr goes to NAME.log here: the given folder, kept, or one of the
        # cluster's own, removed at stop; either way a child that dies at start is quoted.
        self.log_dir = log_dir
        self._own_log_dir: str | None = None
        self.steps_per_call = steps_per_call
        # The servers share this machine: each offers its share of the memory, so the
        # coordinator's admission check sees what the machine can really hold.
        self.memory_per_server = memory_per_server or memory_per_local_server(self.devices)
        self.processes: list[subprocess.Popen] = []
        self._log_of: dict[int, tuple[str, int]] = {}  # pid -> its stderr's file, where its own lines begin
        self.address = ""
        self.http_address = ""  # the coordinator's HTTP endpoint (/metrics, /sd), HOST:PORT
        # The coordinator's job state (--state-db): given, or in a folder of this
        # cluster's own, removed at stop (a local cluster's jobs end with it).
        self.state_db = state_db
        self._state_dir = None
        self.keep_jobs = keep_jobs  # the coordinator's --keep-jobs; None: its default

    def _logs(self) -> str:
        if self.log_dir is None:
            self._own_log_dir = self.log_dir = tempfile.mkdtemp(prefix="interleaf-logs-")
        os.makedirs(self.log_dir, exist_ok=True)
        return self.log_dir

    def _spawn(self, args: list[str], name: str, stdout=subprocess.DEVNULL,
               command: Callable[[list[str]], list[str]] = lambda c: c) -> subprocess.Popen:
        log = os.path.join(self._logs(), f"{name}.log")
        with open(log, "ab") as stderr:  # the child holds its own copy of the descriptor
            start = stderr.tell()  # a given --log-dir or a restarted coordinator appends
            process = subprocess.Popen(
                command([sys.executable, "-m", "interleaf.clients.cli", *args, *self.security.tls_flags()]),
                stdout=stdout, stderr=stderr, start_new_session=True,
                env={**os.environ, TOKEN_ENV: self.security.token, PARENT_ENV: str(os.getpid())},
            )
        self._log_of[process.pid] = (log, start)
        self.processes.append(process)
        return process

    def _died(self, process: subprocess.Popen) -> str:
        """What a child that ended during start left: its command, exit code and log's tail."""
        log, start = self._log_of.get(process.pid, ("", 0))
        try:
            with open(log, "rb") as f:
                f.seek(max(start, os.path.getsize(log) - LOG_TAIL_BYTES))
                tail = f.read().decode(errors="replace").strip()
        except OSError:
            tail = ""
        quoted = "\n".join("    " + line for line in tail.splitlines()) if tail else "    (it wrote nothing)"
        # A folder of the cluster's own goes at stop: then the quote is all there is.
        where = "" if self._own_log_dir else f"; {log}"
        return f"{' '.join(map(str, process.args))} (exit code {process.returncode}{where}):\n{quoted}"

    def start(self, timeout_s: float = 120.0) -> "LocalCluster":
        try:
            if self.state_db is None:
                self._state_dir = tempfile.mkdtemp(prefix="interleaf-state-")
                self.state_db = os.path.join(self._state_dir, "coordinator.db")
            self.address = self._start_coordinator("0")
            for i in range(self.count):
                self._spawn_server(i)
            self._wait_for_servers(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_coordinator(self, port: str) -> str:
        """Starts the coordinator (kept first in self.processes); returns its address."""
        extra = ["--steps-per-call", str(self.steps_per_call)] if self.steps_per_call else []
        if self.keep_jobs is not None:
            extra += ["--keep-jobs", str(self.keep_jobs)]
        coordinator = self._spawn(["coordinator", "--host", "127.0.0.1", "--port", port, "--state-db", self.state_db,
                                   "--http-port", "0", *extra], "coordinator", stdout=subprocess.PIPE)
        self.processes.insert(0, self.processes.pop())
        line = coordinator.stdout.readline().decode()
        if "listening on" not in line:
            try:
                coordinator.wait(timeout=10)  # its output ended: it has exited or is about to
            except subprocess.TimeoutExpired:
                coordinator.kill()
                coordinator.wait()
            raise RuntimeError(f"coordinator did not start ({line.strip() or 'no output'}): "
                               f"{self._died(coordinator)}")
        # Its HTTP port (/metrics, /sd): http://HOST:PORT at the line's end.
        self.http_address = line.split("http://")[1].split(")")[0]
        return line.split("listening on ")[1].split()[0]

    def restart_coordinator(self) -> subprocess.Popen:
        """A coordinator again, on the address and state db of the one that ended (the
        servers find it there); returns its process."""
        ended = self.processes[0]
        if ended.poll() is None:
            raise RuntimeError("the coordinator is still running: stop or kill it first")
        self.processes.remove(ended)
        self._start_coordinator(self.address.rsplit(":", 1)[1])
        return self.processes[0]

    def _spawn_server(self, i: int) -> subprocess.Popen:
        return self._spawn(
            ["stage-server", "--coordinator", self.address, "--host", "127.0.0.1",
             "--port", "0", "--threads", str(self.threads),
             "--memory-bytes", str(self.memory_per_server), "--device", self.devices[i % len(self.devices)],
             *([] if self.metrics else ["--metrics-port", "-1"])],
            f"stage-server-{i}", command=partial(self.server_command, i),
        )

    def add_server(self, timeout_s: float = 60.0) -> tuple[subprocess.Popen, str]:
        """One more stage server (a replacement or a spare), once it has registered:
        (its process, its address)."""
        client = self.client()
        try:
            before = {s.address for s in client.servers()}
            process = self._spawn_server(self.count)
            self.count += 1
            deadline = time.monotonic() + timeout_s
            while not (new := {s.address for s in client.servers()} - before):
                if process.poll() is not None:
                    raise RuntimeError(f"a stage server exited before it registered: {self._died(process)}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"stage server {process.args} did not register in {timeout_s:.0f}s")
                time.sleep(0.1)
        finally:
            client.close()
        return process, new.pop()

    def client(self) -> Client:
        """A protobuf-level client of this cluster's coordinator, with the cluster's token (and TLS)."""
        return Client(self.address, self.security)

    def connect(self) -> ApiClient:
        """An interleaf.Client of this cluster's coordinator, with the cluster's token (and TLS)."""
        return ApiClient(self.address, self.security)

    def _wait_for_servers(self, timeout_s: float) -> None:
        client = self.client()
        deadline = time.monotonic() + timeout_s
        try:
            while sum(s.state == "IDLE" for s in client.servers()) < self.count:
                dead = [p for p in self.processes if p.poll() is not None]
                if dead:
                    raise RuntimeError(f"a local process exited during start: {self._died(dead[0])}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.count} stage servers did not register in {timeout_s:.0f}s")
                time.sleep(0.2)
        finally:
            client.close()

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + 10
        for process in self.processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()
        if self._state_dir is not None:
            shutil.rmtree(self._state_dir, ignore_errors=True)
            self._state_dir = self.state_db = None
        if self._own_log_dir is not None:
            shutil.rmtree(self._own_log_dir, ignore_errors=True)
            self._own_log_dir = self.log_dir = None

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
