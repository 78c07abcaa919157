"""`interleaf data ...`: prepare token files, train a tokenizer, inspect a token file.
The work is stageserver/data's; here are the command lines and their one-line errors."""

from __future__ import annotations

import json
import pathlib
import sys

from interleaf.clients.usage import UsageError


def cmd_prepare(args) -> int:
    from interleaf.common.data.text_tokenizer import TokenizerError, load_tokenizer
    from interleaf.stageserver.data.preparation import prepare
    from interleaf.stageserver.data.readers import InputError

    # Checked before any document is read: the file would only be put in place once all are tokenized.
    if pathlib.Path(args.out).is_dir():
        raise UsageError(f"--out {args.out!r} is a folder; it must name the token file to write (its sidecar "
                         f"goes beside it, as {args.out.rstrip('/')}.json)")
    try:
        tokenizer = load_tokenizer(args.tokenizer, field="--tokenizer")
        meta = prepare(args.inputs, args.out, tokenizer, args.text_field, progress=sys.stderr.isatty())
    except (InputError, TokenizerError, ValueError) as err:  # ValueError: an id its file's dtype cannot hold
        raise UsageError(str(err)) from None
    if tokenizer.eos_id is None and meta["documents"] > 1:
        print(f"note: --tokenizer={args.tokenizer!r} has no end-of-document token, so the {meta['documents']:,} "
              f"documents are joined with nothing between them", file=sys.stderr)
    print(f"wrote {meta['count']:,} tokens ({meta['dtype']}) to {args.out}: {meta['documents']:,} documents, "
          f"vocabulary {meta['vocab_size']}")
    return 0


def cmd_tokenizer_train(args) -> int:
    from interleaf.stageserver.data.train_tokenizer import train_bpe

    # Checked before training, which may take long, rather than when tokenizer.json is written.
    if pathlib.Path(args.out).exists() and not pathlib.Path(args.out).is_dir():
        raise UsageError(f"--out {args.out!r} is a file; it must name the folder to write tokenizer.json in")
    try:
        path = train_bpe(args.inputs, args.vocab_size, args.out, args.text_field, progress=sys.stderr.isatty())
    except ValueError as err:  # InputError; a vocabulary too small for the bytes
        raise UsageError(str(err)) from None
    from tokenizers import Tokenizer

    print(f"wrote {path}: byte-level BPE, vocabulary {Tokenizer.from_file(str(path)).get_vocab_size()}")
    return 0


def cmd_inspect(args) -> int:
    from interleaf.common.data.token_sidecar import read_sidecar

    sidecar = pathlib.Path(args.path + ".json")
    try:
        meta = read_sidecar(sidecar)
    except OSError as err:
        raise UsageError(f"{args.path}: its sidecar {sidecar} is unreadable ({err}); token files are written "
                         f"by `interleaf data prepare`") from None
    except ValueError as err:  # not JSON, or not the object prepare writes
        raise UsageError(f"{args.path}: its sidecar {sidecar} is not one `interleaf data prepare` writes "
                         f"({err})") from None
    if args.json:
        print(json.dumps(meta))
    else:
        width = max(map(len, meta))
        for key, value in meta.items():
            print(f"{key:<{width}}  {value}")
    return 0


def add_data_commands(sub) -> None:
    """`interleaf data` and its subcommands, under the CLI's subparsers `sub`."""
    data = sub.add_parser("data", help="token files and tokenizers").add_subparsers(dest="data_command",
                                                                                     required=True)
    text_field = dict(default="text", help="the field of a .jsonl line, or the column of a .parquet file or "
                                           "saved dataset, that holds the text (default: text)")
    inputs = dict(nargs="+", metavar="INPUT", help=".txt (one document per file), .jsonl (one per line), "
                                                   ".parquet, or a folder written by datasets' save_to_disk")

    p = data.add_parser("prepare", help="tokenize documents into one token file (and its sidecar, PATH.json)")
    p.add_argument("inputs", **inputs)
    p.add_argument("--out", required=True, metavar="PATH")
    p.add_argument("--tokenizer", default="bytes", help="'bytes' (the default), a tokenizer.json, or a Hugging "
                                                        "Face model folder holding one")
    p.add_argument("--text-field", **text_field)
    p.set_defaults(fn=cmd_prepare)

    p = data.add_parser("inspect", help="print a token file's sidecar")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--json", action="store_true", help="as one JSON object")
    p.set_defaults(fn=cmd_inspect)

    tokenizer = data.add_parser("tokenizer", help="tokenizers").add_subparsers(dest="tokenizer_command",
                                                                               required=True)
    p = tokenizer.add_parser("train", help="train a byte-level BPE on documents; writes DIR/tokenizer.json")
    p.add_argument("inputs", **inputs)
    p.add_argument("--vocab-size", type=int, required=True, metavar="N",
                   help="the vocabulary, counting the 256 bytes and the end-of-document token")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--text-field", **text_field)
    p.set_defaults(fn=cmd_tokenizer_train)
