"""Building blocks the models are written on: each knows its tensor-parallel shard and how to load it."""
