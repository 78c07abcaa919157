"""[metrics]: what the coordinator itself writes of a job's figures, for a job submitted
with no client attached to follow it (`interleaf submit`, a scheduler's batch job).
A client that follows a job writes its own (`interleaf run --tensorboard DIR`)."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

from interleaf.coordinator.config.rules import ConfigError


@dataclass(frozen=True)
class MetricsConfig:
    """[metrics]: what the coordinator itself writes of a job's figures, for jobs no
    client follows (`interleaf submit`); a client that follows a job writes its own
    (`interleaf run --tensorboard DIR`, docs/monitoring.md)."""

    tensorboard_dir: str = ""
    """When set, the coordinator writes the job's TensorBoard event files under this
    folder on the coordinator's machine, one folder per job (DIR/JOB_ID: `tensorboard
    --logdir DIR` shows every job beside the others), with the tags of
    `interleaf run --tensorboard` (coordinator/run_logs.py). An absolute path: the
    coordinator's working folder is not the submitter's. Empty: none."""

    def __post_init__(self):
        d = self.tensorboard_dir
        if d and not posixpath.isabs(d):
            raise ConfigError(f"metrics.tensorboard_dir={d!r} must be an absolute path (a folder on the "
                              "coordinator's machine), or empty for none")
