"""Reading a Hugging Face config.json: what every architecture's adapter needs alike."""

from __future__ import annotations


def required_count(config: dict, key: str) -> int:
    """config[key] as a positive whole number, or an error naming the key and value."""
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"config.json {key}={value!r} must be a positive whole number")
    return value
