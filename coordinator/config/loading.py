"""Building a JobConfig from TOML and `--set SECTION.KEY=VALUE` overrides."""

from __future__ import annotations

import dataclasses
import tomllib

from interleaf.coordinator.config.eval import EvalConfig
from interleaf.coordinator.config.job import JobConfig
from interleaf.coordinator.config.metrics import MetricsConfig
from interleaf.coordinator.config.model import ModelConfig
from interleaf.coordinator.config.parallel import ParallelConfig
from interleaf.coordinator.config.rules import ConfigError
from interleaf.coordinator.config.sections import (
    CheckpointConfig,
    DataConfig,
    RecoveryConfig,
    TraceConfig,
)
from interleaf.coordinator.config.train import TrainConfig
from interleaf.common import limits
from interleaf.common.limits import shown

_SECTION_TYPES = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "recovery": RecoveryConfig,
    "trace": TraceConfig,
    "eval": EvalConfig,
    "metrics": MetricsConfig,
}


class _FloatPair:
    """The type of a field of two numbers, e.g. train.betas = [0.9, 0.95]."""


class _Switch:
    """The type of a field that is true, false or "auto": train.compile."""


def _convert(section: str, key: str, kind: type, value):
    """Coerces a TOML or command-line value to the field's type, or says why not."""
    where = f"{section}.{key}={shown(value)}"
    if kind is _FloatPair:  # a TOML array, or on the command line [0.9, 0.95] or 0.9,0.95
        items = value if isinstance(value, list) else None
        if items is None or len(items) != 2 or not all(
                isinstance(i, (int, float)) and not isinstance(i, bool) for i in items):
            raise ConfigError(f"{where} must be a pair of numbers, e.g. [0.9, 0.95]")
        return (float(items[0]), float(items[1]))
    if kind is _Switch:  # the section's own check names the words it takes
        if not isinstance(value, (bool, str)):
            raise ConfigError(f"{where} must be true, false or \"auto\"")
        return value
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false")
        return value
    if kind is tuple:  # of ints: a TOML array, or on the command line [1, -1] or 1,-1
        items = value if isinstance(value, list) else None
        if items is None or not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
            raise ConfigError(f"{where} must be a list of whole numbers, e.g. [1, -1]")
        return tuple(items)
    if isinstance(value, bool):
        raise ConfigError(f"{where} must be {kind.__name__}, not a boolean")
    try:
        if kind is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if kind is float:
            return float(value)
        if kind is str:
            if not isinstance(value, str):
                raise ValueError
            if len(value) > limits.MAX_TEXT_CHARS:
                raise ConfigError(f"{where} must be at most {limits.MAX_TEXT_CHARS} characters")
            if "\0" in value:
                raise ConfigError(f"{where} must not contain a NUL character")
            return value
    except (ValueError, TypeError, OverflowError) as err:  # a table, an array, a date; inf
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"{where} must be {kind.__name__}") from None
    raise ConfigError(f"{where}: unsupported field type {kind}")


def _field_types(cls) -> dict[str, type]:
    hints = {"int": int, "float": float, "str": str, "bool": bool, "bool | None": bool, "tuple[int, ...]": tuple,
             "tuple[float, float]": _FloatPair, "bool | str": _Switch}
    return {f.name: hints[f.type] for f in dataclasses.fields(cls)}


