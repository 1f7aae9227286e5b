"""Weight loaders: safetensors, GGUF and Orbax readers, HF name tables (installed as tp_jax.loaders)."""
