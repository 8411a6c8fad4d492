"""`serve` refuses what it cannot serve before it serves anything: one line on stderr naming the port, file
or key, a non-zero exit within seconds, no traceback. Bad model folders are the packaged model with one
file broken (the others linked, not copied)."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.server import refusal


def broken_copy(source: Path, target: Path, damage: Callable[[Path], None]) -> Path:
    """`source` as a folder of links, its JSON files copied (so that `damage` can edit them), then damaged."""
    target.mkdir()
    for item in source.iterdir():
        if item.suffix == ".json":
            (target / item.name).write_bytes(item.read_bytes())
        else:
            (target / item.name).symlink_to(item)
    damage(target)
    return target


def edit_json(file: Path, **changes: object) -> None:
    data = json.loads(file.read_text())
    data.update(changes)
    file.write_text(json.dumps(data))


def replace(file: Path, content: bytes) -> None:
    file.unlink()
    file.write_bytes(content)


def no_tokenizer(p: Path) -> None:
    (p / "tokenizer.json").unlink()


def small_embedding_table(p: Path) -> None:
    edit_json(p / "config.json", vocab_size=30000)  # the tokenizer has 30,522 ids


def roberta_without_pad(p: Path) -> None:
    edit_json(p / "config.json", architectures=["RobertaModel"], pad_token_id=None)


def dense_without_out_features(p: Path) -> None:
    modules = json.loads((p / "modules.json").read_text())
    modules.insert(
        2, {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
    )
    (p / "modules.json").write_text(json.dumps(modules))
    (p / "2_Dense").mkdir()
    (p / "2_Dense" / "config.json").write_text(json.dumps({"in_features": 384, "bias": True}))


def no_weights(p: Path) -> None:
    (p / "model.safetensors").unlink()


def truncated_weights(p: Path) -> None:
    replace(p / "model.safetensors", (p / "model.safetensors").read_bytes()[: 1 << 20])


def garbage_weights(p: Path) -> None:
    replace(p / "model.safetensors", b"<html>404 Not Found</html>")


def config_not_json(p: Path) -> None:
    (p / "config.json").write_text('{"architectures": ["BertModel"],')


def config_without_layers(p: Path) -> None:
    config = json.loads((p / "config.json").read_text())
    del config["num_hidden_layers"]
    (p / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "damage, expected",
    [
        (no_tokenizer, "no tokenizer.json"),
        (small_embedding_table, "the tokenizer has 30522 tokens but the embedding table only 30000 rows"),
        (roberta_without_pad, "pad_token_id is null"),
        (dense_without_out_features, "2_Dense/config.json: out_features is missing"),
        (no_weights, "no *.safetensors or pytorch_model*.bin weights"),
        (truncated_weights, "model.safetensors: corrupt or truncated weights"),
        (garbage_weights, "model.safetensors: corrupt or truncated weights"),
        (config_not_json, "config.json: not valid JSON"),
        (config_without_layers, "config.json: num_hidden_layers is missing"),
    ],
    ids=lambda v: v.__name__ if callable(v) else "",
)
def test_a_model_folder_that_cannot_be_served_is_one_line_before_serving(
    default_model_path, tmp_path, damage, expected
):
    folder = broken_copy(default_model_path, tmp_path / "model", damage)
    line = refusal("--model", str(folder), "--port", "0", timeout=60)
    assert line.startswith(f"embed-service: cannot serve {folder}: ") and expected in line


def test_weights_a_worker_cannot_load_are_one_line(default_model_path, tmp_path):
    from safetensors.numpy import load_file, save_file

    def drop_a_tensor(p: Path) -> None:
        tensors = load_file(str(default_model_path / "model.safetensors"))
        del tensors["encoder.layer.0.attention.self.query.weight"]
        (p / "model.safetensors").unlink()
        save_file(tensors, str(p / "model.safetensors"))

    folder = broken_copy(default_model_path, tmp_path / "model", drop_a_tensor)
    line = refusal("--model", str(folder), "--port", "0", "--data-parallel-size", "1", timeout=120)
    assert "weights missing from the checkpoint" in line and "encoder.layer.0.attention.self.query" in line
    assert "worker 0 failed while loading: ValueError:" in line


def test_a_port_in_use_is_one_line_before_the_model_is_read(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # A model folder that would be refused too: the port is checked first.
        line = refusal("--port", str(port), "--model", str(tmp_path), timeout=60)
    assert line.startswith(f"embed-service: cannot listen on 127.0.0.1:{port}") and "in use" in line
