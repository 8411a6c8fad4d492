"""The one place that decides, once per worker, whether the layers run the Triton kernels or their references.

``configure(device)`` is called by the worker before it builds its model: on CUDA with ``triton``
importable the layers call embed_service.kernels; elsewhere (a CPU, or no triton) they run their plain
PyTorch references (layers/norm.py, layers/rotary.py, layers/activation.py, ops/pooling.py). ``choice()``
is what /info reports. ``reference_only()`` switches the kernels off for a block: the start-up fidelity
check runs its float32 reference pass through it.

``EMBED_KERNELS``: ``auto`` (the default, as above), ``off`` (references everywhere), ``interpret``
(the kernels under Triton's interpreter on a CPU: slow, for tests; needs TRITON_INTERPRET=1 set before
triton is first imported).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from types import ModuleType

log = logging.getLogger(__name__)

_kernels: ModuleType | None = None  # embed_service.kernels, when chosen
_reason = "not configured: references"
_suspended = 0


def _import_kernels() -> tuple[ModuleType | None, str]:
    try:
        import embed_service.kernels as kernels
    except Exception as exc:  # ImportError (no triton), or a triton that does not match this torch
        return None, f"triton unavailable ({type(exc).__name__}: {exc})"
    return kernels, "ok"


def decide(device_type: str, mode: str, triton_ok: bool) -> bool:
    """Whether the kernels run: `mode` is EMBED_KERNELS (auto, off, interpret)."""
    if mode == "off" or not triton_ok:
        return False
    if mode == "interpret":
        return True
    return device_type == "cuda"


def configure(device_type: str) -> str:
    """Choose kernels or references for this process; returns the choice as /info reports it."""
    global _kernels, _reason
    mode = os.environ.get("EMBED_KERNELS", "auto").strip().lower() or "auto"
    if mode not in ("auto", "off", "interpret"):
        raise ValueError(f"EMBED_KERNELS={mode!r}: expected auto, off or interpret")
    if mode == "interpret" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("EMBED_KERNELS=interpret needs TRITON_INTERPRET=1 in the environment")
    kernels, why = (
        (None, "not needed")
        if mode == "off" or (mode == "auto" and device_type != "cuda")
        else (_import_kernels())
    )
    if decide(device_type, mode, kernels is not None):
        _kernels, _reason = kernels, "triton" + (" (interpreter)" if mode == "interpret" else "")
    else:
        _kernels = None
        _reason = "torch" if why in ("ok", "not needed") else f"torch: {why}"
    return _reason


def choice() -> str:
    """'triton', 'triton (interpreter)' or 'torch' (with the reason when triton was wanted but absent)."""
    return _reason


def kernels() -> ModuleType | None:
    """The kernels module when the layers should call it, else None (run the reference)."""
    return _kernels if not _suspended else None


def suspended() -> bool:
    """Whether a reference_only() block is running (int8 layers, layers/quantize.py, run unquantized then)."""
    return _suspended > 0


@contextlib.contextmanager
def reference_only() -> Iterator[None]:
    """Run the references inside this block, whatever was chosen."""
    global _suspended
    _suspended += 1
    try:
        yield
    finally:
        _suspended -= 1
