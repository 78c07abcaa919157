"""GPT-2 (Radford et al. 2019): learned positions, pre-LayerNorm blocks, GELU MLP,
biases, tied embeddings by default."""
