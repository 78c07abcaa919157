"""Hugging Face weights in and out (DESIGN.md, "Interop"), against `transformers` itself:
tiny GPT2LMHeadModel and LlamaForCausalLM (grouped-query attention, untied embeddings; one
with Llama 3's rope scaling) made with random weights by transformers and saved by
save_pretrained, no download.

`interleaf eval` of such a folder equals transformers' loss on the same ids (fp32, 1e-5
relative); Hugging Face -> Interleaf -> Hugging Face reproduces every tensor exactly,
sharded or not; checkpoint.init refuses what contradicts its source; and one job on the
shared cluster trains from a Llama folder under dp2·tp2·pp2·vpp2 ZeRO-3, step for step
equal to the reference trainer started from the same folder, and exports a folder that
transformers loads with the loss `interleaf eval` gives the checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers

from interleaf.clients.evaluate import evaluate, load_for_eval, read_ids
from interleaf.clients.generate import generate_ids
from interleaf.clients.hf_export import write_hf_folder
from interleaf.clients.reference import train
from interleaf.common.data.text_tokenizer import load_tokenizer
from interleaf.common.model.config import shape_of
from interleaf.common.model.hf_folder import HFFolder, HFFolderError
from interleaf.common.security import TOKEN_ENV
from interleaf.coordinator.config import ConfigError, load_config
from interleaf.stageserver import safetensors
from interleaf.stageserver.data import prepare
from interleaf.stageserver.init_weights import initial_values
from interleaf.stageserver.model import full_model
from interleaf.stageserver.model.hf_weights import folder_values
from interleaf.stageserver.model.llama.rope import inverse_frequencies
from tests.conftest import run_job
from tests.test_equivalence import LOSS_RTOL

VOCAB = 300
RTOL = 1e-5
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


def _hf_loss(folder, ids: np.ndarray) -> float:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).float().eval()
    tokens = torch.from_numpy(ids.astype(np.int64))
    with torch.no_grad():
        return model(tokens, labels=tokens).loss.item()


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """{"llama": folder, "llama3": folder, "gpt2": folder, "ids": [4, 33] ids}: transformers' own models."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, rms_norm_eps=1e-5,
        rope_theta=500000.0))  # not the default: a theta that is not read would show
    # Llama 3.1's scaling of a model first trained on 64 positions: with theta 500000 and
    # head_dim 16 its 8 rotary pairs fall in all three of the scaling's bands (kept,
    # blended, slowed 8 times). Larger weights than transformers' 0.02 make attention
    # sharp enough that the frequencies move the loss.
    llama3 = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, rms_norm_eps=1e-5,
        rope_theta=500000.0, initializer_range=0.2, rope_scaling=LLAMA3_SCALING))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=4, n_head=4,
                                                                n_positions=64))
    for model, name in ((llama, "llama"), (llama3, "llama3"), (gpt2, "gpt2")):
        # transformers initialises biases to zero and norm scales to one: noise on every
        # parameter, so a bias, norm or split mapped wrongly changes the loss.
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn_like(param) * 0.02)
        model.save_pretrained(root / name)
    ids = torch.randint(0, VOCAB, (4, 33)).numpy()
    np.save(root / "ids.npy", ids)
    return {"llama": root / "llama", "llama3": root / "llama3", "gpt2": root / "gpt2", "ids": ids,
            "ids_path": root / "ids.npy"}


@pytest.mark.parametrize("arch", ["llama", "llama3", "gpt2"])
def test_greedy_generation_with_the_cache_equals_transformers(made, arch):
    """Interleaf's key/value cache and transformers' generate choose the same tokens."""
    prompt = [int(i) for i in made["ids"][0, :5]]
    mine = generate_ids(load_for_eval(str(made[arch])), prompt, 40)
    model = transformers.AutoModelForCausalLM.from_pretrained(made[arch]).float().eval()
    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt]), max_new_tokens=40, min_new_tokens=40, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert mine == theirs


