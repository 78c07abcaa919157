"""The model every benchmark trains, as config overrides (`SECTION.KEY=VALUE`), by
architecture (`--arch`).

8 layers of d_model 256 (about 6.4M parameters) over 128-token samples: big enough that
matrix multiplies dominate a step (about a second per step on one core for 16 samples),
small enough that each benchmark runs in well under three minutes on 2 cores.

The Llama is the GPT's size and work: with 4 key/value heads for 8 query heads
(grouped-query attention, head size 32) and the default SwiGLU width (8/3·256 rounded up
to 768), a block's matrices hold 3·256² (q, k, v, proj) + 3·256·768 (gate, up, down) =
12·256² weights, as a GPT block's do; the untied head takes the place of the GPT's
learned positions. 6,426,880 parameters against the GPT's 6,416,896.
"""

SHAPE = ["model.n_layers=8", "model.d_model=256", "model.n_heads=8", "model.seq_len=128", "model.vocab_size=256"]

MODELS = {
    "gpt2": ["model.arch=gpt2", *SHAPE],
    "llama": ["model.arch=llama", *SHAPE, "model.n_kv_heads=4"],
}
