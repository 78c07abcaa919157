"""Tokens on disk and the order samples are drawn in."""

from stageserver.data.corpus import builtin_corpus, resolve_source
from stageserver.data.sampler import Sampler
from stageserver.data.tokenfile import TokenFile, prepare, write_tokens
from stageserver.data.tokenizer import decode, encode

__all__ = [
    "Sampler", "TokenFile", "builtin_corpus", "decode", "encode", "prepare",
    "resolve_source", "write_tokens",
]
