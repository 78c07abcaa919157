"""Does the model's vocabulary hold the data's? A token file's sidecar records the
vocabulary of the tokenizer that wrote it, and data.tokenizer has its own: a model with
fewer ids than either would index past its embedding, so such a job is refused before
any server allocates (the coordinator at submission, `interleaf run --local` before it
starts anything), naming both numbers. Stage servers refuse it too, from the sidecar of
the file they open (stageserver/job.py).
"""

from __future__ import annotations

import pathlib

from interleaf.common.data.blend import parse_source
from interleaf.common.data.token_sidecar import read_sidecar
from interleaf.common.data.text_tokenizer import BytesTokenizer, load_tokenizer


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
    made_by: dict[str, str] = {}  # tokenizer fingerprint -> a file it made
    for path, _ in parse_source(source):
        sidecar = {"vocab_size": BytesTokenizer.vocab_size, "tokenizer": BytesTokenizer.fingerprint} \
            if path == "builtin" else _sidecar(pathlib.Path(path))
        data_vocab = sidecar.get("vocab_size")
        if data_vocab is not None and data_vocab > vocab_size:
            raise VocabError(data_too_big(vocab_size, path, data_vocab))
        if sidecar.get("tokenizer"):
            made_by.setdefault(sidecar["tokenizer"], path)
    if len(made_by) > 1:
        (a, first), (b, second) = list(made_by.items())[:2]
        raise VocabError(f"data.source={source!r} blends token files of different tokenizers: {first!r} ({a}) and "
                         f"{second!r} ({b}); the same id would mean different text in each")
    # 'bytes' is every job's default, so it claims nothing about the data: a job on a
    # token file of its own small ids leaves it set; the file's sidecar is what counts.
    if tokenizer == "bytes" or not (tokenizer_needed or pathlib.Path(tokenizer).expanduser().exists()):
        return
    loaded = load_tokenizer(tokenizer)
    tokenizer_vocab = loaded.vocab_size
    if tokenizer_vocab > vocab_size:
        raise VocabError(f"model.vocab_size={vocab_size} is smaller than the vocabulary of "
                         f"data.tokenizer={tokenizer!r} ({tokenizer_vocab}); set model.vocab_size to at least "
                         f"{tokenizer_vocab}")
    if made_by and loaded.fingerprint not in made_by:
        ((fingerprint, path),) = made_by.items()
        raise VocabError(f"data.tokenizer={tokenizer!r} ({loaded.fingerprint}) did not make data.source's "
                         f"{path!r} ({fingerprint}, as its sidecar records): generation and export would "
                         f"turn its ids into other text")


def check_eval_source(vocab_size: int, eval_source: str, source: str) -> None:
    """Raises VocabError when eval.source's sidecar (where this process can read it)
    records a vocabulary the model's does not hold, or a tokenizer other than the one
    that made data.source's files: its ids would stand for other text, and its loss
    would score nothing the model learned. A file this process cannot read is left to
    the stage servers, which check its ids when they open it (stageserver/job.py)."""
    if not eval_source:
        return
    sidecar = _sidecar(pathlib.Path(eval_source))
    eval_vocab = sidecar.get("vocab_size")
    if eval_vocab is not None and eval_vocab > vocab_size:
        raise VocabError(f"model.vocab_size={vocab_size} is smaller than the vocabulary of "
                         f"eval.source={eval_source!r} ({eval_vocab}, from its tokenizer); set model.vocab_size "
                         f"to at least {eval_vocab}")
    made = sidecar.get("tokenizer")
    for path, _ in parse_source(source):
        data = {"tokenizer": BytesTokenizer.fingerprint} if path == "builtin" else _sidecar(pathlib.Path(path))
        if made and data.get("tokenizer") and data["tokenizer"] != made:
            raise VocabError(f"eval.source={eval_source!r} was made by another tokenizer ({made}) than "
                             f"data.source's {path!r} ({data['tokenizer']}): the same id would mean different "
                             f"text in each")


def _sidecar(path: pathlib.Path) -> dict:
    """A token file's sidecar; empty when this process cannot read it, or it is not one
    `interleaf data prepare` writes (the stage server that opens the file names why)."""
    try:
        return read_sidecar(path.with_name(path.name + ".json"))
    except (OSError, ValueError):
        return {}
