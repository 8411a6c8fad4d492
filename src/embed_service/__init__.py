"""embed-service: an OpenAI-compatible text-embedding server."""

__version__ = "0.1.0"
