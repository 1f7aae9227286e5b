"""Bridges to other frameworks, each imported only when its framework is installed:

* `tp_jax.integrations.tunix` — Tunix's (google-tunix) RL rollouts on `LLM` (`pip install 'tp-jax[tunix]'`).
"""
