"""Serving: the engine, KV cache, sampling, outputs and the `LLM` front door.

Knows no HTTP; imports the parallel core, models and loaders, never the other way round.
"""
