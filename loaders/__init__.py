"""Weight loaders: safetensors and GGUF readers, HF name tables (installed as tp_jax.loaders)."""
