"""Token files, the byte tokenizer and the built-in corpus (the sampler and blends:
tests/test_sampler.py).

Everything here is exact: token ids, bytes and hashes are integers, so
every comparison is equality. The CLI is run as a real subprocess.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import subprocess
import sys
import sysconfig

import numpy as np
import pytest
import torch

from interleaf.common.data.tokenizer import decode, encode
from interleaf.stageserver.data import TokenFile, builtin_corpus, prepare, resolve_source, write_tokens

REPO = pathlib.Path(__file__).resolve().parents[1]


def _random_text(seed: int, length: int) -> str:
    """Code points from every UTF-8 length class (1-4 bytes), surrogates excluded."""
    rng = np.random.default_rng(seed)
    ranges = [(0x00, 0x80), (0x80, 0x800), (0x800, 0xD800), (0xE000, 0x10000), (0x10000, 0x110000)]
    picks = rng.integers(0, len(ranges), size=length)
    return "".join(chr(int(rng.integers(*ranges[k]))) for k in picks)


def _sidecar(path: pathlib.Path) -> dict:
    return json.loads(path.with_name(path.name + ".json").read_text())


# --- tokenizer ------------------------------------------------------------------------


@pytest.mark.parametrize("text", [
    "",
    "hello, world\n",
    "naïve café — 東京 🚀 \u0301e\x00\t",
    _random_text(0, 500),
    _random_text(1, 500),
])
def test_byte_tokenizer_round_trips_unicode(text):
    tokens = encode(text)
    assert tokens.dtype == np.uint16
    # One token per UTF-8 byte, all within the 256 vocabulary.
    assert tokens.tolist() == list(text.encode("utf-8"))
    assert tokens.size == 0 or int(tokens.max()) < 256
    assert decode(tokens) == text
    # decode takes any iterable of ids, e.g. a torch tensor slice of a batch.
    assert decode(torch.from_numpy(tokens.astype(np.int64))) == text


# --- write_tokens / TokenFile -----------------------------------------------------------


@pytest.mark.parametrize("top, dtype, itemsize", [
    (255, "uint16", 2), (65535, "uint16", 2), (65536, "uint32", 4), (2**32 - 1, "uint32", 4),
])
def test_write_tokens_picks_smallest_dtype_and_sidecar_matches_bytes(tmp_path, top, dtype, itemsize):
    tokens = np.array([0, 7, top, 3, top // 2], dtype=np.int64)
    path = tmp_path / "t.tokens"
    meta = write_tokens(path, tokens)

    raw = path.read_bytes()
    assert meta == {"dtype": dtype, "count": 5, "sha256": hashlib.sha256(raw).hexdigest()}
    assert _sidecar(path) == meta
    assert len(raw) == 5 * itemsize
    assert np.frombuffer(raw, dtype=dtype).tolist() == tokens.tolist()

    tf = TokenFile(path)
    assert isinstance(tf.tokens, np.memmap)
    assert tf.tokens.dtype == np.dtype(dtype)
    assert len(tf) == 5
    assert tf.tokens.tolist() == tokens.tolist()
    assert tf.sha256 == meta["sha256"]
    # No temporary files are left beside the output.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.tokens", "t.tokens.json"]


def test_token_file_rejects_missing_file_naming_data_source(tmp_path):
    missing = tmp_path / "nope.tokens"
    with pytest.raises(FileNotFoundError, match=r"data\.source=.*nope\.tokens"):
        TokenFile(missing)


def test_token_file_rejects_missing_sidecar(tmp_path):
    path = tmp_path / "t.tokens"
    write_tokens(path, np.arange(10))
    path.with_name("t.tokens.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"data\.source=.*t\.tokens.*t\.tokens\.json"):
        TokenFile(path)


def test_token_file_rejects_sidecar_count_mismatch(tmp_path):
    path = tmp_path / "t.tokens"
    meta = write_tokens(path, np.arange(10))
    sidecar = path.with_name("t.tokens.json")
    sidecar.write_text(json.dumps({**meta, "count": 11}))
    with pytest.raises(ValueError, match=r"data\.source=.*t\.tokens.* holds 10 tokens, its sidecar says 11"):
        TokenFile(path)


@pytest.mark.parametrize("sidecar_text", ["{not json", json.dumps({"count": 10, "sha256": "x"}),
                                          json.dumps({"count": 10, "sha256": "x", "dtype": "float7"})])
def test_a_broken_sidecar_is_refused_naming_the_field(tmp_path, sidecar_text):
    path = tmp_path / "v.tokens"
    write_tokens(path, np.arange(10))
    path.with_name("v.tokens.json").write_text(sidecar_text)
    with pytest.raises(ValueError, match=r"^eval\.source=.*v\.tokens': its sidecar v\.tokens\.json is not one"):
        TokenFile(path, field="eval.source")


def test_token_file_reads_a_sidecar_from_before_count_and_vocab_size(tmp_path):
    path = tmp_path / "t.tokens"
    meta = write_tokens(path, np.arange(10))
    old = {"dtype": meta["dtype"], "tokens": 10, "sha256": meta["sha256"]}  # as written before `count`
    path.with_name("t.tokens.json").write_text(json.dumps(old))
    tf = TokenFile(path)
    assert len(tf) == 10 and tf.vocab_size is None
    path.with_name("t.tokens.json").write_text(json.dumps({**old, "tokens": 9}))
    with pytest.raises(ValueError, match="holds 10 tokens, its sidecar says 9"):
        TokenFile(path)


def test_prepare_concatenates_byte_tokens_of_files(tmp_path):
    texts = ["first file: ünïcödé\n", "second — 二番目 🐍", "third\n"]
    files = []
    for i, text in enumerate(texts):
        files.append(tmp_path / f"{i}.txt")
        files[-1].write_text(text, encoding="utf-8")
    out = tmp_path / "out" / "corpus.tokens"  # the parent directory is created

    meta = prepare(files, out)

    expected = b"".join(t.encode("utf-8") for t in texts)
    tf = TokenFile(out)
    assert meta["count"] == len(expected) == len(tf)
    assert meta["dtype"] == "uint16"
    assert tf.tokens.tolist() == list(expected)
    assert decode(tf.tokens) == "".join(texts)


# --- CLI ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory) -> dict:
    """Both CLI cases, run concurrently: each child pays for importing torch."""
    root = tmp_path_factory.mktemp("cli")
    a, b, missing = root / "A.txt", root / "B.txt", root / "missing.txt"
    a.write_text("alpha αβγ\n", encoding="utf-8")
    b.write_text("beta 🙂 end", encoding="utf-8")
    cases = {
        "ok": ([a, b], root / "X.tokens"),
        "missing": ([a, missing], root / "Y.tokens"),
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "interleaf.clients.cli", "data", "prepare", *map(str, texts), "--out", str(out)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for name, (texts, out) in cases.items()
    }
    runs = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        runs[name] = dict(rc=proc.returncode, stdout=stdout, stderr=stderr, out=cases[name][1], missing=missing)
    return runs


def test_cli_data_prepare_writes_a_readable_token_file(cli_runs):
    run = cli_runs["ok"]
    assert run["rc"] == 0, run["stderr"]
    text = "alpha αβγ\nbeta 🙂 end"
    n = len(text.encode("utf-8"))
    assert f"wrote {n:,} tokens (uint16) to {run['out']}" in run["stdout"]
    tf = TokenFile(run["out"])
    assert len(tf) == n
    assert decode(tf.tokens) == text


def test_cli_data_prepare_missing_text_is_a_one_line_usage_error(cli_runs):
    run = cli_runs["missing"]
    assert run["rc"] == 2
    lines = run["stderr"].strip().splitlines()
    assert len(lines) == 1, run["stderr"]
    assert lines[0].startswith("error: ")
    assert str(run["missing"]) in lines[0]
    assert not run["out"].exists()


# --- built-in corpus -------------------------------------------------------------------


def test_builtin_corpus_builds_once_into_the_cache_and_is_reused(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("INTERLEAF_CACHE", str(cache))

    path = builtin_corpus()
    assert path.parent == cache
    sidecar = path.with_name(path.name + ".json")
    stamps = (path.stat().st_mtime_ns, sidecar.stat().st_mtime_ns)

    tf = TokenFile(path)
    # The standard library's top-level sources are megabytes of text.
    assert len(tf) > 1_000_000
    # A complete sidecar, as prepare writes: one document per source file, bytes.
    assert {k: tf.meta[k] for k in ("vocab_size", "eos_id", "tokenizer")} == {
        "vocab_size": 256, "eos_id": None, "tokenizer": "bytes"}
    assert tf.meta["documents"] == len(list(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py")))
    assert tf.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert "def " in decode(tf.tokens[:20_000])

    assert builtin_corpus() == path
    assert (path.stat().st_mtime_ns, sidecar.stat().st_mtime_ns) == stamps

    data = resolve_source("builtin")
    assert [f.path for f in data.files] == [path] and data.sha256 == tf.sha256
    assert (path.stat().st_mtime_ns, sidecar.stat().st_mtime_ns) == stamps


def test_resolve_source_opens_a_token_file_path(tmp_path):
    path = tmp_path / "t.tokens"
    write_tokens(path, np.arange(100))
    data = resolve_source(str(path))
    assert [f.tokens.tolist() for f in data.files] == [list(range(100))] and data.weights == [1.0]


def test_empty_token_file_is_refused_by_name(tmp_path):
    path = tmp_path / "empty.tokens"
    write_tokens(path, np.zeros(0, np.uint16))
    with pytest.raises(ValueError, match=r"data\.source=.*empty\.tokens.* holds no tokens"):
        TokenFile(path)
