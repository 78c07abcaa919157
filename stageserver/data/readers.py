"""Documents read from the inputs of `interleaf data prepare` and `data tokenizer train`,
in batches of bounded size whatever the input's size (record batch by record batch for
parquet and arrow, line by line for jsonl), each with how many input bytes it moved
past, for the progress bar.

  .txt      the whole file is one document, read in line-aligned pieces of about
            BATCH_BYTES, each a batch of its own (`ends` says which piece ends it)
  .jsonl    one JSON object per line; the document is its `text_field`
  .parquet  column `text_field`, streamed by pyarrow record batch
  folder    written by `datasets`' save_to_disk: its arrow shards (IPC streams) in the
            order state.json lists them, column `text_field`; read with pyarrow alone,
            so the datasets library is not needed

Every input is checked (`open_inputs`) before any is read, so a wrong path or extension
stops the work before an output file is begun.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass

BATCH_DOCUMENTS = 1024
BATCH_BYTES = 1 << 20
"""A batch ends at this many documents or this many bytes of text, whichever comes
first: enough for the tokenizer's threads to share, and little enough that its encodings
stay small (`tokenizers` keeps ids, tokens, offsets and masks per token, about 80 bytes
each: a 4 MB batch raised prepare's peak by 250 MiB). One long document is still one
batch."""

RULE = ("prepare reads .txt (a file is one document), .jsonl (a document per line), .parquet, and "
        "folders written by datasets' save_to_disk")


class InputError(ValueError):
    """An input prepare cannot read, named with the rule it breaks."""


@dataclass(frozen=True)
class Input:
    path: pathlib.Path
    kind: str  # txt, jsonl, parquet, arrow
    files: tuple[pathlib.Path, ...]  # the arrow shards of a saved dataset; else the path

    @property
    def size(self) -> int:
        return sum(f.stat().st_size for f in self.files)


def open_inputs(paths, text_field: str) -> list[Input]:
    """Checks every input's kind (and, where a schema says it, its text column)."""
    inputs = [_input(pathlib.Path(p)) for p in paths]
    for i in inputs:
        if i.kind == "parquet":
            import pyarrow.parquet as pq

            _check_column(i.path, pq.read_schema(i.path), text_field)
    return inputs


def _input(path: pathlib.Path) -> Input:
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
            raise InputError(f"{path}: a DatasetDict's folder; name one of its splits' folders "
                             f"({', '.join(str(path / s) for s in splits)})")
        state = path / "state.json"
        if not state.is_file():
            raise InputError(f"{path}: a folder without state.json, so not one written by datasets' "
                             f"save_to_disk; {RULE}")
        shards = [path / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
        missing = [s for s in shards if not s.is_file()]
        if missing:
            raise InputError(f"{path}: state.json lists {missing[0].name}, which is not there")
        return Input(path, "arrow", tuple(shards))
    if not path.is_file():
        raise InputError(f"{path}: no such file or folder")
    kind = path.suffix.lower().lstrip(".")
    if kind not in ("txt", "jsonl", "parquet"):
        raise InputError(f"{path}: unknown extension {path.suffix!r}; {RULE}")
    return Input(path, kind, (path,))


def documents(inputs: list[Input], text_field: str) -> Iterator[tuple[list[str], list[bool], int]]:
    """(texts, ends, input bytes moved past) batches, input after input, in order.
    A text is a whole document (its `ends` True) or, for a long .txt file, one of its
    pieces, of which only the last ends the document."""
    for i in inputs:
        if i.kind == "txt":
            yield from _txt(i.path)
            continue
        if i.kind == "jsonl":
            batches = _jsonl(i.path, text_field)
        elif i.kind == "parquet":
            batches = _parquet(i.path, text_field)
        else:
            batches = (b for shard in i.files for b in _arrow(shard, text_field))
        for texts, moved in batches:
            yield texts, [True] * len(texts), moved


def _txt(path: pathlib.Path):
    # Cut after a line end, never inside a UTF-8 character; a single line longer than
    # BATCH_BYTES stays whole. Byte-level BPE merges do not cross a line end (its
    # pre-tokenizer splits there), so the pieces encode as the whole file would, but
    # for runs of blank lines split across a cut.
    piece, size = [], 0
    with open(path, "rb") as f:
        for line in f:
            piece.append(line)
            size += len(line)
            if size >= BATCH_BYTES:
                yield [b"".join(piece).decode("utf-8", errors="replace")], [False], size
                piece, size = [], 0
    yield [b"".join(piece).decode("utf-8", errors="replace")], [True], size


def _jsonl(path: pathlib.Path, field: str):
    batch, text_bytes, moved = [], 0, 0
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            moved += len(line)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as err:
                raise InputError(f"{path}:{number} is not JSON ({err}); .jsonl holds one object per line") from None
            if not isinstance(record, dict) or field not in record:
                have = ", ".join(map(repr, record)) if isinstance(record, dict) else type(record).__name__
                raise InputError(f"{path}:{number} has no field {field!r} (it has {have or 'none'}); "
                                 f"choose the text's field with --text-field")
            text = record[field]
            if not isinstance(text, str):
                raise InputError(f"{path}:{number}: field {field!r} is {type(text).__name__}, not a string")
            if batch and (len(batch) >= BATCH_DOCUMENTS or text_bytes + len(line) > BATCH_BYTES):
                yield batch, moved - len(line)
                batch, text_bytes, moved = [], 0, len(line)
            batch.append(text)
            text_bytes += len(line)
    if batch or moved:
        yield batch, moved


def _check_column(path: pathlib.Path, schema, field: str) -> None:
    import pyarrow as pa

    if field not in schema.names:
        raise InputError(f"{path} has no column {field!r} (it has {', '.join(map(repr, schema.names))}); "
                         f"choose the text's column with --text-field")
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise InputError(f"{path}: column {field!r} holds {kind}, not strings")


def _texts(path: pathlib.Path, column, first_row: int) -> list[str]:
    if column.null_count:
        row = first_row + column.is_null().to_pylist().index(True)
        raise InputError(f"{path}: row {row} has no text (null); every document must be a string")
    return column.to_pylist()


def _cuts(column) -> Iterator[tuple[int, int]]:
    """[start, stop) row ranges of at most BATCH_DOCUMENTS rows and BATCH_BYTES of text
    (at least one row): a record batch of long documents is split, as jsonl's lines are."""
    import pyarrow.compute as pc

    lengths = pc.binary_length(column).fill_null(0).to_pylist()
    start, text_bytes = 0, 0
    for row, length in enumerate(lengths):
        if row > start and (row - start >= BATCH_DOCUMENTS or text_bytes + length > BATCH_BYTES):
            yield start, row
            start, text_bytes = row, 0
        text_bytes += length
    if start < len(lengths):
        yield start, len(lengths)


def _rows(path: pathlib.Path, batches, field: str, size: int, at):
    """Record batches cut into document batches; `at(rows read)` is how far into the
    file's `size` bytes the reader has come."""
    done, moved_to = 0, 0
    for batch in batches:
        column = batch.column(batch.schema.get_field_index(field))
        for start, stop in _cuts(column):
            texts = _texts(path, column.slice(start, stop - start), done + start)
            position = at(done + stop)
            yield texts, position - moved_to
            moved_to = position
        done += len(column)
    if moved_to < size:  # an arrow stream's end marker; a file of no rows
        yield [], size - moved_to


def _parquet(path: pathlib.Path, field: str):
    import pyarrow.parquet as pq

    with pq.ParquetFile(path) as f:
        # 256 rows a record batch: a few MB of text for typical web documents.
        size, rows = path.stat().st_size, max(f.metadata.num_rows, 1)
        yield from _rows(path, f.iter_batches(batch_size=256, columns=[field]), field, size,
                         lambda done: size * done // rows)


def _arrow(path: pathlib.Path, field: str):
    import pyarrow as pa

    with pa.OSFile(str(path), "rb") as f:
        try:
            reader = pa.ipc.open_stream(f)
        except pa.ArrowInvalid as err:
            raise InputError(f"{path} is not an arrow IPC stream as datasets writes ({err})") from None
        _check_column(path, reader.schema, field)
        yield from _rows(path, reader, field, os.path.getsize(path), lambda _: f.tell())
