"""Config loading and validation, with no processes: every rule a user can break is
refused with one line naming the field, the value and the rule."""

from __future__ import annotations

import pytest

from interleaf.coordinator.config import ConfigError, JobConfig, load_config

# (overrides, the exact message). Shared with the CLI and gRPC tests.
BAD_CONFIGS = [
    (["parallel.transport=infiniband"], "parallel.transport='infiniband' must be one of auto, gloo, nccl"),
    (["parallel.pp=4", "parallel.microbatches=6", "model.n_layers=8"],
     "parallel.microbatches=6 must be a multiple of parallel.pp=4 for interleaved-1f1b"),
    (["parallel.pp=4", "parallel.vpp=2", "model.n_layers=6"],
     "parallel.pp*parallel.vpp=8 must not exceed model.n_layers=6: every chunk needs at least one layer"),
    (["model.n_heads=3"], "model.d_model=128 must be divisible by model.n_heads=3"),
    (["parallel.tp=8"], "model.n_heads=4 must be divisible by parallel.tp=8"),
    (["parallel.tp=2", "model.arch=llama", "model.n_kv_heads=1"],
     "model.n_kv_heads=1 must be divisible by parallel.tp=2: key/value heads are split across tensor ranks"),
    (["model.arch=llama", "model.n_kv_heads=3"],
     "model.n_kv_heads=3 must divide model.n_heads=4: each key/value head serves a group of query heads"),
    (["model.n_kv_heads=2"],
     "model.n_kv_heads=2 must equal model.n_heads=4 for model.arch='gpt2' (grouped-query attention is llama's)"),
    (["model.arch=mamba"], "model.arch='mamba' must be one of gpt2, llama"),
    (["parallel.tp=2", "model.ffn_hidden=129"], "model.ffn_hidden=129 must be divisible by parallel.tp=2"),
    (["model.pad_vocab_to=0"], "model.pad_vocab_to=0 must be at least 1"),
    (["model.rope_scaling_factor=8", "model.rope_original_positions=16"],
     "model.rope_scaling_factor=8.0, model.rope_original_positions=16 must be left out for model.arch='gpt2': "
     "they scale llama's rotary embedding, and gpt2 learns its positions"),
    (["model.arch=llama", "model.rope_low_freq_factor=2"],
     "model.rope_low_freq_factor=2.0 must be left out while model.rope_scaling_factor=0 (no scaling): they tune "
     "the scaling"),
    (["model.arch=llama", "model.rope_scaling_factor=0.5"],
     "model.rope_scaling_factor=0.5 must be 0 (no scaling) or at least 1 (Llama 3 slows long wavelengths down, "
     "never speeds them up)"),
    (["model.arch=llama", "model.rope_scaling_factor=8", "model.rope_high_freq_factor=1"],
     "model.rope_high_freq_factor=1.0 must be greater than model.rope_low_freq_factor=1.0: wavelengths between "
     "their bounds are blended"),
    (["parallel.dp=3"], "train.global_batch=16 must be divisible by parallel.dp*parallel.microbatches=12"),
    (["parallel.schedule=zigzag"],
     "parallel.schedule='zigzag' must be one of gpipe, 1f1b, interleaved-1f1b"),
    (["parallel.schedule=gpipe"],
     "parallel.vpp=2 needs parallel.schedule='interleaved-1f1b' (gpipe runs one chunk per rank)"),
    (["parallel.zero=4"], "parallel.zero=4 must be 0, 1, 2 or 3"),
    (["parallel.zero=-1"], "parallel.zero=-1 must be 0, 1, 2 or 3"),
    (["parallel.zero_prefetch=5"], "parallel.zero_prefetch=5 must be between 0 and 4"),
    (["parallel.zero_prefetch=-1"], "parallel.zero_prefetch=-1 must be between 0 and 4"),
    (["train.precision=fp16"], "train.precision='fp16' must be one of fp32, bf16, fp64"),
    (["train.recompute=selective"], "train.recompute='selective' must be one of none, full"),
    (["model.n_layers=0"], "model.n_layers=0 must be at least 1"),
    (["train.steps=-1"], "train.steps=-1 must be at least 1"),
    (["train.lr=0"], "train.lr=0.0 must be greater than 0"),
    (["train.grad_clip=-1"], "train.grad_clip=-1.0 must not be negative"),
    (["train.lr=fast"], "train.lr='fast' must be float"),
    (["model.d_model=1.5"], "model.d_model=1.5 must be int"),
    (["model.n_layer=4"], "unknown key model.n_layer (known: arch, n_layers, d_model, n_heads, n_kv_heads, ffn_hidden, seq_len, "
     "vocab_size, pad_vocab_to, norm_eps, rope_theta, rope_scaling_factor, rope_low_freq_factor, "
     "rope_high_freq_factor, rope_original_positions, tie_embeddings)"),
    (["optim.lr=1"], "--set 'optim.lr=1': unknown section [optim] (known: model, parallel, train, data, checkpoint, recovery, trace)"),
    (["train.lr"], "--set 'train.lr' must look like SECTION.KEY=VALUE"),
    (["data.source= "], "data.source='' must be 'builtin' or a token file path"),
]


@pytest.mark.parametrize("overrides,message", BAD_CONFIGS, ids=[m.split()[0] for _, m in BAD_CONFIGS])
def test_each_rule_names_field_value_and_rule(overrides, message):
    with pytest.raises(ConfigError) as caught:
        load_config("", overrides)
    assert str(caught.value) == message


def test_defaults_are_a_valid_interleaved_job():
    config = load_config()
    assert config == JobConfig()
    assert config.parallel.schedule == "interleaved-1f1b"
    assert config.parallel.world_size == 2


def test_toml_then_overrides_in_order():
    toml = '[model]\nn_layers = 6\n[parallel]\npp = 3\nvpp = 1\nmicrobatches = 3\n[train]\nglobal_batch = 12\n'
    config = load_config(toml, ["parallel.vpp=2", "model.n_layers=7"])
    assert (config.model.n_layers, config.parallel.pp, config.parallel.vpp) == (7, 3, 2)
    assert config.train.global_batch == 12


def test_toml_errors_are_config_errors():
    with pytest.raises(ConfigError, match="config is not valid TOML"):
        load_config("[model\nn_layers = 2")
    with pytest.raises(ConfigError, match=r"unknown section \[optimizer\]"):
        load_config("[optimizer]\nlr = 1.0\n")
    with pytest.raises(ConfigError, match=r"model.n_layers=True must be int, not a boolean"):
        load_config("[model]\nn_layers = true\n")
    with pytest.raises(ConfigError, match=r"model=3 must be a table \[model\]"):
        load_config("model = 3\n")
