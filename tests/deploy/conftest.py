from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.server import ServerProcess


@pytest.fixture(scope="package")
def live_server() -> Iterator[ServerProcess]:
    """One server for the deployment tests that talk to one: the packaged default model in float32."""
    with ServerProcess("--dtype", "float32") as server:
        yield server
