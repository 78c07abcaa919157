"""The model every benchmark trains, as config overrides (`SECTION.KEY=VALUE`).

8 layers of d_model 256 (about 6.4M parameters) over 128-token samples: big enough that
matrix multiplies dominate a step (about a second per step on one core for 16 samples),
small enough that each benchmark runs in well under three minutes on 2 cores.
"""

MODEL = ["model.n_layers=8", "model.d_model=256", "model.n_heads=8", "model.seq_len=128", "model.vocab_size=256"]
