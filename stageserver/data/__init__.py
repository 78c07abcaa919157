"""Tokens on disk and the order samples are drawn in.

These names are imported on first use, as `interleaf`'s own are: the data tools
(`interleaf data prepare`, readers) then run without loading torch, which
only the sampler needs (measured: 2 s of start-up and 200 MiB of prepare's resident set).
"""

_EXPORTS = {
    "Sampler": "sampler",
    "TokenFile": "tokenfile",
    "builtin_corpus": "corpus",
    "prepare": "preparation",
    "resolve_source": "corpus",
    "write_tokens": "tokenfile",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
