"""The model: loading, its structure, fingerprint, RoPE and KV tensors."""
