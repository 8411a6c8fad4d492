from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server import ServerProcess

FILE_KEYS = ["file-key-one", "file-key-two"]
ENV_KEY = "env-key-three"


@pytest.fixture(scope="package")
def keyed_server() -> Iterator[ServerProcess]:
    """The default model with three keys, given the safe ways: two in --api-key-file, one in EMBED_API_KEY."""
    with tempfile.TemporaryDirectory() as tmp:
        key_file = Path(tmp) / "keys"
        key_file.write_text("# one key per line\n" + "\n".join(FILE_KEYS) + "\n\n")
        os.chmod(key_file, 0o600)
        with ServerProcess("--api-key-file", str(key_file), env={"EMBED_API_KEY": ENV_KEY}) as server:
            yield server
