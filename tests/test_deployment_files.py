"""docker/ checked offline: the compose file (`docker-compose config`), the Kubernetes
manifests (kubernetes-validate, strict), and what the files say to each other and to the
code: flags the command line accepts, ports, probes, mounts, the job, the datasource.
tests/test_compose_local.py runs the compose file's commands."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import tomllib

import kubernetes_validate
import pytest
import yaml

from interleaf.clients.cli import _parser
from interleaf.coordinator.config import load_config
from interleaf.common.health import COORDINATOR, STAGE_SERVER
from tests import compose_file
from tests.source_tree import PACKAGE_FOLDERS

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCKER, COMPOSE = compose_file.DOCKER, compose_file.COMPOSE
MANIFESTS = sorted((DOCKER / "k8s").glob("*.yaml"))
# grpc probes are GA from 1.27; the newest version kubernetes-validate knows.
K8S_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
DEFAULT_JOB = load_config("")
IMAGE = compose_file.IMAGE


def _compose(environ: dict[str, str] | None = None) -> dict:
    return compose_file.load(environ)


def _docs() -> list[dict]:
    return [d for path in MANIFESTS for d in yaml.safe_load_all(path.read_text()) if d]


def _one(kind: str, name: str) -> dict:
    found = [d for d in _docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def _flag(args: list[str], flag: str) -> str:
    return str(args[args.index(flag) + 1])


def _docker_compose() -> str:
    found = shutil.which("docker-compose")
    assert found, "docker-compose is missing: .ci/run installs Debian's docker-compose (apt-get install docker-compose)"
    return found


# -- compose ---------------------------------------------------------------------------

def test_compose_config_is_valid(tmp_path):
    tool = _docker_compose()
    environ = {"STAGE_THREADS": "3"}
    result = subprocess.run([tool, "-f", str(COMPOSE), "config"], capture_output=True, text=True, timeout=120,
                            env={**os.environ, **environ})
    assert result.returncode == 0, result.stderr
    # Compose's reading of the file is the tests' (tests/compose_file.py): the same commands.
    resolved = yaml.safe_load(result.stdout)["services"]
    ours = _compose(environ)["services"]
    assert resolved.keys() == ours.keys()
    for name, service in ours.items():
        assert resolved[name].get("command") == service.get("command"), name
    assert _flag(ours["stage-0"]["command"], "--threads") == "3"
    assert _flag(_compose()["services"]["stage-0"]["command"], "--threads") == "0"  # unset: torch's default
    # The check can fail: a misspelt key in a copy of the file is refused.
    broken = tmp_path / "compose.yaml"
    broken.write_text(COMPOSE.read_text().replace("    restart: \"no\"", "    restartt: \"no\"", 1))
    assert broken.read_text() != COMPOSE.read_text()
    refused = subprocess.run([tool, "-f", str(broken), "config", "-q"], capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "restartt" in refused.stderr


def test_compose_runs_the_default_job_on_enough_servers():
    services = _compose()["services"]
    assert load_config((DOCKER / "job.toml").read_text()) == DEFAULT_JOB
    stage = [s for s in services.values() if s.get("command", [""])[0] == "stage-server"]
    assert len(stage) == DEFAULT_JOB.parallel.world_size + 1  # and a spare, for recovery
    # Each registers under its own name, which its peers reach it by.
    assert sorted(_flag(s["command"], "--host") for s in stage) == sorted(
        n for n, s in services.items() if s.get("command", [""])[0] == "stage-server")
    client = services["client"]["command"]
    assert client[0] == "run" and "--coordinator" in client
    assert "./job.toml:" + client[1] + ":ro" in services["client"]["volumes"]


def test_compose_token_only_from_the_secret():
    compose = _compose()
    text = COMPOSE.read_text()
    assert "INTERLEAF_TOKEN" not in text
    for name, service in compose["services"].items():
        if service.get("image") != IMAGE:
            continue
        assert service["secrets"] == ["interleaf_token"], name
        args = [str(a) for a in service["command"]]
        assert _flag(args, "--token-file") == "/run/secrets/interleaf_token", name
        _parser().parse_args(args)  # flags the command line accepts (exits on one it does not)
    assert compose["secrets"]["interleaf_token"] == {"file": "./token"}
    assert "/docker/token" in (ROOT / ".gitignore").read_text().split()


def test_dockerfile_installs_the_package_folders():
    folders = set(PACKAGE_FOLDERS)
    dockerfile = (DOCKER / "Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (\S+) \1$", dockerfile, re.M))
    assert copied == folders
    assert "COPY pyproject.toml README.md ./" in dockerfile
    assert 'ENTRYPOINT ["interleaf"]' in dockerfile and "ARG BASE=interleaf-base:bookworm" in dockerfile
    allowed = {line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().split() if line.startswith("!")}
    assert allowed >= folders | {"pyproject.toml", "README.md", "docker/wheels"}


def test_one_image_name_everywhere():
    """The image docker/build-images.sh tags (the project's version) is the one compose runs
    (tests/test_containers.py builds and runs it) and every Kubernetes manifest names."""
    assert IMAGE == f"interleaf:{tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']['version']}"
    assert 'TAG="${INTERLEAF_TAG:-$VERSION}"' in (DOCKER / "build-images.sh").read_text()
    ours = {s["image"] for s in _compose()["services"].values() if s["image"].startswith("interleaf:")}
    assert ours == {IMAGE}
    pods = [d["spec"]["template"]["spec"] for d in _docs() if d["kind"] in ("Deployment", "StatefulSet", "Job")]
    named = {c["image"] for pod in pods for c in pod["containers"] + pod.get("initContainers", [])}
    assert {i for i in named if i.split(":")[0] == "interleaf"} == {IMAGE}, named


# -- Grafana ---------------------------------------------------------------------------

def test_grafana_dashboard_uses_the_provisioned_datasource():
    provisioning = DOCKER / "grafana" / "provisioning"
    sources = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"]
    providers = yaml.safe_load((provisioning / "dashboards" / "interleaf.yaml").read_text())["providers"]
    compose = _compose()
    grafana = compose["services"]["grafana"]
    assert "./grafana/provisioning:/etc/grafana/provisioning:ro" in grafana["volumes"]
    dashboards_at = {v.split(":")[1] for v in grafana["volumes"] if v.startswith("./grafana/dashboards:")}
    assert {p["options"]["path"] for p in providers} == dashboards_at
    # The datasource's URL is the compose file's Prometheus.
    for source in sources:
        host, port = source["url"].split("/")[2].split(":")
        assert host in compose["services"] and f"{port}:{port}" in compose["services"][host]["ports"]

    dashboards = list((DOCKER / "grafana" / "dashboards").glob("*.json"))
    assert dashboards
    for path in dashboards:
        dashboard = json.loads(path.read_text())
        variables = {v["name"]: v for v in dashboard.get("templating", {}).get("list", [])}
        refs = [p["datasource"] for p in dashboard["panels"] if "datasource" in p]
        refs += [t["datasource"] for p in dashboard["panels"] for t in p.get("targets", []) if "datasource" in t]
        refs += [v["datasource"] for v in variables.values() if "datasource" in v]
        assert refs, path
        for ref in refs:
            uid = ref["uid"] if isinstance(ref, dict) else ref
            variable = re.fullmatch(r"\$\{?(\w+)\}?", uid)
            if variable:  # a datasource variable: it offers the datasources of its type
                chosen = variables[variable.group(1)]
                assert chosen["type"] == "datasource"
                assert any(s["type"] == chosen["query"] for s in sources), (path.name, chosen)
            else:
                assert any(s["uid"] == uid for s in sources), (path.name, uid)


# -- Kubernetes ------------------------------------------------------------------------

@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_are_valid(version):
    docs = _docs()
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "StatefulSet", "ConfigMap", "Job"}
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)
    # The check can fail: an unknown field is refused in strict mode.
    stateful = _one("StatefulSet", "stage")
    stateful["spec"]["template"]["spec"]["containers"][0]["gpus"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(stateful, version, strict=True)


def _container(kind: str, name: str) -> tuple[dict, dict]:
    pod = _one(kind, name)["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


def _args(container: dict) -> list[str]:
    """The container's arguments as the kubelet expands them: $(VAR) from its env."""
    values = {e["name"]: "10.1.2.3" if "fieldRef" in e.get("valueFrom", {}) else e["value"]
              for e in container.get("env", [])}
    return [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], str(a)) for a in container["args"]]


