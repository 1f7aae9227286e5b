"""The parallel core: mesh, collectives, head plan, parallel layers, shard_map wrapper, pipeline.

Knows no model, no checkpoint format and no serving: everything above builds on it.
"""
