"""The model: loading, its structure, RoPE and KV tensors."""