def _mounted(pod: dict, container: dict, path: str) -> dict:
    """The volume a path in the container lies in."""
    for mount in container.get("volumeMounts", []):
        if path.startswith(mount["mountPath"].rstrip("/") + "/"):
            return next(v for v in pod["volumes"] if v["name"] == mount["name"])
    raise AssertionError(f"{path} is on no volume")


def _ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def test_manifests_agree_with_the_command_line_and_each_other():
    coordinator_service = _one("Service", "coordinator")
    service_ports = {p["name"]: p["port"] for p in coordinator_service["spec"]["ports"]}

    pod, coordinator = _container("Deployment", "coordinator")
    args = _args(coordinator)
    _parser().parse_args(args)
    assert args[0] == "coordinator" and _flag(args, "--host") == coordinator_service["metadata"]["name"]
    ports = _ports(coordinator)
    assert (int(_flag(args, "--port")), int(_flag(args, "--http-port")), int(_flag(args, "--store-port"))) == (
        ports["grpc"], ports["http"], ports["store"]) == (service_ports["grpc"], service_ports["http"],
                                                          service_ports["store"])
    assert _mounted(pod, coordinator, _flag(args, "--state-db"))["persistentVolumeClaim"]["claimName"] == \
        _one("PersistentVolumeClaim", "coordinator-state")["metadata"]["name"]
    assert _one("Deployment", "coordinator")["spec"]["strategy"]["type"] == "Recreate"
    _check_probes(coordinator, ports["grpc"], COORDINATOR)
    _check_token(pod, coordinator, args)
    coordinator_address = f"{coordinator_service['metadata']['name']}:{service_ports['grpc']}"

    stateful = _one("StatefulSet", "stage")
    assert stateful["spec"]["podManagementPolicy"] == "Parallel"
    assert stateful["spec"]["replicas"] == DEFAULT_JOB.parallel.world_size
    headless = _one("Service", stateful["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"].items() <= stateful["spec"]["template"]["metadata"]["labels"].items()
    pod, stage = _container("StatefulSet", "stage")
    args = _args(stage)
    _parser().parse_args(args)
    assert args[0] == "stage-server" and _flag(args, "--coordinator") == coordinator_address
    assert _flag(args, "--host") == "10.1.2.3"  # its pod IP, from the downward API
    assert stage["resources"]["limits"]["nvidia.com/gpu"] == 1 and _flag(args, "--device") == "cuda"
    ports = _ports(stage)
    assert (int(_flag(args, "--port")), int(_flag(args, "--metrics-port"))) == (ports["grpc"], ports["metrics"])
    _check_probes(stage, ports["grpc"], STAGE_SERVER)
    _check_token(pod, stage, args)

    pod, client = _container("Job", "interleaf-train")
    args = _args(client)
    _parser().parse_args(args)
    assert args[0] == "run" and _flag(args, "--coordinator") == coordinator_address
    job = _mounted(pod, client, args[1])["configMap"]["name"]
    assert _one("ConfigMap", job)["data"][pathlib.Path(args[1]).name] == (DOCKER / "job.toml").read_text()
    _check_token(pod, client, args)
    wait = _args(pod["initContainers"][0])
    _parser().parse_args(wait)
    assert wait[:2] == ["health", coordinator_address] and _flag(wait, "--service") == COORDINATOR


def _check_probes(container: dict, grpc_port: int, service: str) -> None:
    assert container["readinessProbe"]["grpc"] == {"port": grpc_port, "service": service}
    assert container["livenessProbe"]["grpc"] == {"port": grpc_port}  # "": the server as a whole
    assert container["startupProbe"]["grpc"] == {"port": grpc_port}


def _check_token(pod: dict, container: dict, args: list[str]) -> None:
    path = _flag(args, "--token-file")
    secret = _mounted(pod, container, path)["secret"]
    assert secret["secretName"] == "interleaf-token" and pathlib.Path(path).name == "token"
    assert not any("TOKEN" in e["name"] for e in container.get("env", []))


def test_kubernetes_prometheus_scrapes_through_the_coordinator():
    shipped = (DOCKER / "prometheus.yml").read_text()
    assert _one("ConfigMap", "prometheus-config")["data"]["prometheus.yml"] == shipped
    config = yaml.safe_load(shipped)
    service = _one("Service", "coordinator")
    http = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "http")
    sd = [c["url"] for job in config["scrape_configs"] for c in job.get("http_sd_configs", [])]
    assert sd == [f"http://{service['metadata']['name']}:{http}/sd"]
    # The same names in compose: the coordinator's service and its --http-port.
    coordinator = _compose()["services"]["coordinator"]["command"]
    assert sd == [f"http://coordinator:{_flag(coordinator, '--http-port')}/sd"]
