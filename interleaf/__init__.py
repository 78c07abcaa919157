"""Interleaf: GPT training with data, tensor and interleaved pipeline parallelism over gRPC stage servers.

Everything lives under this one namespace: `interleaf.coordinator`, `interleaf.stageserver`,
`interleaf.clients`, `interleaf.protos` (the wire contract) and `interleaf.common` (what the
servers and clients share besides it). The code sits in the repository's top-level folders,
the layout DESIGN.md describes; `interleaf/<name>` are links to them, so every import
resolves on the file system, for static tools as for Python.
"""

from __future__ import annotations

from interleaf.common.fork_safety import turn_off_grpc_fork_handlers

turn_off_grpc_fork_handlers()  # first: before anything imports grpc (common/fork_safety.py)

# The Python API, imported on first use so that `import interleaf.stageserver` (every
# server process) does not load the client.
_API = {
    "Client": "interleaf.clients.api",
    "Job": "interleaf.clients.api",
    "JobFailed": "interleaf.clients.api",
    "JobStatus": "interleaf.clients.api",
    "Step": "interleaf.clients.api",
    "Evaluation": "interleaf.clients.api",
    "LocalCluster": "interleaf.clients.launcher",
    "JobConfig": "interleaf.coordinator.config",
    "ModelConfig": "interleaf.coordinator.config",
    "ParallelConfig": "interleaf.coordinator.config",
    "TrainConfig": "interleaf.coordinator.config",
    "DataConfig": "interleaf.coordinator.config",
    "CheckpointConfig": "interleaf.coordinator.config",
    "RecoveryConfig": "interleaf.coordinator.config",
    "TraceConfig": "interleaf.coordinator.config",
    "EvalConfig": "interleaf.coordinator.config",
    "MetricsConfig": "interleaf.coordinator.config",
    "ConfigError": "interleaf.coordinator.config",
}
__all__ = sorted(_API)


def __getattr__(name: str):
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'interleaf' has no attribute {name!r}")
