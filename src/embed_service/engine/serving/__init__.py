"""The engine's serving, one module per request kind over one shared base (base.py): embed.py (tokenize,
embed, embed_tokenized), windowed.py (long inputs as windows, late chunking), score.py (rerank,
classify). engine/engine.py's `Engine` is all of them, with the life cycle and /info."""
