"""docker/compose.yaml's commands work: every Interleaf service of the file runs as a
local process with the file's own arguments, and the client trains the default job to
completion. No Docker engine is needed, and none is used.

What a container would give, the test gives on loopback: each service its own address
(127.0.0.10, .11, ...), which its name stands for in every argument, so the file's ports
stay as written; the address it binds (a container binds all of its interfaces, here
`--bind` its own address); its secrets and volumes as local files and folders at the
paths the arguments name. The health checks run as written, on the service's address,
and gate the services that depend on them, as `depends_on: service_healthy` does.
Prometheus's configuration (docker/prometheus.yml) is then read the same way and its
targets fetched: the coordinator's /metrics, and every stage server its /sd lists.
"""

from __future__ import annotations

import json
import os
import pathlib
import secrets
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml

from interleaf.coordinator.config import load_config
from interleaf.common.security import TOKEN_ENV
from tests import compose_file

DOCKER = compose_file.DOCKER
IMAGE = compose_file.IMAGE


class LocalCompose:
    def __init__(self, compose: dict, root: pathlib.Path):
        self.services = compose["services"]
        self.ours = [name for name, s in self.services.items() if s.get("image") == IMAGE]
        self.address = {name: f"127.0.0.{10 + i}" for i, name in enumerate(self.services)}
        self.token = secrets.token_urlsafe(32)
        self.mounts: dict[str, dict[str, pathlib.Path]] = {}
        for name in self.ours:
            self.mounts[name] = self._mounts(compose, self.services[name], root)
        self.processes: dict[str, subprocess.Popen] = {}
        self.logs = root / "logs"
        self.logs.mkdir()

    def _mounts(self, compose: dict, service: dict, root: pathlib.Path) -> dict[str, pathlib.Path]:
        """Container path -> local path, for the service's secrets and volumes."""
        mounts = {}
        for secret in service.get("secrets", []):
            name = secret if isinstance(secret, str) else secret["source"]
            assert "file" in compose["secrets"][name], f"secret {name} must come from a file"
            local = root / "secrets" / name
            local.parent.mkdir(exist_ok=True)
            local.write_text(self.token + "\n")
            mounts[f"/run/secrets/{name}"] = local
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            if source.startswith("."):
                local = (DOCKER / source).resolve()
                assert local.exists(), f"{volume}: {local} is missing"
            else:  # a named volume
                assert source in compose["volumes"], f"{volume}: no volume {source!r} declared"
                local = root / "volumes" / source
                local.mkdir(parents=True, exist_ok=True)
            mounts[target] = local
        return mounts

    def _map(self, service: str, arg: str) -> str:
        """An argument as this machine reads it: names and the container's own loopback
        become addresses, container paths become the local files mounted there."""
        host, sep, port = arg.rpartition(":")
        if sep and port.isdigit() and host in self.address:
            return f"{self.address[host]}:{port}"
        if sep and port.isdigit() and host == "127.0.0.1":
            return f"{self.address[service]}:{port}"
        if arg in self.address:
            return self.address[arg]
        for target, local in self.mounts[service].items():
            if arg == target or arg.startswith(target + "/"):
                return str(local) + arg[len(target):]
        return arg

    def argv(self, service: str, args: list[str]) -> list[str]:
        # The first argument is the command (`coordinator` is one, and also a service's name).
        mapped = [str(args[0])] + [self._map(service, str(a)) for a in args[1:]]
        assert not any(a.startswith(("/run/", "/etc/interleaf", "/var/lib/interleaf")) for a in mapped), mapped
        if mapped[0] in ("coordinator", "stage-server"):  # a container binds its own interfaces
            mapped += ["--bind", self.address[service]]
        return [sys.executable, "-m", "interleaf.clients.cli", *mapped]

    def env(self, service: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, "INTERLEAF_COORDINATOR")}
        env.update({k: str(v) for k, v in (self.services[service].get("environment") or {}).items()})
        return env

    def start(self, service: str) -> subprocess.Popen:
        command = self.services[service]["command"]
        log = open(self.logs / f"{service}.log", "wb")
        process = subprocess.Popen(self.argv(service, command), stdout=log, stderr=subprocess.STDOUT,
                                   env=self.env(service))
        self.processes[service] = process
        return process

    def wait_healthy(self, service: str) -> None:
        check = self.services[service]["healthcheck"]
        test = check["test"]
        assert test[0] == "CMD" and test[1] == "interleaf", test
        retries = int(check["retries"])
        for _ in range(retries):
            assert self.processes[service].poll() is None, self.log(service)
            result = subprocess.run(self.argv(service, test[2:]), capture_output=True, text=True, timeout=60,
                                    env=self.env(service))
            if result.returncode == 0:
                return
            time.sleep(_seconds(check["interval"]))
        raise AssertionError(f"{service} not healthy after {retries} checks: {result.stdout}{self.log(service)}")

    def log(self, service: str) -> str:
        return (self.logs / f"{service}.log").read_text(errors="replace")[-3000:]

    def stop(self) -> dict[str, int]:
        codes = {}
        for name, process in reversed(list(self.processes.items())):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
            try:
                codes[name] = process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                codes[name] = process.wait()
        return codes