@pytest.mark.parametrize("arch", ["llama", "llama3", "gpt2"])
def test_eval_of_a_hugging_face_folder_equals_transformers(made, arch):
    mine, predictions = evaluate(load_for_eval(str(made[arch])), made["ids"])
    theirs = _hf_loss(made[arch], made["ids"])
    assert predictions == 4 * 32
    assert abs(mine - theirs) <= RTOL * theirs, (mine, theirs)


def test_eval_on_the_command_line_prints_the_loss_as_json(made):
    run = subprocess.run([sys.executable, "-m", "interleaf.clients.cli", "eval", str(made["llama"]), "--tokens",
                          str(made["ids_path"]), "--json"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])
    theirs = _hf_loss(made["llama"], made["ids"])
    assert abs(got["loss"] - theirs) <= RTOL * theirs and got["predictions"] == 128


@pytest.mark.parametrize("ids, message", [
    (np.zeros(5, dtype=np.int64), r"has shape \[5\]: it must be \[B, T\]"),
    (np.zeros((2, 1), dtype=np.int64), r"has shape \[2, 1\]"),
    (np.zeros((2, 4), dtype=np.float32), "holds float32 values: token ids must be integers"),
    (np.full((2, 4), VOCAB), rf"holds id {VOCAB}, outside the model's vocabulary \[0, {VOCAB}\)"),
    (np.full((2, 4), -1), "holds id -1, outside"),
])
def test_eval_refuses_ids_it_cannot_score_naming_why(made, tmp_path, ids, message):
    np.save(tmp_path / "ids.npy", ids)
    with pytest.raises(ValueError, match=message):
        read_ids(str(tmp_path / "ids.npy"), VOCAB)


def test_eval_refuses_an_npz_archive_before_reading_the_model(tmp_path, capsys):
    """np.load opens an .npz as an archive of arrays, which crashed on its missing dtype;
    now named, by --tokens, and before the model (here none) is read."""
    from interleaf.clients.cli import main

    np.savez(tmp_path / "ids.npz", ids=np.zeros((2, 4), dtype=np.int64))
    message = (f"--tokens {tmp_path / 'ids.npz'} is an .npz archive (of ids): it must be one .npy array, as "
               f"numpy.save writes")
    with pytest.raises(ValueError) as caught:
        read_ids(str(tmp_path / "ids.npz"), VOCAB)
    assert str(caught.value) == message
    assert main(["eval", str(tmp_path / "no-model"), "--tokens", str(tmp_path / "ids.npz")]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


def test_eval_of_a_gpt2_refuses_rows_longer_than_its_positions(made):
    with pytest.raises(ValueError, match="rows of 66 ids need 65 positions; this gpt2 model has 64"):
        evaluate(load_for_eval(str(made["gpt2"])), np.zeros((1, 66), dtype=np.int64))


def test_a_gpt2_job_may_train_on_fewer_positions_than_its_source(made):
    """seq_len 16 of n_positions 64: the first 16 positions, and the same loss on 17 ids."""
    config = load_config("", [f"checkpoint.init={made['gpt2']}", "model.seq_len=16", "model.pad_vocab_to=64"])
    shape = shape_of(config.model)
    model = full_model(shape, 0, initial_values(config.checkpoint.init, shape)).eval()
    ids = made["ids"][:, :17]
    mine, _ = evaluate(model, ids)
    assert abs(mine - _hf_loss(made["gpt2"], ids)) <= RTOL * mine


@pytest.mark.parametrize("arch", ["llama", "llama3", "gpt2"])
@pytest.mark.parametrize("sharded", [False, True])
def test_hugging_face_to_interleaf_and_back_reproduces_every_tensor(made, tmp_path, arch, sharded):
    """Every tensor of save_pretrained's file comes back bit for bit (GPT-2's Conv1D
    transposes and q|k|v regrouping undone), and the config its model (Llama 3's rope
    scaling included); above the shard size the weights are split with an index, which
    transformers loads to the same loss."""
    folder = HFFolder(made[arch])
    shape = folder.shape()
    values = folder_values(folder, shape)
    specs = full_model(shape, 0, values).param_specs()
    params = {name: values(name, spec) for name, spec in specs.items()}
    total = sum(t.numel() * t.element_size() for t in params.values())
    out = tmp_path / "out"
    done = write_hf_folder(params, shape, out, max_shard_bytes=total // 3 if sharded else total)
    original, _ = safetensors.read(made[arch] / "model.safetensors")
    if not sharded:
        assert done.weight_files == 1 and not (out / "model.safetensors.index.json").exists()
        exported, _ = safetensors.read(out / "model.safetensors")
    else:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert done.weight_files == len(set(index["weight_map"].values())) >= 3
        assert not (out / "model.safetensors").exists()
        exported = {}
        for file in sorted(set(index["weight_map"].values())):
            exported.update(safetensors.read(out / file)[0])
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[name], original[name]) for name in original)
    assert HFFolder(out).fields == folder.fields
    assert _hf_loss(out, made["ids"]) == _hf_loss(made[arch], made["ids"])


