from __future__ import annotations

import pytest


@pytest.fixture
def bf16_path(request, monkeypatch):
    """The environment of one of test_attention.BF16_PATHS (indirect parametrization), set for the test."""
    for name, value in request.param.items():
        monkeypatch.setenv(name, value)
    return request.param
