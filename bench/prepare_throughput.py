"""`interleaf data prepare` against `tokenizers`' own batch encoder, and prepare's memory
as its input grows.

Synthetic jsonl corpora of two sizes are written to a temporary folder (word salad with a
Zipf-like word distribution, documents of 50 to 2,000 words), a byte-level BPE is
trained on a small sample of them (`interleaf data tokenizer train`'s code), and then,
for each size:

  prepare      `interleaf data prepare FILE --tokenizer TOK --out OUT` in a child
               process: wall time (start-up included) and its peak resident set (VmHWM
               from /proc, read by the child as it ends);
  encode_batch the same file's documents, read into memory first (not timed) and cut
               into the batches prepare encodes (at most 1,024 documents or 1 MB of
               text), encoded by `Tokenizer.encode_batch(..., add_special_tokens=False)`
               in this process: the tokenizer's own ceiling for those batches, with no
               reading, JSON parsing or writing.

Both use every core (tokenizers' thread pool); the token counts are checked to agree
(prepare's = encode_batch's + one end-of-document id per document), and both rates are
of prepare's count. Speed is a ratio measured in the same run, by wall time and by CPU
time (user + system, all threads): on a machine shared with other work the CPU figure
is the steadier. The peak resident sets at the two sizes show whether memory stays flat
as the input grows.

    python bench/prepare_throughput.py              # 256 MB and 1 GB inputs (minutes)
    python bench/prepare_throughput.py --tiny       # 1 MB and 4 MB, vocabulary 512 (seconds)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import random
import resource
import subprocess
import sys
import tempfile
import time

from interleaf.stageserver.data.readers import documents, open_inputs
from interleaf.stageserver.data.train_tokenizer import train_bpe

MB = 1 << 20


def write_corpus(path: pathlib.Path, size_bytes: int, seed: int) -> None:
    """Lines drawn from a pool of distinct documents until the file reaches its size."""
    r = random.Random(seed)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    words = ["".join(r.choice(letters) for _ in range(r.randint(1, 12))) for _ in range(30_000)]
    zipf = list(itertools.accumulate(1 / (rank + 1) for rank in range(len(words))))  # as text has
    pool = []
    for _ in range(min(2_000, size_bytes // 7_000 + 1)):  # a document is about 7 kB: up to 14 MB distinct
        doc = " ".join(r.choices(words, cum_weights=zipf, k=r.randint(50, 2_000)))
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
    """Runs prepare in a child: its wall and CPU seconds (os.wait4's rusage of that child),
    peak RSS and sidecar. The child reads its own high-water mark: a forked child's
    ru_maxrss starts from its parent's resident set at the fork (this process holds a
    whole corpus by then)."""
    peak = out.with_name("peak")
    command = [sys.executable, "-c", PREPARE, str(peak), "data", "prepare", str(corpus),
               "--tokenizer", str(tokenizer), "--out", str(out)]
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise SystemExit(f"prepare of {corpus} failed (exit {child.returncode})")
    meta = json.loads(out.with_name(out.name + ".json").read_text())
    return {"seconds": seconds, "cpu_seconds": usage.ru_utime + usage.ru_stime,
            "peak_rss_bytes": int(peak.read_text()), "tokens": meta["count"], "documents": meta["documents"]}


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process: tokenizers' too
    return usage.ru_utime + usage.ru_stime


def run_encode_batch(corpus: pathlib.Path, tokenizer: pathlib.Path) -> dict:
    """encode_batch over the very batches prepare encodes, read into memory first."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    batches = [texts for texts, _, _ in documents(open_inputs([corpus], "text"), "text")]
    start, cpu, tokens = time.perf_counter(), _cpu_seconds(), 0
    for texts in batches:
        tokens += sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
    return {"seconds": time.perf_counter() - start, "cpu_seconds": _cpu_seconds() - cpu, "tokens": tokens,
            "documents": sum(map(len, batches))}


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
            tokens = prepared["tokens"]  # rates of both sides over the ids prepare writes
            if tokens != encoded["tokens"] + encoded["documents"]:
                raise SystemExit(f"{size} MB: prepare wrote {tokens} tokens, encode_batch gives "
                                 f"{encoded['tokens']} + {encoded['documents']} end-of-document ids")
            rows.append({"input_bytes": corpus.stat().st_size, "documents": prepared["documents"],
                         "tokens": tokens, "vocab_size": vocab, "prepare": prepared, "encode_batch": encoded})
            corpus.unlink()

    print(f"{'input':>9} {'documents':>10} {'tokens':>12} {'prepare tokens/s':>17} {'encode_batch':>13} "
          f"{'ratio':>6} {'per CPU-s: prepare':>19} {'encode_batch':>13} {'ratio':>6} {'prepare peak RSS':>17}")
    for r in rows:
        a, b = r["prepare"], r["encode_batch"]
        wall = [r["tokens"] / a["seconds"], r["tokens"] / b["seconds"]]
        cpu = [r["tokens"] / a["cpu_seconds"], r["tokens"] / b["cpu_seconds"]]
        print(f"{r['input_bytes'] / MB:>6.0f} MB {r['documents']:>10,} {r['tokens']:>12,} {wall[0]:>17,.0f} "
              f"{wall[1]:>13,.0f} {wall[0] / wall[1]:>6.2f} {cpu[0]:>19,.0f} {cpu[1]:>13,.0f} "
              f"{cpu[0] / cpu[1]:>6.2f} {a['peak_rss_bytes'] / MB:>13.0f} MiB")
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(json.dumps({"cpus": os.cpu_count(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
