"""The configuration reference lists every setting the server has."""

from pathlib import Path

from embed_service.config import Settings

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_every_setting_is_documented():
    text = (DOCS / "configuration.md").read_text()
    for name in Settings.model_fields:
        assert f"`--{name.replace('_', '-')}" in text, name
        assert f"`EMBED_{name.upper()}`" in text, name
