"""Model definitions built only from tp_jax layers (installed as tp_jax.models)."""
