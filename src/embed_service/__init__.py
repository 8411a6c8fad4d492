"""embed-service: an OpenAI-compatible text-embedding server, and its engine as a Python API.

from embed_service import Embedder

with Embedder() as embedder:  # the packaged all-MiniLM-L6-v2, the server's defaults
    vectors = embedder.encode(["a text", "another"])  # (2, 384) float32
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Embedder", "__version__"]

if TYPE_CHECKING:
    from embed_service.embedder import Embedder


def __getattr__(name: str) -> Any:
    # Imported on first use: `embed_service.__version__` (the CLI, the workers) stays free of torch and
    # the engine's imports.
    if name == "Embedder":
        from embed_service.embedder import Embedder

        return Embedder
    raise AttributeError(f"module 'embed_service' has no attribute {name!r}")
