"""Where the kernels run: decided once per worker from the device and whether triton imports."""

from __future__ import annotations

import pytest

from embed_service.ops import fused


@pytest.mark.parametrize(
    ("device", "mode", "triton_ok", "want"),
    [
        ("cuda", "auto", True, True),
        ("cuda", "auto", False, False),  # no triton: the references
        ("cpu", "auto", True, False),  # a CPU compiles no Triton kernel
        ("cuda", "off", True, False),
        ("cpu", "interpret", True, True),
        ("cpu", "interpret", False, False),
    ],
)
def test_decide(device, mode, triton_ok, want):
    assert fused.decide(device, mode, triton_ok) is want


def test_configure_on_a_cpu_chooses_the_references(monkeypatch):
    monkeypatch.delenv("EMBED_KERNELS", raising=False)
    monkeypatch.setattr(fused, "_kernels", None)
    assert fused.configure("cpu") == "torch"
    assert fused.kernels() is None and fused.choice() == "torch"


def test_a_bad_mode_is_refused(monkeypatch):
    monkeypatch.setenv("EMBED_KERNELS", "fast")
    with pytest.raises(ValueError, match="EMBED_KERNELS"):
        fused.configure("cuda")


def test_reference_only_switches_the_kernels_off(monkeypatch):
    marker = object()
    monkeypatch.setattr(fused, "_kernels", marker)
    assert fused.kernels() is marker
    with fused.reference_only():
        assert fused.kernels() is None
    assert fused.kernels() is marker
