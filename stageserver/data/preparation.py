"""`interleaf data prepare`: documents in, one token file out, streamed.

Documents come from the readers (stageserver/data/readers.py) in batches of bounded
size; each batch is encoded by the tokenizer's own batch encoder (`tokenizers` splits a
batch over its threads), the end-of-document id follows every document (when the
tokenizer has one: bytes has not), and the ids go straight to a TokenWriter, so memory
stays flat whatever the input's size. The dtype is fixed by the vocabulary before the
first id is written: uint16 while every id fits, else uint32.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from interleaf.common.data.text_tokenizer import BytesTokenizer
from interleaf.stageserver.data.readers import documents, open_inputs
from interleaf.stageserver.data.tokenfile import TokenWriter, dtype_for


def prepare(inputs: list[str | os.PathLike], out: str | os.PathLike, tokenizer=None, text_field: str = "text",
            progress: bool = False) -> dict:
    """Writes `out` and its sidecar; returns the sidecar. `tokenizer`: a loaded one
    (common/data/text_tokenizer.py; None: bytes). `progress`: a bar on stderr."""
    from tqdm import tqdm

    tokenizer = tokenizer or BytesTokenizer()
    opened = open_inputs(inputs, text_field)
    eos = None if tokenizer.eos_id is None else np.array([tokenizer.eos_id], dtype=np.uint32)
    count = 0
    with TokenWriter(out, dtype_for(tokenizer.vocab_size)) as writer, \
            tqdm(total=sum(i.size for i in opened), unit="B", unit_scale=True, desc="prepare", file=sys.stderr,
                 disable=not progress) as bar:
        for texts, ends, moved in documents(opened, text_field):
            encoded = tokenizer.encode_batch(texts)
            if eos is not None:
                encoded = [part for ids, end in zip(encoded, ends) for part in ((ids, eos) if end else (ids,))]
            if encoded:
                writer.write(np.concatenate(encoded))
            count += sum(ends)
            bar.update(moved)
            bar.set_postfix(documents=count, tokens=writer.count, refresh=False)
        return writer.finish(documents=count, vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id,
                             tokenizer=tokenizer.fingerprint)
