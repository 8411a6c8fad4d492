"""The configuration reference lists every setting the server has, and says which are per model; what the
README and the API reference tell a client holds for the examples they show."""

import re
from pathlib import Path

from embed_service.config import ModelSettings, ServerSettings, Settings

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


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


def test_langchain_needs_check_embedding_ctx_length_off_in_the_readme_and_the_api_reference():
    for text in ((ROOT / "README.md").read_text(), (DOCS / "api.md").read_text()):
        assert "check_embedding_ctx_length=False" in text


def test_the_api_references_sparse_examples_have_ascending_indices_as_it_says():
    text = (DOCS / "api.md").read_text()
    assert "[token ids, ascending]" in text
    examples = [[int(i) for i in m.split(",")] for m in re.findall(r'"indices": \[([0-9, ]+)\]', text)]
    assert examples
    for indices in examples:
        assert indices == sorted(indices), indices
    sparse = re.search(r"POST /embed_sparse\n.*?\n\n(\[\[.*?\]\])", text, re.S)
    assert sparse is not None
    listed = [int(i) for i in re.findall(r'"index": (\d+)', sparse.group(1))]
    assert listed == sorted(listed)


def test_the_api_reference_says_how_the_cohere_v2_client_asks_for_documents():
    # tests/api/test_rerank.py sends exactly this with the real client
    text = (DOCS / "api.md").read_text()
    assert 'request_options={"additional_body_parameters": {"return_documents": True}}' in text


def test_the_readme_says_what_float32_keeps_and_the_bound_the_tests_hold():
    # Was: "`float32` is exact", while tests/test_equivalence.py holds it to cosine >= 0.99999, not equality.
    readme = (ROOT / "README.md").read_text()
    assert "`float32` is exact" not in readme
    line = next(ln for ln in readme.splitlines() if ln.startswith("| `--dtype`"))
    assert "cosine >= 0.99999" in line
    assert "cos.min() >= 0.99999" in (ROOT / "tests" / "test_equivalence.py").read_text()
