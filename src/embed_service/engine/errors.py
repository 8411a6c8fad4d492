"""What the engine can refuse. The API maps each kind to an HTTP status in one place (api/errors.py)."""

from __future__ import annotations


class EngineError(Exception):
    """Base class: every engine refusal carries a message fit for a client."""

    param: str | None = None


class InvalidInputError(EngineError):
    def __init__(self, message: str, param: str | None = "input"):
        super().__init__(message)
        self.param = param


class OverloadedError(EngineError):
    """Admitting the inputs would pass --max-concurrent-requests."""


class DeviceMemoryError(EngineError):
    """An input that does not fit in the device's memory even alone: that request fails, the server serves on."""


class NotReadyError(EngineError):
    """Loading, draining or failed."""


class ModelNotFoundError(EngineError):
    def __init__(self, name: str, served: list[str]):
        super().__init__(f"the model {name!r} is not served here; served: {', '.join(served)}")
        self.param = "model"
