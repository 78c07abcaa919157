"""What every config section shares: the error it raises and the checks it runs."""

from __future__ import annotations

from interleaf.common import limits


class ConfigError(ValueError):
    """An invalid job configuration; the message names the field, value and rule."""


class InitNotFound(ConfigError):
    """checkpoint.init names nothing this process sees: a client may not see the
    cluster's files, which the coordinator reads (coordinator/init_source.py)."""


def _positive(section: str, obj, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value < 1:
            raise ConfigError(f"{section}.{name}={value} must be at least 1")


def _bounded(section: str, obj) -> None:
    """Every number finite and within its upper bound (common/limits.py)."""
    why = limits.violation(section, obj)
    if why:
        raise ConfigError(why)
