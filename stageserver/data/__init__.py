"""Tokens on disk and the order samples are drawn in."""

from interleaf.stageserver.data.corpus import builtin_corpus, resolve_source
from interleaf.stageserver.data.sampler import Sampler
from interleaf.stageserver.data.prepare import prepare
from interleaf.stageserver.data.tokenfile import TokenFile, write_tokens
from interleaf.stageserver.data.tokenizer import decode, encode

__all__ = [
    "Sampler", "TokenFile", "builtin_corpus", "decode", "encode", "prepare",
    "resolve_source", "write_tokens",
]
