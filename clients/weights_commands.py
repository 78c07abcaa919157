"""`interleaf export` and `interleaf eval`: a checkpoint's weights out (one safetensors
file, or a Hugging Face folder), and a model's loss on given token ids. The work is
clients/generate.py's, hf_export.py's and evaluate.py's; here are the command lines and
their one-line errors."""

from __future__ import annotations

import json

from interleaf.clients.usage import UsageError

FORMATS = ("safetensors", "hf")


def cmd_export(args) -> int:
    from interleaf.clients.checkpoint import CheckpointError, find
    from interleaf.clients.generate import export
    from interleaf.clients.hf_export import MAX_SHARD_BYTES, export_hf

    if args.out and args.out_option and args.out != args.out_option:
        raise UsageError(f"OUT {args.out!r} and --out {args.out_option!r} differ: give one")
    out = args.out or args.out_option
    if not out:
        raise UsageError("export needs where to write: OUT, or --out OUT")
    if args.format != "hf" and (args.tokenizer or args.max_shard_bytes is not None):
        raise UsageError("--tokenizer and --max-shard-bytes go with --format hf")
    try:
        checkpoint = find(args.checkpoint)
        if args.format == "hf":
            shard = MAX_SHARD_BYTES if args.max_shard_bytes is None else int(args.max_shard_bytes)
            done = export_hf(checkpoint, out, args.dtype, args.tokenizer, shard)
            tensors, parameters = done.tensors, done.parameters
            what = (f" as a Hugging Face folder ({done.weight_files} weight file{'s' * (done.weight_files > 1)}"
                    f"{', and the tokenizer' if done.tokenizer else ''})")
        else:
            tensors, parameters = export(checkpoint, out, args.dtype)
            what = ""
    except (CheckpointError, ValueError) as err:
        raise UsageError(str(err)) from None
    print(f"wrote {tensors} tensors ({parameters:,} parameters) of step {checkpoint.step} to {out}{what}")
    return 0


def cmd_eval(args) -> int:
    import torch

    from interleaf.clients.checkpoint import CheckpointError
    from interleaf.clients.evaluate import check_ids_fit, evaluate, load_for_eval, read_ids

    try:
        device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto"
                              else args.device)
    except RuntimeError as err:
        raise UsageError(f"--device={args.device!r}: {err}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device={args.device!r}: torch sees no GPU here")
    try:
        ids = read_ids(args.tokens)  # before the model is read: a file that cannot be scored is named at once
        model = load_for_eval(args.model)
        check_ids_fit(args.tokens, ids, model.config.vocab_size)
        loss, predictions = evaluate(model, ids, device)
    except (CheckpointError, ValueError) as err:
        raise UsageError(str(err)) from None
    if args.json:
        print(json.dumps({"loss": loss, "predictions": predictions}))
    else:
        print(f"loss {loss:.6f}: mean next-token cross-entropy over {predictions:,} predictions "
              f"({ids.shape[0]} rows of {ids.shape[1]} ids) on {device}")
    return 0


def add_weights_commands(sub) -> None:
    """`interleaf export` and `interleaf eval`, under the CLI's subparsers `sub`."""
    # intermixed: OUT may follow the options, as docs/huggingface.md shows (`export CKPT --format hf OUT`).
    p = sub.add_parser("export", help="write a checkpoint's parameters, unsharded: one safetensors file, or a "
                                      "Hugging Face model folder (--format hf)", intermixed=True)
    p.add_argument("checkpoint", metavar="CKPT", help="a manifest, a step-NNNNNN folder, or checkpoint.dir "
                                                      "(its newest complete step)")
    p.add_argument("out", nargs="?", metavar="OUT", help="the file (or, with --format hf, the folder) to write")
    p.add_argument("--out", dest="out_option", metavar="OUT", help="the same as OUT")
    p.add_argument("--format", choices=FORMATS, default="safetensors",
                   help="safetensors: one file of every parameter by Interleaf's names (the default); hf: a "
                        "folder transformers' AutoModelForCausalLM.from_pretrained loads (config.json, "
                        "generation_config.json, model.safetensors or shards and their index, the tokenizer)")
    p.add_argument("--dtype", default="", choices=("", "fp32", "bf16", "fp16", "fp64"),
                   help="cast the parameters (default: the master weights' own precision: fp32, "
                        "or fp64 for an fp64 job)")
    p.add_argument("--tokenizer", default="", metavar="PATH",
                   help="--format hf: the tokenizer.json or folder to write beside the model (default: the job's "
                        "data.tokenizer; 'bytes' writes none)")
    p.add_argument("--max-shard-bytes", type=float, default=None, metavar="BYTES",
                   help="--format hf: weights beyond this size are split into shards with an index "
                        "(default 5e9, transformers' own)")
    p.set_defaults(fn=cmd_export)

    p = sub.add_parser("eval", help="a model's mean next-token cross-entropy on token ids, computed by "
                                    "Interleaf's own model code")
    p.add_argument("model", metavar="MODEL", help="an Interleaf checkpoint (a manifest, a step folder or "
                                                  "checkpoint.dir) or a Hugging Face model folder")
    p.add_argument("--tokens", required=True, metavar="IDS.npy",
                   help="an integer array [B, T] saved by numpy: each row's ids 1..T-1 are predicted")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (the GPU if torch sees one)")
    p.add_argument("--json", action="store_true", help='print {"loss": ..., "predictions": ...} on one line')
    p.set_defaults(fn=cmd_eval)