def test_checkpoint_init_takes_the_model_and_refuses_what_contradicts_it(made, tmp_path):
    config = load_config("", [f"checkpoint.init={made['llama']}", "model.seq_len=32", "model.n_kv_heads=2"])
    m = config.model
    assert (m.arch, m.n_layers, m.d_model, m.n_heads, m.n_kv_heads, m.ffn_hidden, m.vocab_size, m.tie_embeddings,
            m.rope_theta, m.seq_len, m.pad_vocab_to) == ("llama", 4, 64, 4, 2, 160, VOCAB, False, 500000.0, 32, 128)
    assert config.checkpoint.init == str(made["llama"])
    refusals = {
        "model.n_kv_heads=4": "model.n_kv_heads=4 contradicts checkpoint.init",
        "model.arch=gpt2": "whose model has arch='llama'",
        "model.tie_embeddings=true": "model.tie_embeddings=True contradicts",
        "model.rope_scaling_factor=8": "model.rope_scaling_factor=8.0 contradicts",
        "model.seq_len=65": "model.seq_len=65 must be at most 64",
        "checkpoint.resume=/x": "exclude each other",
    }
    for setting, message in refusals.items():
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            load_config("", [f"checkpoint.init={made['llama']}", "model.seq_len=32", setting])
    with pytest.raises(ConfigError, match="there is nothing at that path"):
        load_config("", [f"checkpoint.init={tmp_path / 'none'}"])


def test_a_remote_submission_leaves_checkpoint_init_to_the_coordinator(cluster, tmp_path):
    """The path is the cluster's: a client that does not see it submits anyway, and the
    coordinator, which reads it, answers (here: nothing there either, INVALID_ARGUMENT)."""
    missing = tmp_path / "not-here"
    run = subprocess.run([sys.executable, "-m", "interleaf.clients.cli", "submit", "--set",
                          f"checkpoint.init={missing}", "--coordinator", cluster.address],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, TOKEN_ENV: cluster.security.token})
    assert run.returncode == 2
    assert run.stderr.startswith("error: INVALID_ARGUMENT: ") and "there is nothing at that path" in run.stderr


@pytest.mark.parametrize("arch, key, value", [
    ("llama", "rope_scaling", {"rope_type": "linear", "factor": 2.0}),
    ("llama", "hidden_act", "gelu"),
    ("llama", "attention_bias", True),
    ("gpt2", "activation_function", "relu"),
    ("gpt2", "scale_attn_by_inverse_layer_idx", True),
])
def test_a_model_interleaf_cannot_compute_is_refused_by_its_config_key(made, tmp_path, arch, key, value):
    folder = _rewritten(made[arch], tmp_path, {key: value})
    with pytest.raises(ConfigError, match=f"config.json {key}="):
        load_config("", [f"checkpoint.init={folder}", "model.seq_len=32"])


