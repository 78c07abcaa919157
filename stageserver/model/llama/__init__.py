"""Llama (Touvron et al. 2023): RMSNorm, SwiGLU MLP, rotary position embeddings,
grouped-query attention, no biases, untied embeddings by default."""
