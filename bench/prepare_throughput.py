"""`interleaf data prepare` against `tokenizers`' own batch encoder, and prepare's memory
as its input grows.

Synthetic jsonl corpora of two sizes are written to a temporary folder (word salad with a
Zipf-like word distribution, documents of 50 to 2,000 words), a byte-level BPE is
trained on a small sample of them (`interleaf data tokenizer train`'s code), and then,
for each size:

  prepare      `interleaf data prepare FILE --tokenizer TOK --out OUT` in a child
               process: wall time (start-up included) and its peak resident set (VmHWM
               from /proc, read by the child as it ends);
  encode_batch the same file's documents, read into memory first (not timed), encoded by
               `Tokenizer.encode_batch(..., add_special_tokens=False)` in batches of
               prepare's size (1,024 documents) in this process: the tokenizer's own
               ceiling, with no reading, JSON parsing or writing.

Both use every core (tokenizers' thread pool); the token counts are checked to agree
(prepare's = encode_batch's + one end-of-document id per document). Speed is a ratio
measured in the same run; the peak resident sets at the two sizes show whether memory
stays flat as the input grows.

    python bench/prepare_throughput.py              # 256 MB and 1 GB inputs (minutes)
    python bench/prepare_throughput.py --tiny       # 1 MB and 4 MB, vocabulary 512 (seconds)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import subprocess
import sys
import tempfile
import time

from interleaf.stageserver.data.readers import BATCH_DOCUMENTS
from interleaf.stageserver.data.train_tokenizer import train_bpe

MB = 1 << 20


def write_corpus(path: pathlib.Path, size_bytes: int, seed: int) -> None:
    """Lines drawn from a pool of distinct documents until the file reaches its size."""
    r = random.Random(seed)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    words = ["".join(r.choice(letters) for _ in range(r.randint(1, 12))) for _ in range(30_000)]
    weights = [1 / (rank + 1) for rank in range(len(words))]  # Zipf's law, as text has
    pool = []
    for _ in range(2_000):
        doc = " ".join(r.choices(words, weights, k=r.randint(50, 2_000)))
        pool.append((json.dumps({"text": doc, "id": len(pool)}) + "\n").encode())
    written = 0
    with open(path, "wb") as f:
        while written < size_bytes:
            line = r.choice(pool)
            f.write(line)
            written += len(line)


PREPARE = """
import sys
from interleaf.clients.cli import main
status = main(sys.argv[2:])
with open("/proc/self/status") as f:  # VmHWM: this program's own peak, since its exec
    peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
open(sys.argv[1], "w").write(str(peak * 1024))
sys.exit(status)
"""


def run_prepare(corpus: pathlib.Path, tokenizer: pathlib.Path, out: pathlib.Path) -> dict:
    """Runs prepare in a child; its wall time, peak RSS and sidecar. The child reads its
    own high-water mark: a forked child's rusage ru_maxrss starts from its parent's
    resident set at the fork (this process holds a whole corpus by then)."""
    peak = out.with_name("peak")
    command = [sys.executable, "-c", PREPARE, str(peak), "data", "prepare", str(corpus),
               "--tokenizer", str(tokenizer), "--out", str(out)]
    start = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"prepare of {corpus} failed (exit {done.returncode})")
    meta = json.loads(out.with_name(out.name + ".json").read_text())
    return {"seconds": seconds, "peak_rss_bytes": int(peak.read_text()), "tokens": meta["count"],
            "documents": meta["documents"]}


def run_encode_batch(corpus: pathlib.Path, tokenizer: pathlib.Path) -> dict:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    with open(corpus, "rb") as f:
        docs = [json.loads(line)["text"] for line in f]
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(docs), BATCH_DOCUMENTS):
        tokens += sum(len(e.ids) for e in tok.encode_batch(docs[i:i + BATCH_DOCUMENTS], add_special_tokens=False))
    return {"seconds": time.perf_counter() - start, "tokens": tokens, "documents": len(docs)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", type=int, nargs=2, default=[256, 1024], metavar=("SMALL", "LARGE"))
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--tiny", action="store_true", help="1 and 4 MB, vocabulary 512: a check that it runs")
    parser.add_argument("--out", help="also write the figures here as JSON")
    args = parser.parse_args()
    sizes, vocab = ([1, 4], 512) if args.tiny else (args.sizes_mb, args.vocab_size)

    rows = []
    with tempfile.TemporaryDirectory(prefix="prepare-bench-") as tmp:
        tmp = pathlib.Path(tmp)
        write_corpus(tmp / "sample.jsonl", min(sizes[0], 16) * MB, seed=0)
        tokenizer = train_bpe([tmp / "sample.jsonl"], vocab, tmp / "tok")
        for size in sizes:
            corpus = tmp / f"corpus-{size}mb.jsonl"
            write_corpus(corpus, size * MB, seed=size)
            prepared = run_prepare(corpus, tokenizer, tmp / "out.bin")
            encoded = run_encode_batch(corpus, tokenizer)
            if prepared["tokens"] != encoded["tokens"] + encoded["documents"]:
                raise SystemExit(f"{size} MB: prepare wrote {prepared['tokens']} tokens, encode_batch gives "
                                 f"{encoded['tokens']} + {encoded['documents']} end-of-document ids")
            rows.append({"input_bytes": corpus.stat().st_size, "documents": prepared["documents"],
                         "tokens": prepared["tokens"], "vocab_size": vocab,
                         "prepare_seconds": prepared["seconds"], "prepare_peak_rss_bytes": prepared["peak_rss_bytes"],
                         "prepare_tokens_per_s": prepared["tokens"] / prepared["seconds"],
                         "encode_batch_tokens_per_s": encoded["tokens"] / encoded["seconds"]})
            corpus.unlink()

    print(f"{'input':>9} {'documents':>10} {'tokens':>12} {'prepare tokens/s':>17} "
          f"{'encode_batch tokens/s':>22} {'ratio':>6} {'prepare peak RSS':>17}")
    for r in rows:
        print(f"{r['input_bytes'] / MB:>6.0f} MB {r['documents']:>10,} {r['tokens']:>12,} "
              f"{r['prepare_tokens_per_s']:>17,.0f} {r['encode_batch_tokens_per_s']:>22,.0f} "
              f"{r['prepare_tokens_per_s'] / r['encode_batch_tokens_per_s']:>6.2f} "
              f"{r['prepare_peak_rss_bytes'] / MB:>13.0f} MiB")
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(json.dumps({"cpus": os.cpu_count(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
