"""Config loading and validation, with no processes: every rule a user can break is
refused with one line naming the field, the value and the rule."""

from __future__ import annotations

import pytest

from interleaf.coordinator.config import ConfigError, JobConfig, load_config

# (overrides, the exact message). Shared with the CLI and gRPC tests.
BAD_CONFIGS = [
    (["eval.every=-1"], "eval.every=-1 must be 0 (no evaluation) or more"),
    (["eval.fraction=0"], "eval.fraction=0.0 must be between 0 and 1 (exclusive): the share of data.source's "
                          "documents held out"),
    (["eval.every=10", "eval.samples=6"], "eval.samples=6 must be a multiple of train.global_batch/"
     "parallel.microbatches=4: evaluation runs microbatches of the training microbatch's rows"),
    (["eval.every=10", "eval.samples=4"], "eval.samples=4 must be a multiple of train.global_batch/"
     "parallel.microbatches*parallel.pp=8 for interleaved-1f1b: its 1 evaluation microbatch sweeps the chunks "
     "in groups of parallel.pp=2"),
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
     "parallel.schedule='zigzag' must be one of gpipe, 1f1b, interleaved-1f1b, zb-h1, zbv"),
    (["parallel.schedule=gpipe"],
     "parallel.vpp=2 needs parallel.schedule='interleaved-1f1b' or 'zbv' (gpipe runs one chunk per rank)"),
    (["parallel.schedule=zbv", "parallel.vpp=3", "model.n_layers=12"],
     "parallel.vpp=3 must be 2 for parallel.schedule='zbv': its V places two chunks on each rank"),
    (["parallel.sequence_parallel=true"],
     "parallel.sequence_parallel=true needs parallel.tp>=2, not parallel.tp=1: it splits the sequence over the "
     "tensor-parallel ranks"),
    (["parallel.tp=2", "parallel.sequence_parallel=true", "model.seq_len=15"],
     "model.seq_len=15 must be divisible by parallel.tp=2 with parallel.sequence_parallel=true: each tensor rank "
     "holds an equal slice of the sequence"),
    (["parallel.sequence_parallel=yes"], "parallel.sequence_parallel='yes' must be true or false"),
    (["parallel.zero=4"], "parallel.zero=4 must be 0, 1, 2 or 3"),
    (["parallel.zero=-1"], "parallel.zero=-1 must be 0, 1, 2 or 3"),
    (["parallel.zero_prefetch=5"], "parallel.zero_prefetch=5 must be between 0 and 4"),
    (["parallel.zero_prefetch=-1"], "parallel.zero_prefetch=-1 must be between 0 and 4"),
    (["train.precision=fp16"], "train.precision='fp16' must be one of fp32, bf16, fp64, fp8"),
    (["train.recompute=partial"], "train.recompute='partial' must be one of none, selective, full"),
    (["train.recompute_layers=2"], "train.recompute_layers=2 needs train.recompute='selective' (it picks the "
     "blocks selective recompute reruns in full), not 'none'"),
    (["train.recompute=selective", "train.recompute_layers=-1"], "train.recompute_layers=-1 must be 0 (off) or more"),
    (["train.recompute=selective", "train.recompute_layers=2000"], "train.recompute_layers=2000 must be at most 1024"),
    (["train.recompute=selective", "train.recompute_layers=5", "model.n_layers=4"],
     "train.recompute_layers=5 must not exceed model.n_layers=4: every K-th block is rerun whole, and no block would be"),
    (["train.betas=0.9"], "train.betas=[0.9] must be a pair of numbers, e.g. [0.9, 0.95]"),
    (["train.betas=0.9,0.95,0.99"], "train.betas=[0.9, 0.95, 0.99] must be a pair of numbers, e.g. [0.9, 0.95]"),
    (["train.betas=fast"], "train.betas='fast' must be a pair of numbers, e.g. [0.9, 0.95]"),
    (["train.betas=[0.9, true]"], "train.betas=[0.9, True] must be a pair of numbers, e.g. [0.9, 0.95]"),
    (["train.betas=0.9,1"], "train.betas=[0.9, 1.0] must each be at least 0 and less than 1"),
    (["train.betas=-0.1,0.9"], "train.betas=[-0.1, 0.9] must each be at least 0 and less than 1"),
    (["train.betas=nan,0.9"], "train.betas=[nan, 0.9] must each be at least 0 and less than 1"),
    (["train.eps=0"], "train.eps=0.0 must be greater than 0"),
    (["train.eps=-1e-8"], "train.eps=-1e-08 must be greater than 0"),
    (["train.eps=2"], "train.eps=2.0 must be at most 1.0"),
    (["train.eps=inf"], "train.eps=inf must be a finite number"),
    (["train.lr_decay=step"], "train.lr_decay='step' must be one of cosine, linear, wsd, constant"),
    (["train.min_lr_ratio=1.5"], "train.min_lr_ratio=1.5 must be between 0 and 1 (a fraction of train.lr)"),
    (["train.min_lr_ratio=-0.1"], "train.min_lr_ratio=-0.1 must be between 0 and 1 (a fraction of train.lr)"),
    (["train.lr_decay=constant", "train.min_lr_ratio=0"],
     "train.min_lr_ratio=0.0 must be left out for train.lr_decay='constant': the rate never decays to a floor"),
    (["train.lr_decay=wsd", "train.decay_fraction=0"],
     "train.decay_fraction=0.0 must be more than 0 and at most 1 (a fraction of train.steps)"),
    (["train.lr_decay=wsd", "train.decay_fraction=1.5"],
     "train.decay_fraction=1.5 must be more than 0 and at most 1 (a fraction of train.steps)"),
    (["train.decay_fraction=0.5"], "train.decay_fraction=0.5 must be left out unless train.lr_decay='wsd' (it "
     "sizes wsd's decay phase), not 'cosine'"),
    (["model.n_layers=0"], "model.n_layers=0 must be at least 1"),
    (["train.steps=-1"], "train.steps=-1 must be at least 1"),
    (["train.lr=0"], "train.lr=0.0 must be greater than 0"),
    (["train.grad_clip=-1"], "train.grad_clip=-1.0 must not be negative"),
    (["train.lr=fast"], "train.lr='fast' must be float"),
    (["model.d_model=1.5"], "model.d_model=1.5 must be int"),
    (["model.n_layer=4"], "unknown key model.n_layer (known: arch, n_layers, d_model, n_heads, n_kv_heads, ffn_hidden, seq_len, "
     "vocab_size, pad_vocab_to, norm_eps, rope_theta, rope_scaling_factor, rope_low_freq_factor, "
     "rope_high_freq_factor, rope_original_positions, tie_embeddings)"),
    (["optim.lr=1"], "--set 'optim.lr=1': unknown section [optim] (known: model, parallel, train, data, checkpoint, recovery, trace, eval, metrics)"),
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


