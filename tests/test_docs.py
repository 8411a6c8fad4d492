"""The configuration reference lists every setting the server has, and says which are per model."""

import re
from pathlib import Path

from embed_service.config import ModelSettings, ServerSettings, Settings

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_every_setting_is_documented():
    text = (DOCS / "configuration.md").read_text()
    for name in Settings.model_fields:
        assert f"`--{name.replace('_', '-')}" in text, name
        assert f"`EMBED_{name.upper()}`" in text, name


def flags_listed(text: str, kind: str) -> set[str]:
    """The flags of the '- **<kind> settings**' list item of the several-models section."""
    item = re.search(rf"^- \*\*{kind} settings\*\*(.*?)(?=^- |^$)", text, re.M | re.S)
    assert item, kind
    return set(re.findall(r"`--([a-z-]+)`", item.group(1)))


def test_the_server_and_model_settings_lists_match_the_two_classes():
    text = (DOCS / "configuration.md").read_text()
    section = text[text.index("## Several models in one server") :]
    assert flags_listed(section, "Server") == {n.replace("_", "-") for n in ServerSettings.model_fields}
    assert flags_listed(section, "Model") == {n.replace("_", "-") for n in ModelSettings.model_fields}
