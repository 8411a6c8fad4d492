"""What a request is, below every way of sending one: the request models (validated strictly, each refusal
an InvalidInputError naming its field), the engine options built from them, and the compact encodings of
the vectors. The HTTP routes (api/) and the Python API (embedder.py) both use this package; it knows
nothing of HTTP."""