def test_optimizer_and_schedule_settings_from_toml_and_the_command_line():
    toml = ('[train]\nbetas = [0.8, 0.99]\neps = 1e-6\nlr_decay = "wsd"\nmin_lr_ratio = 0\n'
            'decay_fraction = 0.25\n')
    t = load_config(toml).train
    assert (t.betas, t.eps, t.lr_decay, t.min_lr_ratio, t.decay_fraction) == ((0.8, 0.99), 1e-6, "wsd", 0.0, 0.25)
    # Either list form on the command line; whole numbers become floats.
    assert load_config("", ["train.betas=0,0.5"]).train.betas == (0.0, 0.5)
    assert load_config("", ["train.betas=[0.85, 0.9]"]).train.betas == (0.85, 0.9)
    # The defaults are today's AdamW and cosine-to-a-tenth, and AdamW's own.
    from interleaf.stageserver.optim import BETAS, EPS

    t = JobConfig().train
    assert (t.betas, t.eps, t.lr_decay, t.min_lr_ratio) == (BETAS, EPS, "cosine", 0.1)


def test_a_typed_config_round_trips_through_its_toml():
    """The Python client submits a JobConfig as TOML (clients/api.py): the float pair and
    every new field survive the trip."""
    from interleaf.clients.api import config_text
    from interleaf.coordinator.config import TrainConfig

    config = JobConfig(train=TrainConfig(betas=[0.5, 0.75], lr_decay="wsd", decay_fraction=0.5,
                                         recompute="selective", recompute_layers=2))
    assert config.train.betas == (0.5, 0.75)  # a list given is kept as the pair
    assert load_config(config_text(config)) == config