def build_config(raw: dict, overrides: list[str] = ()) -> JobConfig:
    """Builds and validates a JobConfig from parsed TOML and SECTION.KEY=VALUE overrides.
    With checkpoint.init, `[model]` is taken from those weights (coordinator/init_source.py)."""
    values: dict[str, dict] = {name: {} for name in _SECTION_TYPES}
    for section, table in raw.items():
        if section not in _SECTION_TYPES and not isinstance(table, dict):
            owners = [name for name, cls in _SECTION_TYPES.items() if section in _field_types(cls)]
            raise ConfigError(f"{_name(section)}={shown(table)} is outside any section: settings go in a table"
                              + (f", e.g. [{owners[0]}] {_name(section)} = ..." if owners else
                                 f" (known: {', '.join(_SECTION_TYPES)})"))
        if section not in _SECTION_TYPES:
            raise ConfigError(f"unknown section [{_name(section)}] (known: {', '.join(_SECTION_TYPES)})")
        if not isinstance(table, dict):
            raise ConfigError(f"{section}={shown(table)} must be a table [{section}]")
        for key, value in table.items():
            values[section][key] = (value, False)
    for item in overrides:
        path, sep, text = item.partition("=")
        section, dot, key = path.strip().partition(".")
        if not sep or not dot:
            raise ConfigError(f"--set {shown(item)} must look like SECTION.KEY=VALUE")
        if section not in _SECTION_TYPES:
            raise ConfigError(f"--set {shown(item)}: unknown section [{_name(section)}] "
                              f"(known: {', '.join(_SECTION_TYPES)})")
        values[section][key.strip()] = (text.strip(), True)

    given = {section: _typed(section, cls, values[section]) for section, cls in _SECTION_TYPES.items()}
    checkpoint = CheckpointConfig(**given["checkpoint"])
    if checkpoint.init:
        # Imported here: it reads the weights' config through stage-server code, which loads torch.
        from interleaf.coordinator.init_source import read_source, take_model

        source = read_source(checkpoint.init)
        given["model"] = take_model(given["model"], checkpoint.init, source)
        given["checkpoint"]["init"] = source.location
    return JobConfig(**{section: cls(**given[section]) for section, cls in _SECTION_TYPES.items()})


def _typed(section: str, cls, values: dict[str, tuple]) -> dict:
    """A section's given values, (value, from the command line) each, as its fields' types."""
    types = _field_types(cls)
    kwargs = {}
    for key, (value, from_text) in values.items():
        if key not in types:
            raise ConfigError(
                f"unknown key {section}.{_name(key)} (known: {', '.join(types)})"
            )
        if from_text and types[key] in (bool, _Switch):
            value = {"true": True, "false": False}.get(value.lower(), value)
        elif from_text and types[key] in (tuple, _FloatPair):
            value = _list_from_text(value)
        elif from_text and types[key] is not str:
            value = _number_from_text(section, key, value)
        kwargs[key] = _convert(section, key, types[key], value)
    return kwargs


def _number_from_text(section: str, key: str, text: str):
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text  # _convert names the expected type


def _list_from_text(text: str):
    """`[1, -1]` (TOML's form) or `1,-1` as a list, or the text unchanged when it is
    neither (_convert names the expected type)."""
    try:
        return tomllib.loads(f"v = {text if text.startswith('[') else f'[{text}]'}")["v"]
    except (tomllib.TOMLDecodeError, RecursionError):
        return text


def _name(text: str) -> str:
    """A section or key name as an error shows it: as written when short and printable."""
    return text if len(text) <= 64 and text.isprintable() else shown(text)


def given_settings(toml_text: str, overrides: list[str], section: str) -> dict:
    """The settings of `section` that the TOML and the overrides give (an override after
    the TOML, the last of a key winning), each converted to its field's type: a
    ConfigError as load_config words it for a value of the wrong type or an unknown key.
    No rule on a value or between settings is checked."""
    try:
        table = tomllib.loads(toml_text).get(section, {})
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config is not valid TOML: {err}") from None
    except RecursionError:  # as load_config words it
        raise ConfigError("config nests arrays or inline tables too deeply to be a job config") from None
    values = {key: (value, False) for key, value in table.items()} if isinstance(table, dict) else {}
    for item in overrides:
        path, sep, text = item.partition("=")
        name, dot, key = path.strip().partition(".")
        if sep and dot and name == section:
            values[key.strip()] = (text.strip(), True)
    return _typed(section, _SECTION_TYPES[section], values)


def load_config(toml_text: str = "", overrides: list[str] = ()) -> JobConfig:
    try:
        raw = tomllib.loads(toml_text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config is not valid TOML: {err}") from None
    except RecursionError:  # tomllib parses nested arrays and inline tables recursively
        raise ConfigError("config nests arrays or inline tables too deeply to be a job config") from None
    return build_config(raw, overrides)
