"""Many hosts: jax.distributed start-up, process 0's request broadcast, the launcher, simulated devices.

Imports nothing else of tp_jax: serving and scripts use it, it uses none of them.
"""
