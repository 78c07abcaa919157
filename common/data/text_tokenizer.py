"""Tokenizers as data.tokenizer names them: 'bytes' (common/data/tokenizer.py), or
the path of a `tokenizers` tokenizer.json or of a Hugging Face model folder holding one.

Both offer the same five things prepare, the vocabulary check and generation need:
batch encode, decode, vocab_size, eos_id (the end-of-document token prepare appends
after every document) and a fingerprint that a token file's sidecar records, so a
token file says which tokenizer made it. Only the `tokenizers` library is used, never
`transformers`: a model folder is read for its tokenizer.json and tokenizer_config.json.
"""

from __future__ import annotations

import hashlib
import json
import pathlib

import numpy as np

from interleaf.common.data import tokenizer as byte_tokenizer

EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
"""End-of-document tokens by the names GPT-2, Llama 3, Llama 2/Mistral and Gemma give
them: looked up when no tokenizer_config.json names the eos_token."""


class TokenizerError(ValueError):
    """A tokenizer spec that names nothing loadable."""


class BytesTokenizer:
    """One token per UTF-8 byte."""

    vocab_size = byte_tokenizer.VOCAB_SIZE
    # None: the 256 ids are the 256 byte values, so there is no id left to mark the end
    # of a document; byte-tokenized documents are simply concatenated.
    eos_id = None
    fingerprint = "bytes"

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [byte_tokenizer.encode(t) for t in texts]

    def decode(self, ids) -> str:
        return byte_tokenizer.decode(ids)


class FileTokenizer:
    """A `tokenizers` Tokenizer read from its tokenizer.json."""

    def __init__(self, path: pathlib.Path, field: str):
        from tokenizers import Tokenizer

        try:
            text = path.read_text(encoding="utf-8")
            self.tokenizer = Tokenizer.from_str(text)
        except Exception as err:  # tokenizers raises plain Exceptions for a malformed file
            raise TokenizerError(f"{field}={str(path)!r} is not a tokenizers tokenizer.json: {err}") from None
        self.path = path
        # Ids need not be dense (a tokenizer may skip some): the vocabulary a model needs
        # reaches the largest id.
        self.vocab_size = max(self.tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self.eos_id = _eos_id(self.tokenizer, path.parent / "tokenizer_config.json")
        # The canonical JSON: the same tokenizer saved with other whitespace or key order
        # has the same fingerprint.
        canonical = json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        self.fingerprint = "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        # add_special_tokens=False: no BOS or template tokens; prepare adds eos_id itself.
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        return [np.array(e.ids, dtype=np.uint32) for e in encodings]

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids])


def _eos_id(tok, config: pathlib.Path) -> int | None:
    names = list(EOS_NAMES)
    if config.is_file():
        eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
        if isinstance(eos, dict):  # an AddedToken, as older transformers saved it
            eos = eos.get("content")
        if isinstance(eos, str):
            names.insert(0, eos)
    return next((tok.token_to_id(n) for n in names if tok.token_to_id(n) is not None), None)


def load_tokenizer(spec: str, field: str = "data.tokenizer") -> BytesTokenizer | FileTokenizer:
    """`field` names where the spec came from, for the error (data.tokenizer, --tokenizer)."""
    if spec == "bytes":
        return BytesTokenizer()
    path = pathlib.Path(spec).expanduser()
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise TokenizerError(
                f"{field}={spec!r} is a folder without a tokenizer.json (a model with only a sentencepiece "
                f"tokenizer.model can be converted once: transformers' AutoTokenizer.from_pretrained(DIR)"
                f".save_pretrained(DIR) writes one)")
        path = path / "tokenizer.json"
    elif not path.is_file():
        raise TokenizerError(f"{field}={spec!r} must be 'bytes', a tokenizer.json, or a model folder holding one; "
                             f"there is nothing at that path")
    return FileTokenizer(path, field)