def _seconds(duration: str) -> float:
    assert duration.endswith("s"), duration
    return float(duration[:-1])


def _order(services: dict, names: list[str]) -> list[str]:
    """The services in an order where each comes after what it depends on."""
    done: list[str] = []
    while len(done) < len(names):
        ready = [n for n in names if n not in done and all(d in done for d in services[n].get("depends_on", {}))]
        assert ready, f"a dependency cycle among {set(names) - set(done)}"
        done += ready
    return done


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.read()


@pytest.fixture
def compose(tmp_path):
    # The stage servers share this machine's cores, as the compose file says to set them.
    stage = [s for s in compose_file.load()["services"].values() if s.get("command", [""])[0] == "stage-server"]
    threads = max(1, (os.cpu_count() or 1) // len(stage))
    running = LocalCompose(compose_file.load({"STAGE_THREADS": str(threads)}), tmp_path)
    yield running
    running.stop()


def test_compose_commands_train_the_default_job(compose):
    services = compose.services
    assert set(compose.ours) >= {"coordinator", "client"}
    one_shot = [n for n in compose.ours if services[n].get("restart") == "no"]
    assert one_shot == ["client"]
    for name in _order(services, compose.ours):
        for dependency, condition in services[name].get("depends_on", {}).items():
            assert condition["condition"] == "service_healthy", (name, dependency)
            compose.wait_healthy(dependency)
        compose.start(name)

    client = compose.processes["client"]
    try:
        client.wait(timeout=900)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the client did not finish: {compose.log('client')}")
    output = compose.log("client")
    assert client.returncode == 0, output
    # job.toml is the default job (tests/test_deployment_files.py checks it): its every step ran.
    steps = load_config((DOCKER / "job.toml").read_text()).train.steps
    assert f"step {steps}/{steps}" in output, output

    # Prometheus's configuration, read as Prometheus in the compose network would.
    prometheus = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    stage_servers = [n for n in compose.ours if services[n]["command"][0] == "stage-server"]
    for job in prometheus["scrape_configs"]:
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                assert b"# TYPE" in _get(f"http://{compose._map('coordinator', target)}/metrics")
        for sd in job.get("http_sd_configs", []):
            host = sd["url"].split("/")[2]
            url = sd["url"].replace(host, compose._map("coordinator", host))
            targets = sorted(t for group in json.loads(_get(url)) for t in group["targets"])
            expected = sorted(f"{compose.address[n]}:{_flag(services[n]['command'], '--metrics-port')}"
                              for n in stage_servers)
            assert targets == expected
            for target in targets:
                assert b"# TYPE" in _get(f"http://{target}/metrics")

    codes = compose.stop()
    assert all(code in (0, 128 + signal.SIGTERM) for code in codes.values()), codes


def _flag(args: list[str], flag: str) -> str:
    return str(args[args.index(flag) + 1])
