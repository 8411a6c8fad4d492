"""The engine: tokenize, admit, batch, run, pool. Usable without HTTP; the API is a thin client of it."""
