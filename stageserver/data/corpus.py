"""The default corpus: this Python's standard-library sources, tokenized by bytes and
cached on first use. It needs no download and is the same on every server that runs
the same Python (servers report its SHA-256, and the coordinator insists they agree)."""

from __future__ import annotations

import os
import pathlib
import platform
import sysconfig

from interleaf.stageserver.data.tokenfile import TokenFile, write_tokens
from interleaf.stageserver.data.tokenizer import encode


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("INTERLEAF_CACHE", pathlib.Path.home() / ".cache" / "interleaf"))


def builtin_corpus() -> pathlib.Path:
    path = cache_dir() / f"stdlib-{platform.python_version()}.tokens"
    # The sidecar is written after the tokens: once it exists, both are complete, even
    # while another local server is still building the same cache.
    if not path.with_name(path.name + ".json").exists():
        stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
        sources = sorted(stdlib.glob("*.py"))
        if not sources:
            raise FileNotFoundError(f"data.source='builtin': no Python sources under {stdlib}")
        text = "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in sources)
        write_tokens(path, encode(text))
    return path


def resolve_source(source: str) -> TokenFile:
    """Opens data.source: 'builtin' or a token file path."""
    return TokenFile(builtin_corpus() if source == "builtin" else source)
