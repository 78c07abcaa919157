"""Tokenizers, input readers, `interleaf data prepare / inspect / tokenizer train`, and the
refusal of a model whose vocabulary is smaller than its data's.

Everything is real: files of every kind written by their own libraries (a folder by
`datasets`' save_to_disk, a model folder by `transformers`), tokenizers trained by
`tokenizers`, and token files compared id for id with what `tokenizers`' own
encode_batch gives for the same documents. CLI cases run the real command in a
subprocess.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import random
import shutil
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from interleaf.common.data.text_tokenizer import TokenizerError, load_tokenizer
from interleaf.common.data.vocab_check import VocabError, check_vocab
from interleaf.stageserver.data import TokenFile, prepare
from interleaf.stageserver.data.readers import BATCH_BYTES, InputError, documents, open_inputs
from interleaf.stageserver.data.train_tokenizer import EOS, train_bpe

REPO = pathlib.Path(__file__).resolve().parents[1]


def _docs(seed: int, n: int) -> list[str]:
    """Word salad with some non-ASCII and an empty document, as real corpora have."""
    r = random.Random(seed)
    words = ["".join(r.choice("abcdefghijklmnop") for _ in range(r.randint(1, 9))) for _ in range(300)]
    words += ["naïve", "東京", "🚀", "café\n"]
    docs = [" ".join(r.choice(words) for _ in range(r.randint(1, 60))) for _ in range(n)]
    docs[n // 2] = ""
    return docs


def _write_jsonl(path: pathlib.Path, docs: list[str], field: str = "text") -> pathlib.Path:
    with open(path, "w", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, field: d}, ensure_ascii=i % 2 == 0) + "\n")
            if i == 3:
                f.write("\n")  # a blank line is no document
    return path


def _write_parquet(path: pathlib.Path, docs: list[str]) -> pathlib.Path:
    # Small row groups: the reader crosses several, and record batches within them.
    pq.write_table(pa.table({"n": list(range(len(docs))), "text": docs}), path, row_group_size=300)
    return path


def _save_dataset(path: pathlib.Path, docs: list[str]) -> pathlib.Path:
    import datasets

    datasets.Dataset.from_dict({"text": docs, "n": list(range(len(docs)))}).save_to_disk(str(path), num_shards=3)
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """One file of each kind, with its documents."""
    root = tmp_path_factory.mktemp("corpus")
    txt = [_docs(1, 1)[0] + "\nline two", "second file — ünïcödé 🐍\n"]
    files = {"txt": [root / "a.txt", root / "b.txt"]}
    for f, d in zip(files["txt"], txt):
        f.write_text(d, encoding="utf-8")
    jsonl, parquet, saved = _docs(2, 1500), _docs(3, 1100), _docs(4, 700)
    files["jsonl"] = [_write_jsonl(root / "d.jsonl", jsonl)]
    files["parquet"] = [_write_parquet(root / "d.parquet", parquet)]
    files["saved"] = [_save_dataset(root / "saved", saved)]
    return {"root": root, "files": files, "docs": {"txt": txt, "jsonl": jsonl, "parquet": parquet, "saved": saved}}


@pytest.fixture(scope="module")
def bpe(corpus) -> pathlib.Path:
    return train_bpe(corpus["files"]["jsonl"], 400, corpus["root"] / "tok")


# --- readers ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet", "saved"])
def test_readers_stream_every_kind_in_order_and_account_for_every_byte(corpus, kind):
    files = corpus["files"][kind]
    opened = open_inputs(files, "text")
    batches = list(documents(opened, "text"))
    assert [d for texts, _, _ in batches for d in texts] == corpus["docs"][kind]
    assert all(all(ends) and len(ends) == len(texts) for texts, ends, _ in batches)
    # The progress bar's total is reached exactly, and batches are bounded.
    assert sum(moved for _, _, moved in batches) == sum(i.size for i in opened)
    assert max(len(texts) for texts, _, _ in batches) <= 1024


def test_long_documents_make_batches_of_bounded_text(tmp_path):
    docs = [f"{i} " * (50_000 * (1 + i % 4)) for i in range(12)]  # 100-600 kB each, 3.1 MB in all
    for path in (_write_jsonl(tmp_path / "long.jsonl", docs), _write_parquet(tmp_path / "long.parquet", docs),
                 _save_dataset(tmp_path / "long", docs)):
        batches = [texts for texts, _, _ in documents(open_inputs([path], "text"), "text") if texts]
        assert [d for texts in batches for d in texts] == docs
        assert all(len(texts) == 1 or sum(map(len, texts)) <= BATCH_BYTES for texts in batches), path
        assert len(batches) > sum(map(len, docs)) // BATCH_BYTES


def test_a_long_text_file_is_one_document_read_in_pieces(tmp_path, bpe):
    """A .txt bigger than a batch streams in line-aligned pieces; it is still one
    document, with one end-of-document token, and encodes as the whole file does."""
    lines = [f"line {i}: " + "word " * (i % 37) + "\n" for i in range(40_000)]  # about 3.5 MB
    path = tmp_path / "long.txt"
    path.write_text("".join(lines))
    batches = list(documents(open_inputs([path], "text"), "text"))
    assert len(batches) > 3 and [ends for _, ends, _ in batches] == [[False]] * (len(batches) - 1) + [[True]]
    assert "".join(t for texts, _, _ in batches for t in texts) == path.read_text()
    assert max(len(texts[0]) for texts, _, _ in batches) < 2 * BATCH_BYTES
    meta = prepare([path], tmp_path / "o.bin", load_tokenizer(str(bpe)))
    whole = Tokenizer.from_file(str(bpe)).encode(path.read_text(), add_special_tokens=False).ids
    assert meta["documents"] == 1 and meta["count"] == len(whole) + 1


def test_prepare_reads_a_saved_dataset_without_the_datasets_library_or_torch(corpus, tmp_path):
    code = ("import sys, builtins; real = builtins.__import__\n"
            "def guard(name, *a, **k):\n"
            "    assert not name.startswith(('datasets', 'torch', 'transformers')), name\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = guard\n"
            "from interleaf.stageserver.data import prepare\n"
            f"print(prepare([{str(corpus['files']['saved'][0])!r}], sys.argv[1])['documents'])")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "o.bin")], capture_output=True, text=True,
                            cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == len(corpus["docs"]["saved"])


# --- prepare -----------------------------------------------------------------------------


def test_prepare_equals_tokenizers_encode_batch_with_eos_after_every_document(corpus, bpe, tmp_path):
    kinds = ["jsonl", "parquet", "saved", "txt"]
    inputs = [f for k in kinds for f in corpus["files"][k]]
    docs = [d for k in kinds for d in corpus["docs"][k]]
    out = tmp_path / "data.bin"

    meta = prepare(inputs, out, load_tokenizer(str(bpe)))

    tok = Tokenizer.from_file(str(bpe))
    eos = tok.token_to_id(EOS)
    encoded = [e.ids for e in tok.encode_batch(docs, add_special_tokens=False)]
    expected = [i for ids in encoded for i in (*ids, eos)]
    raw = out.read_bytes()
    assert np.frombuffer(raw, np.uint16).tolist() == expected
    ends = np.cumsum([len(ids) + 1 for ids in encoded]) - 1
    assert (np.frombuffer(raw, np.uint16)[ends] == eos).all()
    assert meta == {
        "dtype": "uint16", "count": len(expected), "sha256": hashlib.sha256(raw).hexdigest(),
        "documents": len(docs), "vocab_size": tok.get_vocab_size(), "eos_id": eos,
        "tokenizer": load_tokenizer(str(bpe.parent)).fingerprint,
    }
    assert json.loads((tmp_path / "data.bin.json").read_text()) == meta
    data = TokenFile(out)
    assert len(data) == len(expected) and data.vocab_size == tok.get_vocab_size()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.bin", "data.bin.json"]


def test_prepare_with_bytes_concatenates_utf8_and_records_no_eos(corpus, tmp_path):
    meta = prepare(corpus["files"]["txt"], tmp_path / "b.tokens")
    expected = "".join(corpus["docs"]["txt"]).encode("utf-8")
    assert TokenFile(tmp_path / "b.tokens").tokens.tolist() == list(expected)
    assert {k: meta[k] for k in ("count", "documents", "vocab_size", "eos_id", "tokenizer")} == {
        "count": len(expected), "documents": 2, "vocab_size": 256, "eos_id": None, "tokenizer": "bytes"}


def _word_level(path: pathlib.Path, size: int) -> pathlib.Path:
    """A tokenizer of exactly `size` ids: one word each, the last one "w{size-1}"."""
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return path


@pytest.mark.parametrize("size, dtype", [(65536, "uint16"), (65537, "uint32")])
def test_prepare_dtype_follows_the_vocabulary(tmp_path, size, dtype):
    spec = _word_level(tmp_path / "tokenizer.json", size)
    (tmp_path / "t.txt").write_text(f"w1 w{size - 1} w7")
    meta = prepare([tmp_path / "t.txt"], tmp_path / "o.bin", load_tokenizer(str(spec)))
    assert meta["dtype"] == dtype and meta["eos_id"] is None  # no end-of-document token in this vocabulary
    assert TokenFile(tmp_path / "o.bin").tokens.tolist() == [1, size - 1, 7]


# --- tokenizers -------------------------------------------------------------------------


def test_tokenizer_train_is_deterministic_reaches_the_vocabulary_and_round_trips_any_text(corpus, bpe, tmp_path):
    tok = Tokenizer.from_file(str(bpe))
    assert tok.get_vocab_size() == 400
    assert train_bpe(corpus["files"]["jsonl"], 400, tmp_path).read_bytes() == bpe.read_bytes()
    assert tok.token_to_id(EOS) is not None
    text = "never seen: Ωμέγα 🚀 \x00\t zzz"  # byte-level: nothing is unknown
    loaded = load_tokenizer(str(bpe))
    assert loaded.decode(loaded.encode_batch([text])[0]) == text


def test_tokenizer_fingerprint_is_of_the_canonical_json(bpe, tmp_path):
    spec = json.loads(bpe.read_text())
    (tmp_path / "same.json").write_text(json.dumps(dict(reversed(spec.items())), indent=4))
    spec["model"]["merges"] = spec["model"]["merges"][:-1]
    (tmp_path / "other.json").write_text(json.dumps(spec))
    fingerprint = load_tokenizer(str(bpe)).fingerprint
    assert fingerprint.startswith("sha256:")
    assert load_tokenizer(str(tmp_path / "same.json")).fingerprint == fingerprint
    assert load_tokenizer(str(tmp_path / "other.json")).fingerprint != fingerprint
    assert load_tokenizer("bytes").fingerprint == "bytes"


def test_a_hugging_face_model_folder_gives_its_configured_eos(tmp_path):
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<pad>": 0, "</s>": 1, EOS: 2, "a": 3}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>").save_pretrained(tmp_path / "model")
    loaded = load_tokenizer(str(tmp_path / "model"))
    assert (loaded.vocab_size, loaded.eos_id) == (4, 1)  # tokenizer_config.json's eos_token, not the name list's
    tok.save(str(tmp_path / "alone.json"))
    assert load_tokenizer(str(tmp_path / "alone.json")).eos_id == 2


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "absent.json", r"--tokenizer='.*absent\.json' must be 'bytes', a tokenizer\.json, or a model folder"),
    (lambda d: d, r"--tokenizer='.*' is a folder without a tokenizer\.json"),
    (lambda d: (d / "bad.json").write_text("{}") and d / "bad.json", r"--tokenizer='.*bad\.json' is not a tokenizers"),
])
def test_a_tokenizer_spec_that_loads_nothing_is_named(tmp_path, make, message):
    with pytest.raises(TokenizerError, match=message):
        load_tokenizer(str(make(tmp_path)), field="--tokenizer")


# --- errors change nothing --------------------------------------------------------------


def _bad_inputs(d: pathlib.Path) -> dict:
    (d / "plain.csv").write_text("text\nhello\n")
    _write_jsonl(d / "field.jsonl", ["fine"] * 2000 + ["x"], field="text")
    with open(d / "field.jsonl", "a") as f:
        f.write(json.dumps({"body": "no text field"}) + "\n")  # after batches already written
    (d / "number.jsonl").write_text('{"text": "ok"}\n{"text": 7}\n')
    (d / "broken.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    pq.write_table(pa.table({"body": ["a"]}), d / "column.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), d / "ints.parquet")
    pq.write_table(pa.table({"text": ["a", None]}), d / "null.parquet")
    (d / "folder").mkdir()
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(str(d / "dict"))
    return {
        "plain.csv": r"plain\.csv: unknown extension '\.csv'; prepare reads \.txt .*\.jsonl .*\.parquet",
        "field.jsonl": r"field\.jsonl:2003 has no field 'text' \(it has 'body'\); choose .* --text-field",
        "number.jsonl": r"number\.jsonl:2: field 'text' is int, not a string",
        "broken.jsonl": r"broken\.jsonl:2 is not JSON",
        "column.parquet": r"column\.parquet has no column 'text' \(it has 'body'\)",
        "ints.parquet": r"ints\.parquet: column 'text' holds int64, not strings",
        "null.parquet": r"null\.parquet: row 1 has no text \(null\)",
        "folder": r"folder: a folder without state\.json, so not one written by datasets' save_to_disk",
        "dict": r"dict: a DatasetDict's folder; name one of its splits' folders \(.*dict/train\)",
        "absent.txt": r"absent\.txt: no such file or folder",
    }


def test_bad_inputs_are_named_and_leave_no_output(tmp_path):
    inputs = tmp_path / "in"
    inputs.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    write_old = lambda: prepare([_write_jsonl(tmp_path / "old.jsonl", ["old"])], out / "kept.bin")
    kept = write_old()
    for name, message in _bad_inputs(inputs).items():
        for target in ("new.bin", "kept.bin"):
            with pytest.raises(InputError, match=message):
                prepare([inputs / name], out / target)
    # No new file, no temporary left behind, and the earlier output is as it was.
    assert sorted(p.name for p in out.iterdir()) == ["kept.bin", "kept.bin.json"]
    assert json.loads((out / "kept.bin.json").read_text()) == kept


# --- the command line ---------------------------------------------------------------------


def _cli(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "interleaf.clients.cli", *map(str, args)], capture_output=True,
                          text=True, cwd=REPO, timeout=timeout)


def test_cli_train_prepare_and_inspect(corpus, tmp_path):
    jsonl, parquet = corpus["files"]["jsonl"][0], corpus["files"]["parquet"][0]
    trained = _cli("data", "tokenizer", "train", jsonl, "--vocab-size", 300, "--out", tmp_path / "tok")
    assert trained.returncode == 0, trained.stderr
    tok = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    assert tok.get_vocab_size() == 300

    prepared = _cli("data", "prepare", jsonl, parquet, "--tokenizer", tmp_path / "tok", "--out", tmp_path / "d.bin")
    assert prepared.returncode == 0, prepared.stderr
    inspected = _cli("data", "inspect", tmp_path / "d.bin", "--json")
    assert inspected.returncode == 0, inspected.stderr
    meta = json.loads(inspected.stdout.strip().splitlines()[-1])
    docs = corpus["docs"]["jsonl"] + corpus["docs"]["parquet"]
    count = sum(len(e.ids) + 1 for e in tok.encode_batch(docs, add_special_tokens=False))
    assert (meta["documents"], meta["count"], meta["vocab_size"]) == (len(docs), count, 300)
    assert f"wrote {count:,} tokens (uint16)" in prepared.stdout

    plain = _cli("data", "inspect", tmp_path / "d.bin")
    assert plain.returncode == 0 and "vocab_size  300" in plain.stdout


def test_cli_errors_are_one_line_with_status_2(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"body": "a"}\n')
    cases = [
        (("data", "prepare", tmp_path / "x.jsonl", "--out", tmp_path / "o.bin"), "x.jsonl:1 has no field 'text'"),
        (("data", "prepare", tmp_path / "x.jsonl", "--tokenizer", tmp_path / "nope", "--out", tmp_path / "o.bin"),
         "--tokenizer="),
        (("data", "tokenizer", "train", tmp_path / "x.jsonl", "--vocab-size", 100, "--out", tmp_path / "t"),
         "--vocab-size=100 must be at least 257"),
        (("data", "inspect", tmp_path / "o.bin"), "o.bin.json is unreadable"),
    ]
    for args, message in cases:
        result = _cli(*args)
        assert result.returncode == 2, result.stderr
        assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ") and message in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.jsonl"]


def test_cli_refuses_an_out_or_a_sidecar_it_cannot_use_before_any_work(tmp_path):
    """Each met as a traceback: an --out file for tokenizer train and an --out folder for
    prepare only once the work was done, a sidecar that is not prepare's object by
    inspect (and `{}` printed, exit 0, with --json). Each now one line, exit 2, and every
    file as it was."""
    corpus, small, tok = tmp_path / "corpus.jsonl", tmp_path / "small.txt", tmp_path / "tok"
    corpus.write_text('{"text": "hello world"}\n')
    small.write_text("kept")
    tok.mkdir()
    for name, text in (("empty", "{}"), ("list", "[1]"), ("old", '{"dtype": "uint16", "cout": 3, "sha256": "0"}'),
                       ("wide", '{"dtype": "int64", "count": 3, "sha256": "0"}')):
        (tmp_path / f"{name}.bin.json").write_text(text)
    before = {p: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    not_prepares = "is not one `interleaf data prepare` writes"
    cases = [
        (("data", "tokenizer", "train", corpus, "--vocab-size", 1024, "--out", small),
         f"--out {str(small)!r} is a file; it must name the folder to write tokenizer.json in"),
        (("data", "prepare", corpus, "--out", tok),
         f"--out {str(tok)!r} is a folder; it must name the token file to write (its sidecar goes beside it, as "
         f"{tok}.json)"),
        (("data", "inspect", tmp_path / "empty.bin"), f"empty.bin.json {not_prepares} (it lacks dtype, count, sha256)"),
        (("data", "inspect", tmp_path / "empty.bin", "--json"), f"empty.bin.json {not_prepares} (it lacks dtype"),
        (("data", "inspect", tmp_path / "list.bin"),
         f"list.bin.json {not_prepares} (it holds a JSON list, not an object of dtype, count and sha256)"),
        (("data", "inspect", tmp_path / "old.bin"), f"old.bin.json {not_prepares} (it lacks count)"),
        (("data", "inspect", tmp_path / "wide.bin"), "(its dtype 'int64' is not one of uint16, uint32)"),
    ]
    for args, message in cases:
        result = _cli(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ") and message in result.stderr, \
            (args, result.stderr)
        assert result.stdout == "", (args, result.stdout)
    assert {p: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before
    assert list(tok.iterdir()) == []


# --- the model's vocabulary holds the data's ----------------------------------------------


@pytest.fixture(scope="module")
def data_512(corpus) -> pathlib.Path:
    tok = train_bpe(corpus["files"]["jsonl"], 512, corpus["root"] / "tok512")
    prepare(corpus["files"]["jsonl"], corpus["root"] / "d512.bin", load_tokenizer(str(tok)))
    return corpus["root"] / "d512.bin"


def test_run_local_refuses_a_vocabulary_smaller_than_the_data_before_starting(data_512):
    result = _cli("run", "--local", 2, "--set", f"data.source={data_512}", "--set", "model.vocab_size=300")
    assert result.returncode == 2
    assert result.stderr == (f"error: model.vocab_size=300 is smaller than the vocabulary of data.source="
                             f"{str(data_512)!r} (512, from its tokenizer): its ids reach 511; set "
                             f"model.vocab_size to at least 512\n")
    assert "starting" not in result.stdout + result.stderr


def test_run_local_refuses_a_vocabulary_smaller_than_the_tokenizer(data_512):
    tok = data_512.parent / "tok512"
    result = _cli("run", "--local", 2, "--set", f"data.tokenizer={tok}", "--set", "model.vocab_size=300")
    assert result.returncode == 2
    assert f"model.vocab_size=300 is smaller than the vocabulary of data.tokenizer={str(tok)!r} (512)" in result.stderr


def test_check_vocab_reads_every_file_of_a_blend_and_leaves_unreadable_ones_to_the_servers(data_512, tmp_path):
    # First a file whose sidecar records no vocabulary or tokenizer (an older one): the
    # check goes on to the next file of the blend.
    older = tmp_path / "older.bin"
    shutil.copy(data_512, older)
    meta = json.loads(data_512.with_name(data_512.name + ".json").read_text())
    older.with_name(older.name + ".json").write_text(
        json.dumps({k: v for k, v in meta.items() if k not in ("vocab_size", "tokenizer")}))
    blend = f"{older}:0.5,{data_512}:0.5"
    check_vocab(512, blend, "bytes", tokenizer_needed=True)
    with pytest.raises(VocabError, match=r"model\.vocab_size=511 .* data\.source='.*d512\.bin' \(512"):
        check_vocab(511, blend, "bytes", tokenizer_needed=True)
    with pytest.raises(VocabError, match=r"data\.source='builtin' \(256"):
        check_vocab(255, "builtin", "bytes", tokenizer_needed=True)
    # A coordinator that cannot see a file or a tokenizer leaves them to where the job runs.
    check_vocab(16, str(tmp_path / "elsewhere.bin"), str(tmp_path / "tok.json"), tokenizer_needed=False)
    # So does one whose sidecar is not one prepare writes (a JSON list raised AttributeError):
    # the stage server that opens the file names what is wrong with it.
    listed = tmp_path / "listed.bin"
    shutil.copy(data_512, listed)
    listed.with_name(listed.name + ".json").write_text("[1]")
    check_vocab(16, str(listed), "bytes", tokenizer_needed=True)
    with pytest.raises(TokenizerError):
        check_vocab(16, str(tmp_path / "elsewhere.bin"), str(tmp_path / "tok.json"), tokenizer_needed=True)


def test_a_stage_server_refuses_by_the_sidecar_vocabulary(data_512):
    from interleaf.coordinator.config import load_config
    from interleaf.coordinator.plan import ServerSlot, plan_job, setup_requests
    from interleaf.stageserver.job import JobRejected, StageJob

    config = load_config("", ["parallel.pp=1", "parallel.vpp=1", "parallel.schedule=1f1b", "model.vocab_size=300",
                              f"data.source={data_512}"])
    plan = plan_job(config, [ServerSlot("s0", "127.0.0.1:1", "host")])
    request = setup_requests("job-1", config, plan, ("127.0.0.1", 1, "p"), 10.0)[0]
    with pytest.raises(JobRejected, match=r"model\.vocab_size=300 is smaller than .* \(512, from its tokenizer\)"):
        StageJob(request, "host")


# --- the benchmark --------------------------------------------------------------------------


def test_prepare_bench_tiny_runs():
    result = subprocess.run([sys.executable, "bench/prepare_throughput.py", "--tiny"], capture_output=True,
                            text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "tokens/s" in result.stdout and "peak RSS" in result.stdout


def test_a_tokenizer_with_gaps_in_its_ids_gets_the_vocabulary_of_its_largest_id(tmp_path):
    """Three tokens, one of them id 70000: the vocabulary is 70001 (not the 3 it counts),
    so the file is uint32 and the id is written as it is, never wrapped."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1, "b": 70000}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "gap.json"))
    (tmp_path / "doc.txt").write_text("a b a")
    meta = prepare([tmp_path / "doc.txt"], tmp_path / "o.bin", load_tokenizer(str(tmp_path / "gap.json")))
    assert (meta["dtype"], meta["vocab_size"]) == ("uint32", 70001)
    assert TokenFile(tmp_path / "o.bin").tokens.tolist() == [0, 70000, 0]


def test_token_files_of_different_tokenizers_are_not_blended_or_misread(corpus, bpe, tmp_path):
    docs = corpus["files"]["jsonl"]
    prepare(docs, tmp_path / "bpe.bin", load_tokenizer(str(bpe)))
    prepare(docs, tmp_path / "bytes.bin")
    with pytest.raises(VocabError, match="blends token files of different tokenizers"):
        check_vocab(512, f"{tmp_path / 'bpe.bin'}:1,{tmp_path / 'bytes.bin'}:1", "bytes", tokenizer_needed=True)
    other = train_bpe(docs, 300, tmp_path / "other")
    with pytest.raises(VocabError, match=r"data.tokenizer=.* did not make data.source's"):
        check_vocab(512, str(tmp_path / "bpe.bin"), str(other), tokenizer_needed=True)
    check_vocab(512, str(tmp_path / "bpe.bin"), str(bpe), tokenizer_needed=True)  # its own: accepted
