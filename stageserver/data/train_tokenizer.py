"""`interleaf data tokenizer train`: a byte-level BPE (GPT-2's scheme) learned from the
user's documents with the `tokenizers` trainer, read by the same readers as prepare.

Byte-level means the 256 byte values are the initial alphabet, so any text encodes
without an unknown token; merges are learned up to `vocab_size`, which counts the 256
bytes and the end-of-document token. A corpus with fewer distinct pairs than that stops
earlier: the tokenizer's get_vocab_size() is what token files then record.
"""

from __future__ import annotations

import os
import pathlib

from interleaf.stageserver.data.readers import documents, open_inputs

EOS = "<|endoftext|>"
"""The end-of-document token, named as GPT-2's, so text_tokenizer finds it."""


def train_bpe(inputs: list[str | os.PathLike], vocab_size: int, out: str | os.PathLike, text_field: str = "text",
              progress: bool = False) -> pathlib.Path:
    """Trains and writes OUT/tokenizer.json; returns its path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < 257:
        raise ValueError(f"--vocab-size={vocab_size} must be at least 257: the 256 bytes and {EOS}")
    opened = open_inputs(inputs, text_field)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator((texts for texts, _, _ in documents(opened, text_field)), trainer)
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    return out / "tokenizer.json"
