"""The token-budget dynamic batcher: one owner of the queue; callers append and await."""