def _rewritten(folder, tmp_path, changes: dict):
    """A copy of `folder` whose config.json has `changes` (a None value removes the key)."""
    copy = tmp_path / "rewritten"
    shutil.copytree(folder, copy)
    config = {**json.loads((copy / "config.json").read_text()), **changes}
    (copy / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return copy


def test_llama3_rope_scaling_turns_each_pair_as_transformers_does(made):
    """The rotary frequencies equal transformers' bit for bit: of the 8 pairs one is kept,
    one blended and six slowed 8 times. The same weights scored without the scaling give
    another loss (by 1.5%), so the eval and generation tests of this model fail when the
    scaling is not applied."""
    folder = HFFolder(made["llama3"])
    shape = folder.shape()
    mine = inverse_frequencies(shape, torch.float32, torch.device("cpu"))
    config = transformers.AutoConfig.from_pretrained(made["llama3"])
    assert torch.equal(mine, transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config=config).inv_freq)
    unscaled = dataclasses.replace(shape, rope_scaling_factor=0.0)
    plain = inverse_frequencies(unscaled, torch.float32, torch.device("cpu"))
    kept, slowed, blended = mine == plain, mine == plain / 8, (plain / 8 < mine) & (mine < plain)
    assert (int(kept.sum()), int(blended.sum()), int(slowed.sum())) == (1, 1, 6)
    scaled_loss, _ = evaluate(load_for_eval(str(made["llama3"])), made["ids"])
    unscaled_loss, _ = evaluate(full_model(unscaled, 0, folder_values(folder, unscaled)).eval(), made["ids"])
    assert abs(scaled_loss - unscaled_loss) > 1e-3 * scaled_loss, (scaled_loss, unscaled_loss)


_LLAMA3_FIELDS = (8.0, 1.0, 4.0, 64)
_UNSCALED_FIELDS = (0.0, 1.0, 4.0, 8192)


@pytest.mark.parametrize("rope, fields", [
    ({"rope_scaling": LLAMA3_SCALING}, _LLAMA3_FIELDS),  # transformers 4 (4.43+), beside rope_theta
    ({"rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 64}}, _LLAMA3_FIELDS),  # 4's older key
    ({"rope_scaling": {"rope_type": "default"}}, _UNSCALED_FIELDS),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}, _UNSCALED_FIELDS),  # transformers 5
])
def test_rope_settings_are_read_in_the_forms_of_transformers_4_and_5(made, tmp_path, rope, fields):
    folder = _rewritten(made["llama3"], tmp_path, {"rope_parameters": None, "rope_theta": 500000.0, **rope})
    m = load_config("", [f"checkpoint.init={folder}", "model.seq_len=32"]).model
    assert m.rope_theta == 500000.0
    assert (m.rope_scaling_factor, m.rope_low_freq_factor, m.rope_high_freq_factor,
            m.rope_original_positions) == fields


@pytest.mark.parametrize("key, value, message", [
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "only, not 'yarn'"),
    ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}, "only, not 'yarn'"),
    ("rope_scaling", {**LLAMA3_SCALING, "factor": 0.5}, "needs factor >= 1"),
    ("rope_scaling", {**LLAMA3_SCALING, "low_freq_factor": None}, "low_freq_factor=None must be a number"),
])
def test_a_rope_scaling_interleaf_cannot_compute_is_refused_naming_it(made, tmp_path, key, value, message):
    """By checkpoint.init and by `interleaf eval` alike."""
    folder = _rewritten(made["llama"], tmp_path, {key: value})
    with pytest.raises(ConfigError, match=f"config.json {key}.*{message}"):
        load_config("", [f"checkpoint.init={folder}", "model.seq_len=32"])
    with pytest.raises(HFFolderError, match=message):
        load_for_eval(str(folder))


