"""docker/compose.yaml read as Compose reads it: YAML (anchors and merge keys), then
`${NAME:-default}` and `${NAME}` taken from the environment given."""

from __future__ import annotations

import pathlib
import re

import yaml

DOCKER = pathlib.Path(__file__).resolve().parent.parent / "docker"
COMPOSE = DOCKER / "compose.yaml"
# The Interleaf image docker/build-images.sh tags and compose and Kubernetes run.
IMAGE = "interleaf:0.1.0"
_VARIABLE = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")


def interpolate(value, environ: dict[str, str]):
    if isinstance(value, str):
        def one(match: re.Match) -> str:
            name, default = match.group(1), match.group(2)
            if environ.get(name):
                return environ[name]
            assert default is not None, f"${{{name}}} is unset and has no default"
            return default
        return _VARIABLE.sub(one, value)
    if isinstance(value, list):
        return [interpolate(v, environ) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, environ) for k, v in value.items()}
    return value


def load(environ: dict[str, str] | None = None) -> dict:
    return interpolate(yaml.safe_load(COMPOSE.read_text()), environ or {})
