from tests.models.conftest import tokenizer_sources  # noqa: F401  (the real tokenizers the tiny models use)
