"""`interleaf export` and `interleaf generate` on checkpoints of real jobs: the exported
file is the reference model, a damaged checkpoint is refused by file name, and
generation is the model's own next-token prediction, greedy or sampled."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from interleaf.clients.checkpoint import CheckpointError, find, load_parameters
from interleaf.clients.generate import check_tokenizer, generate, generate_ids, load_model
from interleaf.common.data.text_tokenizer import load_tokenizer
from interleaf.common.model.config import ModelShape, shape_of
from interleaf.coordinator.config import load_config
from interleaf.stageserver import safetensors
from interleaf.stageserver.data import Sampler, resolve_source
from interleaf.stageserver.model.chunk import full_model, next_token_logits
from tests.conftest import TINY, layout_free, reference, run_job

LAYOUT = ["parallel.pp=2", "parallel.vpp=2", "parallel.tp=2", "parallel.dp=2", "parallel.zero=3"]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "interleaf.clients.cli", *args], capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def saved(client, tmp_path_factory):
    """A dp2·tp2·pp2·vpp2 ZeRO-3 job's checkpoint (8 ranks' files)."""
    root = tmp_path_factory.mktemp("checkpoint")
    final, _ = run_job(client, TINY + LAYOUT + [f"checkpoint.dir={root}"])
    assert final.state == "SUCCEEDED", final.error
    return root


def _loss(params: dict[str, torch.Tensor]) -> float:
    config = load_config("", TINY)
    m = config.model
    model = full_model(shape_of(m), seed=0)
    model.load_state_dict(params, strict=True)
    inputs, targets = Sampler(resolve_source("builtin"), 7, m.seq_len, 8).microbatch(0, 0)
    with torch.no_grad():
        return float(model(inputs, targets))


def test_the_exported_file_is_the_reference_model(saved, tmp_path):
    out = tmp_path / "model.safetensors"
    result = _cli("export", str(saved), str(out))
    assert result.returncode == 0, result.stderr
    _, expected = reference(layout_free(TINY))
    count = sum(t.numel() for t in expected.values())
    assert result.stdout == f"wrote {len(expected)} tensors ({count:,} parameters) of step 3 to {out}\n"
    tensors, meta = safetensors.read(out)
    assert sorted(tensors) == sorted(expected)
    assert meta["step"] == "3"
    # The reference trainer's model with the exported weights gives the reference's loss.
    assert _loss(tensors) == pytest.approx(_loss(expected), rel=1e-5)


def test_a_bf16_job_exports_its_fp32_master_weights_and_casts_on_request(client, tmp_path):
    """A bf16 job trains bf16 working weights cast from fp32 master weights: the export
    holds the masters, of which the working weights are exactly the cast; --dtype bf16
    writes the cast."""
    root = tmp_path / "ck"
    final, _ = run_job(client, TINY + ["parallel.dp=2", "parallel.zero=1", "train.precision=bf16",
                                       f"checkpoint.dir={root}"])
    assert final.state == "SUCCEEDED", final.error
    assert _cli("export", str(root), str(tmp_path / "fp32.safetensors")).returncode == 0
    assert _cli("export", str(root), str(tmp_path / "bf16.safetensors"), "--dtype", "bf16").returncode == 0
    masters, meta = safetensors.read(tmp_path / "fp32.safetensors")
    cast, _ = safetensors.read(tmp_path / "bf16.safetensors")
    assert meta["trained_precision"] == "bf16"
    assert {t.dtype for t in masters.values()} == {torch.float32}
    assert {t.dtype for t in cast.values()} == {torch.bfloat16}
    assert all(torch.equal(masters[n].to(torch.bfloat16), cast[n]) for n in masters)
    # The masters carry what bf16 rounds away.
    assert any(not torch.equal(masters[n], cast[n].float()) for n in masters)


def test_the_newest_complete_step_is_taken_and_a_damaged_file_is_named(saved, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    (root / "step-999999").mkdir()  # a save that never finished: no manifest
    assert find(root).step == 3
    shard = root / "step-000003" / "state-00005.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    result = _cli("export", str(root), str(tmp_path / "out.safetensors"))
    assert result.returncode == 2
    assert result.stderr == f"error: checkpoint file {shard} is corrupt: its SHA-256 differs from the manifest's\n"
    shard.write_bytes(bytes(data[:100]))
    with pytest.raises(CheckpointError, match=r"state-00005.safetensors is truncated: 100 bytes"):
        load_parameters(find(root))
    shard.unlink()
    with pytest.raises(CheckpointError, match=r"state-00005.safetensors is missing"):
        load_parameters(find(root))
    assert not (tmp_path / "out.safetensors").exists()


def test_next_token_logits_are_the_models_own_prediction():
    config = ModelShape(n_layers=2, d_model=32, n_heads=4, seq_len=16, vocab_size=256)
    model = full_model(config, seed=3)
    tokens = torch.randint(0, 256, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # On a one-token context the model's loss is the cross-entropy of those logits.
        logits = next_token_logits(model, tokens[:, :1])
        assert float(F.cross_entropy(logits, tokens[:, 1])) == pytest.approx(
            float(model(tokens[:, :1], tokens[:, 1:2])), rel=1e-6)
        # On a longer context, the logits of its last position: the same as the loss of
        # that position, which the model's mean over all positions includes.
        k = 6
        last = F.cross_entropy(next_token_logits(model, tokens[:, :k]), tokens[:, k], reduction="sum")
        mean_k = float(model(tokens[:, :k], tokens[:, 1:k + 1]))
        mean_k_1 = float(model(tokens[:, :k - 1], tokens[:, 1:k]))
        # sum over k positions minus sum over the first k-1 = the last position's loss.
        assert float(last) == pytest.approx(mean_k * 3 * k - mean_k_1 * 3 * (k - 1), rel=1e-4)


def test_generation_is_greedy_at_temperature_zero_and_seeded_when_sampling(saved):
    model = load_model(find(saved))
    greedy = generate(model, "def ", 12)
    assert generate(model, "def ", 12) == greedy
    assert generate(model, "def ", 12, temperature=1.0, top_k=1, seed=5) == greedy  # top-1 is argmax
    ids = generate_ids(model, [100, 101, 102, 32], 12)
    assert ids[0] == int(next_token_logits(model, torch.tensor([[100, 101, 102, 32]])).argmax())
    assert ids[1] == int(next_token_logits(model, torch.tensor([[100, 101, 102, 32, ids[0]]])).argmax())
    sampled = [generate(model, "def ", 12, temperature=1.5, seed=s) for s in (1, 1, 2)]
    assert sampled[0] == sampled[1]
    assert sampled[0] != sampled[2]


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_cached_generation_equals_rerunning_the_window(arch):
    """Past seq_len the window slides: every token is still the argmax of the model run
    afresh over the last seq_len tokens, as generation without a cache computes it."""
    config = ModelShape(2, 32, 4, 8, 64, arch=arch, n_kv_heads=2 if arch == "llama" else 0)
    model = full_model(config, seed=3).eval()
    prompt = [5, 9, 11]
    got = generate_ids(model, prompt, 20)
    seen = list(prompt)
    with torch.no_grad():
        for token in got:
            assert token == int(next_token_logits(model, torch.tensor([seen[-config.seq_len:]])).argmax())
            seen.append(token)


@pytest.mark.parametrize("args,message", [
    (["generate", "/nonexistent/ckpt", "--prompt", "x"], "checkpoint '/nonexistent/ckpt' does not exist"),
    (["generate", "CKPT", "--prompt", "x", "--temperature", "-1"], "--temperature=-1.0 must be 0 (greedy) or more"),
    (["generate", "CKPT", "--prompt", "x", "--tokens", "0"], "--tokens=0 must be at least 1"),
    (["generate", "CKPT", "--prompt", "x", "--top-k", "-2"], "--top-k=-2 must be 0 (no limit) or more"),
    (["generate", "CKPT", "--prompt", ""], "--prompt must not be empty: generation continues a text"),
])
def test_bad_generate_arguments_are_named(saved, args, message):
    result = _cli(*[str(saved) if a == "CKPT" else a for a in args])
    assert result.returncode == 2
    assert result.stderr == f"error: {message}\n"


def test_a_tokenizer_that_cannot_stand_for_the_models_ids_is_refused_naming_both_sizes(tmp_path):
    """bytes on a model of 300 ids failed once the model emitted an id from 256 up, which
    no byte decodes to; a tokenizer.json with ids beyond the model's is refused too. A
    tokenizer.json smaller than its (padded) model, and bytes on a smaller one, pass."""
    from tokenizers import Tokenizer, models

    model = full_model(ModelShape(n_layers=1, d_model=32, n_heads=4, seq_len=16, vocab_size=300), seed=0).eval()
    with pytest.raises(ValueError) as caught:
        generate(model, "x", 5)
    assert str(caught.value) == ("the tokenizer has 256 ids and the model 300: the model may emit ids from 256 up, "
                                 "which no byte decodes to; name the job's tokenizer with --tokenizer PATH (a "
                                 "tokenizer.json or a model folder)")
    words = tmp_path / "tokenizer.json"
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(290)}, unk_token="w0")).save(str(words))
    with pytest.raises(ValueError, match=r"^--tokenizer='.*' has 290 ids and the model 256: its ids from 256 up are "
                                         r"beyond the model's vocabulary; name the job's tokenizer with --tokenizer"):
        check_tokenizer(load_tokenizer(str(words)), 256, f"--tokenizer={str(words)!r}")
    check_tokenizer(load_tokenizer(str(words)), 300)
    check_tokenizer(load_tokenizer("bytes"), 256)
    check_tokenizer(load_tokenizer("bytes"), 100)


def test_export_takes_out_before_or_after_the_options():
    """docs/huggingface.md's `export CKPT --format hf OUT` was refused as an unrecognized
    OUT: argparse had matched the optional OUT, empty, beside CKPT."""
    from interleaf.clients.cli import _parser

    for argv in (["export", "ck", "--format", "hf", "hf2"], ["export", "ck", "hf2", "--format", "hf"],
                 ["export", "--format", "hf", "ck", "hf2"]):
        args = _parser().parse_args(argv)
        assert (args.checkpoint, args.out, args.out_option, args.format) == ("ck", "hf2", None, "hf"), argv
    args = _parser().parse_args(["export", "ck", "--format", "hf", "--out", "hf2"])
    assert (args.checkpoint, args.out, args.out_option) == ("ck", None, "hf2")
    with pytest.raises(SystemExit):  # a third path is still one too many
        _parser().parse_args(["export", "ck", "--format", "hf", "hf2", "hf3"])