def test_an_export_names_the_tokenizer_by_where_it_came_from(tmp_path):
    """A tokenizer that loads nothing is named as --tokenizer when the flag gave it, as the
    job's tokenizer when the checkpoint's manifest did; either before any weight is read
    (the checkpoint here has only a manifest) and with nothing written."""
    from types import SimpleNamespace

    from interleaf.clients.hf_export import export_hf

    checkpoint = SimpleNamespace(manifest={"tokenizer": "/nonexistent/job.json"})
    with pytest.raises(ValueError, match=r"^the job's tokenizer='/nonexistent/job.json' must be 'bytes'.*"
                                         r"\(name another with --tokenizer PATH"):
        export_hf(checkpoint, tmp_path / "out")
    with pytest.raises(ValueError, match=r"^--tokenizer='/nonexistent/flag.json' must be 'bytes'"):
        export_hf(checkpoint, tmp_path / "out", tokenizer="/nonexistent/flag.json")
    assert list(tmp_path.iterdir()) == []


def _tokenizer_json(path) -> None:
    """A byte-level BPE of fewer than 300 ids with an end-of-document token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=290, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50, trainer)
    tok.save(str(path))


JOB = ["model.seq_len=32", "train.global_batch=8", "train.steps=3", "train.warmup_steps=1", "train.lr=0.001",
       "parallel.microbatches=4"]
LAYOUT = ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.vpp=2", "parallel.zero=3",
          "parallel.schedule=interleaved-1f1b"]
REFERENCE_LAYOUT = ["parallel.pp=1", "parallel.vpp=1", "parallel.schedule=1f1b"]


def _held_to_reference(steps, settings: list[str]) -> list[float]:
    history, _ = train(load_config("", settings + REFERENCE_LAYOUT))
    assert [s.step for s in steps] == [h.step for h in history]
    for got, want in zip(steps, history):
        assert abs(got.loss - want.loss) <= LOSS_RTOL * abs(want.loss), (got.step, got.loss, want.loss)
    return [h.loss for h in history]


def test_a_job_trains_from_a_hugging_face_llama_and_exports_one(client, made, tmp_path):
    """dp2·tp2·pp2·vpp2 ZeRO-3 from the folder, every step equal to the reference trainer
    started from it; the export, tokenizer included, loads in transformers with the loss
    `interleaf eval` gives the checkpoint, a loss training moved. A second job starts
    from that checkpoint under tp2·pp2, equal to the reference started from it too."""
    _tokenizer_json(tmp_path / "tokenizer.json")
    # Data that tokenizer made: a job refuses a data.tokenizer its token files do not record.
    (tmp_path / "doc.txt").write_text("the quick brown fox jumps over the lazy dog. " * 400)
    prepare([tmp_path / "doc.txt"], tmp_path / "data.bin", load_tokenizer(str(tmp_path / "tokenizer.json")))
    ck = tmp_path / "ck"
    settings = JOB + [f"checkpoint.init={made['llama']}", f"data.tokenizer={tmp_path / 'tokenizer.json'}",
                      f"data.source={tmp_path / 'data.bin'}"]
    final, steps = run_job(client, settings + LAYOUT + [f"checkpoint.dir={ck}"])
    assert final.state == "SUCCEEDED", final.error
    _held_to_reference(steps, settings)

    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "interleaf.clients.cli", "export", str(ck), "--format", "hf",
                          "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    theirs = _hf_loss(out, made["ids"])
    mine, _ = evaluate(load_for_eval(str(ck)), made["ids"])
    assert abs(theirs - mine) <= RTOL * mine, (theirs, mine)
    assert abs(theirs - _hf_loss(made["llama"], made["ids"])) > 1e-4  # it trained
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    from tokenizers import Tokenizer

    text = "the lazy fox"
    assert tokenizer(text)["input_ids"] == Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode(text).ids
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == \
        tokenizer.convert_tokens_to_ids("<|endoftext|>")

    again = JOB + [f"checkpoint.init={ck}"]
    final, again_steps = run_job(client, again + ["parallel.tp=2", "parallel.pp=2", "parallel.vpp=1",
                                                  "parallel.schedule=1f1b"])
    assert final.state == "SUCCEEDED", final.error
    _held_to_reference(again_steps, again)
    # The same seed draws the same first batch, which the trained weights predict better.
    assert again_steps[0].loss < steps[0].loss
