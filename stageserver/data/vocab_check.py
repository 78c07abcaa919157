"""Does the model's vocabulary hold the data's? A token file's sidecar records the
vocabulary of the tokenizer that wrote it, and data.tokenizer has its own: a model with
fewer ids than either would index past its embedding, so such a job is refused before
any server allocates (the coordinator at submission, `interleaf run --local` before it
starts anything), naming both numbers. Stage servers refuse it too, from the sidecar of
the file they open (stageserver/job.py).
"""

from __future__ import annotations

import json
import pathlib

from interleaf.stageserver.data.blend import parse_source
from interleaf.stageserver.data.text_tokenizer import BytesTokenizer, load_tokenizer


class VocabError(ValueError):
    """The model's vocabulary is smaller than its data's or its tokenizer's."""


def data_too_big(vocab_size: int, source: str, data_vocab: int) -> str:
    """The refusal for one token file of data.source (as a stage server words it too)."""
    return (f"model.vocab_size={vocab_size} is smaller than the vocabulary of data.source={source!r} "
            f"({data_vocab}, from its tokenizer): its ids reach {data_vocab - 1}; set model.vocab_size "
            f"to at least {data_vocab}")


def check_vocab(vocab_size: int, source: str, tokenizer: str, tokenizer_needed: bool) -> None:
    """Raises VocabError when a token file of `source` whose sidecar this process can
    read, or the `tokenizer`, has a larger vocabulary than `vocab_size`. A file it cannot
    read is left to the stage servers, which must. A tokenizer it cannot load is an error
    when `tokenizer_needed` (here is where the job runs), else left alone (a remote
    coordinator need not see the users' files)."""
    for path, _ in parse_source(source):
        data_vocab = BytesTokenizer.vocab_size if path == "builtin" else _sidecar_vocab(pathlib.Path(path))
        if data_vocab is not None and data_vocab > vocab_size:
            raise VocabError(data_too_big(vocab_size, path, data_vocab))
    # 'bytes' is every job's default, so it claims nothing about the data: a job on a
    # token file of its own small ids leaves it set; the file's sidecar is what counts.
    if tokenizer == "bytes" or not (tokenizer_needed or pathlib.Path(tokenizer).expanduser().exists()):
        return
    tokenizer_vocab = load_tokenizer(tokenizer).vocab_size
    if tokenizer_vocab > vocab_size:
        raise VocabError(f"model.vocab_size={vocab_size} is smaller than the vocabulary of "
                         f"data.tokenizer={tokenizer!r} ({tokenizer_vocab}); set model.vocab_size to at least "
                         f"{tokenizer_vocab}")


def _sidecar_vocab(path: pathlib.Path) -> int | None:
    try:
        return json.loads(path.with_name(path.name + ".json").read_text()).get("vocab_size")
    except (OSError, ValueError):
        return None
