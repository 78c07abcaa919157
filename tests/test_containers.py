"""The images built and docker/compose.yaml run for real, in Docker: docker/build-images.sh
builds the Interleaf and Prometheus images; compose brings up the coordinator, three stage
servers (two for the job, one spare) and Prometheus under a project of the test's own,
with a token of its own as the secret. From the host, interleaf.Client submits a tiny job
with that token; it trains to the single-process reference's losses, and Prometheus (its
HTTP API) has scraped the coordinator and every stage server. A second run of the same job
loses a stage server's container to `docker kill` mid-job and recovers onto the spare with
the uninterrupted run's losses. `docker-compose down -v` leaves no container, network or
volume of the project behind.

Where no Docker engine runs, the test starts dockerd and stops it afterwards
(tests/docker_engine.py); it is skipped only where dockerd cannot start at all.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from interleaf import Client, Step
from interleaf.clients.api import Recovery
from interleaf.common.security import Security
from tests import compose_file, docker_engine
from tests.conftest import TINY, layout_free
from tests.test_equivalence import LOSS_RTOL

ROOT = compose_file.DOCKER.parent
# Enough steps for the kill to land mid-job: a tiny step takes tens of milliseconds.
STEPS = 48
EVERY = 4  # checkpoint.every
KILL_AT = 7  # the step (1-based) under way when the victim is killed: after the checkpoint of step 4
JOB = TINY + [f"train.steps={STEPS}", "parallel.pp=2", "parallel.vpp=1", "parallel.schedule=1f1b"]
STAGE_SERVERS = ["stage-0", "stage-1", "stage-2"]
SERVICES = ["coordinator", *STAGE_SERVERS, "prometheus"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(argv: list[str], timeout: float, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert result.returncode == 0, f"{' '.join(argv)} failed ({result.returncode}): {result.stderr[-4000:]}"
    return result.stdout


class Project:
    """docker/compose.yaml under a project name of its own, its host ports free ones."""

    def __init__(self, tmp_path):
        self.name = f"interleaf-test-{secrets.token_hex(4)}"
        self.token = secrets.token_urlsafe(32)
        token_file = tmp_path / "token"
        token_file.write_text(self.token + "\n")
        token_file.chmod(0o644)  # the containers' user (10001) reads the bind-mounted secret
        self.ports = {"COORDINATOR_PORT": _free_port(), "COORDINATOR_HTTP_PORT": _free_port(),
                      "PROMETHEUS_PORT": _free_port()}
        # Two cores: one torch thread per server keeps the two busy ones off each other's core.
        self.env = {**os.environ, "TOKEN_FILE": str(token_file), "STAGE_THREADS": "1",
                    **{k: str(v) for k, v in self.ports.items()}}

    def compose(self, *args: str, timeout: float = 300) -> str:
        return _run(["docker-compose", "-f", str(compose_file.COMPOSE), "-p", self.name, *args], timeout, self.env)

    def logs(self) -> str:
        result = subprocess.run(["docker-compose", "-f", str(compose_file.COMPOSE), "-p", self.name, "logs",
                                 "--no-color", "--tail", "40"], capture_output=True, text=True, env=self.env,
                                timeout=120)
        return result.stdout[-8000:]

    def left_behind(self) -> dict[str, list[str]]:
        """The project's containers, networks and volumes that still exist."""
        label = f"label=com.docker.compose.project={self.name}"
        found = {kind: _run(["docker", *command, "--filter", label], 60).split()
                 for kind, command in {"containers": ["ps", "-a", "-q"], "networks": ["network", "ls", "-q"],
                                       "volumes": ["volume", "ls", "-q"]}.items()}
        # Compose names them after the project too: none may be left by name either.
        names = _run(["docker", "volume", "ls", "--format", "{{.Name}}"], 60).split()
        names += _run(["docker", "network", "ls", "--format", "{{.Name}}"], 60).split()
        found["named"] = [n for n in names if n.startswith(self.name.replace("-", "") + "_")
                          or n.startswith(self.name + "_")]
        return {kind: ids for kind, ids in found.items() if ids}


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    with docker_engine.engine(tmp_path_factory.mktemp("dockerd")):
        started = time.monotonic()
        built = _run([str(ROOT / "docker" / "build-images.sh")], timeout=3600).split()
        print(f"docker/build-images.sh: {time.monotonic() - started:.0f} s")
        yield built


def _wait_servers(client: Client, count: int, project: Project) -> None:
    deadline = time.monotonic() + 180
    while len([s for s in client.servers() if s.state == "IDLE"]) < count:
        assert time.monotonic() < deadline, f"{count} idle stage servers never registered: {project.logs()}"
        time.sleep(1)


def _ranks(client: Client, job_id: str) -> list[str]:
    return [r.server_address for r in client.rpc.status(job_id).ranks]


