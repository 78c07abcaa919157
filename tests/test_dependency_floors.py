"""pyproject's dependency floors are the versions the checked-in generated code demands.

protos/interleaf_pb2_grpc.py raises at import under a grpcio older than the grpcio-tools
that generated it (GRPC_GENERATED_VERSION), and protos/interleaf_pb2.py under a protobuf
runtime older than its gencode (ValidateProtobufRuntimeVersion): a floor below those lets
pip install a set on which every command fails. The files are read as text, not
imported, so the test states the disagreement even where the import itself would fail."""

from __future__ import annotations

import re
import tomllib

from packaging.requirements import Requirement
from packaging.version import Version

from interleaf.protos.generate import ROOT

GRPC_GENERATED = re.compile(r"^GRPC_GENERATED_VERSION = '([^']+)'$", re.M)
PROTOBUF_GENCODE = re.compile(
    r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),")


def _requirements(key: str | None = None) -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = project["optional-dependencies"][key] if key else project["dependencies"]
    return {r.name: r for r in map(Requirement, listed)}


def _floor(requirement: Requirement) -> Version:
    floors = [Version(s.version) for s in requirement.specifier if s.operator in (">=", "==", "~=")]
    assert floors, f"{requirement} declares no floor"
    return max(floors)


def _grpc_generated() -> Version:
    found = GRPC_GENERATED.search((ROOT / "protos" / "interleaf_pb2_grpc.py").read_text())
    assert found, "protos/interleaf_pb2_grpc.py has no GRPC_GENERATED_VERSION"
    return Version(found.group(1))


def test_grpcio_floor_is_the_generated_code_version():
    dependencies = _requirements()
    for name in ("grpcio", "grpcio-health-checking"):
        assert _floor(dependencies[name]) == _grpc_generated(), (
            f"pyproject declares {dependencies[name]}, but protos/interleaf_pb2_grpc.py needs "
            f"grpcio>={_grpc_generated()}: set the floor to that version")


def test_protobuf_floor_is_the_gencode_version():
    found = PROTOBUF_GENCODE.search((ROOT / "protos" / "interleaf_pb2.py").read_text())
    assert found, "protos/interleaf_pb2.py has no protobuf runtime version check"
    gencode = Version(".".join(found.groups()))
    declared = _requirements()["protobuf"]
    assert _floor(declared) == gencode, (
        f"pyproject declares {declared}, but protos/interleaf_pb2.py needs protobuf>={gencode}")


def test_the_pinned_grpcio_tools_made_the_checked_in_code():
    """generate.py regenerates with the `test` extra's grpcio-tools: the one that made the files."""
    pinned = _requirements("test")["grpcio-tools"]
    assert [s.operator for s in pinned.specifier] == ["=="], f"{pinned}: the test extra must pin one version"
    assert _floor(pinned) == _grpc_generated(), (
        f"the test extra pins {pinned}, but the checked-in code came from grpcio-tools {_grpc_generated()}")
