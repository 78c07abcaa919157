"""The default corpus: this Python's standard-library sources, tokenized by bytes and
cached on first use. It needs no download and is the same on every server that runs
the same Python (servers report its SHA-256, and the coordinator insists they agree)."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import platform
import sysconfig

from interleaf.common.data.blend import parse_source
from interleaf.common.data.text_tokenizer import BytesTokenizer
from interleaf.common.data.tokenizer import encode
from interleaf.stageserver.data.tokenfile import TokenFile, TokenWriter, dtype_for


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("INTERLEAF_CACHE", pathlib.Path.home() / ".cache" / "interleaf"))


def builtin_corpus() -> pathlib.Path:
    path = cache_dir() / f"stdlib-{platform.python_version()}.tokens"
    # The sidecar is written after the tokens: once it exists, both are complete, even
    # while another local server is still building the same cache. A cache built before
    # sidecars recorded the vocabulary is built again.
    sidecar = path.with_name(path.name + ".json")
    # Its documents' starts (which eval.fraction holds out whole: bytes have no
    # end-of-document id) came later still; the tokens stay the same.
    if not sidecar.exists() or not {"vocab_size", "document_starts"} <= json.loads(sidecar.read_text()).keys():
        stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
        sources = sorted(stdlib.glob("*.py"))
        if not sources:
            raise FileNotFoundError(f"data.source='builtin': no Python sources under {stdlib}")
        tokenizer = BytesTokenizer()
        with TokenWriter(path, dtype_for(tokenizer.vocab_size)) as writer:
            # Bytes have no end-of-document id: the files are joined by a newline.
            starts = []
            for i, source in enumerate(sources):
                starts.append(writer.count)  # the joining newline goes with the document after it
                writer.write(encode(("\n" if i else "") + source.read_text(encoding="utf-8", errors="replace")))
            writer.finish(documents=len(sources), vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id,
                          tokenizer=tokenizer.fingerprint, document_starts=starts)
    return path


class Source:
    """data.source opened: its token files and their weights (a single file: weight 1)."""

    def __init__(self, source: str):
        components = parse_source(source)
        self.files = [TokenFile(builtin_corpus() if c.path == "builtin" else c.path) for c in components]
        self.weights = [c.weight for c in components]

    def __len__(self) -> int:
        return sum(len(f) for f in self.files)

    @property
    def vocab_size(self) -> int | None:
        """The largest vocabulary its files' sidecars record (None: none records one)."""
        return max((f.vocab_size for f in self.files if f.vocab_size is not None), default=None)

    @property
    def sha256(self) -> str:
        """What servers compare (SetupReply.data_sha256): a single file's SHA-256; for a
        blend, one over every file's and its weight, so servers that would draw
        different samples disagree."""
        if len(self.files) == 1:
            return self.files[0].sha256
        listing = "".join(f"{f.sha256} {w!r}\n" for f, w in zip(self.files, self.weights))
        return hashlib.sha256(listing.encode()).hexdigest()


def resolve_source(source: str) -> Source:
    """Opens data.source: 'builtin', a token file path, or a blend of them
    (`a.bin:0.7,builtin:0.3`, blend.py)."""
    return Source(source)