def _train(client: Client, project: Project, kill_rank: int | None = None, reached: list[int] | None = None):
    """Runs the job (a checkpoint folder of its own); with `kill_rank`, that rank's
    container is killed once step KILL_AT is under way. Returns the last loss of each step
    (after a recovery the steps from the checkpoint on come again), the recoveries, and
    the ranks' servers before the kill and at the end; `reached` gets, per recovery, the
    steps that had ended when it was reported."""
    reached = [] if reached is None else reached
    # Each stage server's container, found before the job starts so the kill is quick.
    containers = {s: project.compose("ps", "-q", s).strip() for s in STAGE_SERVERS}
    # Checkpoints on the volume the coordinator and servers share.
    job = client.submit("", JOB + [f"checkpoint.dir=/checkpoints/{secrets.token_hex(4)}", f"checkpoint.every={EVERY}"])
    losses: dict[int, float] = {}
    recoveries: list[Recovery] = []
    before: list[str] | None = None
    for event in job.events(timeout_s=600):
        if isinstance(event, Recovery):
            recoveries.append(event)
            reached.append(max(losses, default=0) + 1)  # steps are 0-based: how many had ended
        elif isinstance(event, Step):
            losses[event.step] = event.loss
            if kill_rank is not None and before is None and event.step == KILL_AT - 1:
                before = _ranks(client, job.id)
                # Service names are the servers' registered hosts (compose.yaml's --host).
                _run(["docker", "kill", containers[before[kill_rank].split(":")[0]]], 60)
    status = job.status()
    assert status.state == "SUCCEEDED", f"{status.error or status.reason}: {project.logs()}"
    return losses, recoveries, before, _ranks(client, job.id)


# The single-process reference, run in the image: its builtin corpus is its own Python's
# standard library (stageserver/data/corpus.py), which the host's Python does not share.
_REFERENCE = """
import json, sys
from interleaf.clients.reference import train
from interleaf.coordinator.config import load_config
history, _ = train(load_config("", json.loads(sys.argv[1])))
print(json.dumps([h.loss for h in history]))
"""


def _reference_losses(image: str) -> list[float]:
    overrides = json.dumps(list(layout_free(JOB)))
    out = _run(["docker", "run", "--rm", "--entrypoint", "python3", image, "-c", _REFERENCE, overrides], 600)
    return json.loads(out.splitlines()[-1])


def _scraped(project: Project) -> dict[str, str]:
    """Prometheus's `up` per target (instance), through its HTTP API."""
    query = urllib.parse.urlencode({"query": "up"})
    url = f"http://127.0.0.1:{project.ports['PROMETHEUS_PORT']}/api/v1/query?{query}"
    with urllib.request.urlopen(url, timeout=10) as reply:
        results = json.load(reply)["data"]["result"]
    return {r["metric"]["instance"]: r["value"][1] for r in results}


def test_compose_trains_scrapes_and_recovers_in_containers(images, tmp_path):
    assert "interleaf:0.1.0" in images and "interleaf-prometheus:bookworm" in images
    project = Project(tmp_path)
    try:
        project.compose("up", "-d", *SERVICES, timeout=600)
        client = Client(f"127.0.0.1:{project.ports['COORDINATOR_PORT']}", Security(token=project.token))
        _wait_servers(client, len(STAGE_SERVERS), project)

        # Uninterrupted: the single-process reference's losses.
        losses, recoveries, _, _ = _train(client, project)
        expected_losses = _reference_losses(compose_file.IMAGE)
        assert sorted(losses) == list(range(1, STEPS + 1)) and not recoveries
        for step, loss in losses.items():
            assert loss == pytest.approx(expected_losses[step - 1], rel=LOSS_RTOL), step

        # Every target up: the coordinator by name, the stage servers from its /sd.
        expected = {"coordinator:50052", *(f"{s}:50062" for s in STAGE_SERVERS)}
        deadline = time.monotonic() + 90
        while (up := _scraped(project)) != dict.fromkeys(expected, "1"):
            assert time.monotonic() < deadline, f"Prometheus's up: {up}, expected 1 for each of {sorted(expected)}"
            time.sleep(2)

        # The same job, its second pipeline stage killed mid-job: it moves onto the spare.
        reached: list[int] = []
        again, recoveries, before, after = _train(client, project, kill_rank=1, reached=reached)
        assert before, "the victim was never killed"
        killed, (spare,) = before[1], {f"{s}:50061" for s in STAGE_SERVERS} - set(before)
        assert recoveries, f"no recovery: did the job end before the kill after step {KILL_AT - 1} landed?"
        assert [list(r.lost) for r in recoveries] == [[killed]], recoveries
        # From a checkpoint, not from scratch: the newest one saved before the kill landed
        # (the kill follows step KILL_AT - 1 by the time a status call and `docker kill`
        # take, in which a step or two more may end: the checkpoint of step 8, not 4).
        restart = recoveries[0].restart_step
        assert restart > 0 and restart % EVERY == 0 and restart <= reached[0], (recoveries, reached)
        assert sorted(after) == sorted([before[0], spare]), (before, after)
        assert sorted(again) == sorted(losses)
        for step, loss in again.items():
            assert loss == pytest.approx(losses[step], rel=LOSS_RTOL), step
        client.close()
    finally:
        project.compose("down", "-v", "--remove-orphans", "--timeout", "20")
    assert not project.left_behind(), project.left_behind()
