"""A job's configuration: typed sections loaded from TOML, overridable with
`--set SECTION.KEY=VALUE`, and validated where it is built.

Every rule a user can break raises `ConfigError` with one line naming the field, the
value and the rule, e.g.
`parallel.microbatches=6 must be a multiple of parallel.pp=4 for interleaved-1f1b`.

The sections live one per module (model, parallel, train, sections, job); loading.py
parses and overrides; this package re-exports what callers use.
"""

from interleaf.coordinator.config.job import JobConfig
from interleaf.coordinator.config.loading import build_config, load_config
from interleaf.coordinator.config.eval import EvalConfig, eval_points
from interleaf.coordinator.config.metrics import MetricsConfig
from interleaf.coordinator.config.model import ARCHS, ROPE_SCALING, ModelConfig
from interleaf.coordinator.config.parallel import (
    MAX_ZERO_PREFETCH,
    SCHEDULES,
    TRANSPORTS,
    ParallelConfig,
)
from interleaf.coordinator.config.rules import ConfigError, InitNotFound
from interleaf.coordinator.config.sections import (
    DEFAULT_TRACED,
    MAX_TRACED_STEPS,
    CheckpointConfig,
    DataConfig,
    RecoveryConfig,
    TraceConfig,
)
from interleaf.coordinator.config.train import (
    MASTER_BYTES,
    PRECISION_BYTES,
    PRECISIONS,
    RECOMPUTE,
    TrainConfig,
)

__all__ = [
    "ARCHS", "DEFAULT_TRACED", "MASTER_BYTES", "MAX_TRACED_STEPS", "MAX_ZERO_PREFETCH", "PRECISIONS",
    "PRECISION_BYTES", "RECOMPUTE", "ROPE_SCALING", "SCHEDULES", "TRANSPORTS", "CheckpointConfig",
    "ConfigError", "DataConfig", "EvalConfig", "InitNotFound", "JobConfig", "MetricsConfig", "ModelConfig", "ParallelConfig",
    "RecoveryConfig", "TraceConfig", "TrainConfig", "build_config", "eval_points", "load_config",
]
