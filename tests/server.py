"""A real server process on loopback, for tests that talk HTTP, and the suite's own text corpus.

Every server started here is killed however its test ends: ``wait_healthy`` kills a server that does not
come up, the ``with`` form stops it on any exit, conftest kills whatever a module left running, and an
interpreter exit (a failed run, Ctrl-C) kills the rest. On Linux a server started from the main thread is
also SIGKILLed by the kernel when the test process dies outright.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

# The suite's own texts (tests/data/make_corpus.py says where they come from and why they are enough).
CORPUS = Path(__file__).resolve().parent / "data"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# `python -m embed_service`, after asking the kernel to SIGKILL the server when the thread that started it
# ends (PR_SET_PDEATHSIG = 1). Done in the child before the server starts, not in a preexec_fn, which is
# unsafe in a process with threads.
_DIE_WITH_PARENT = """
import ctypes, os, runpy, signal, sys
ctypes.CDLL(None).prctl(1, signal.SIGKILL)
if os.getppid() != int(sys.argv.pop(1)):
    os._exit(1)
sys.argv[0] = "embed_service"
runpy.run_module("embed_service", run_name="__main__", alter_sys=True)
"""


class ServerProcess:
    """`python -m embed_service serve ...` in a subprocess; its log is kept for failure messages."""

    running: set[ServerProcess] = set()
    """Every server started and not yet stopped (conftest and atexit kill what is left)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="embed-server-", suffix=".log", delete=False)
        # The death signal follows the thread that forks: only the main thread lives as long as pytest.
        main = sys.platform.startswith("linux") and threading.current_thread() is threading.main_thread()
        launch = ["-c", _DIE_WITH_PARENT, str(os.getpid())] if main else ["-m", "embed_service"]
        cmd = [sys.executable, *launch, "serve", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        ServerProcess.running.add(self)

    def wait_healthy(self, timeout: float = 180.0) -> ServerProcess:
        """Return once /health is 200; a server that exits or does not get there is killed, then raised."""
        try:
            return self._wait_healthy(timeout)
        except BaseException:
            self.kill()
            raise

    def _wait_healthy(self, timeout: float) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not healthy in {timeout}s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-8000:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        ServerProcess.running.discard(self)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the server's whole session (its workers too), at once."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)
        ServerProcess.running.discard(self)

    def __enter__(self) -> ServerProcess:
        return self.wait_healthy()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def kill_all_servers() -> int:
    """Kill every server still running; the number killed."""
    left = [s for s in list(ServerProcess.running) if s.proc.poll() is None]
    for server in left:
        server.kill()
    ServerProcess.running.clear()
    return len(left)


atexit.register(kill_all_servers)


HANG_S = 60.0
"""A failure bound only: a test waits for the event it means, and this long means that it never came."""


def wait_until(condition, what: str, server: ServerProcess | None = None, timeout: float = HANG_S) -> None:
    """Return once `condition()` is true; fail naming `what` (and the server's log) after `timeout`."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            log = f":\n{server.output()}" if server is not None else ""
            raise AssertionError(f"waited {timeout:.0f}s for {what}{log}")
        time.sleep(0.005)


@contextlib.contextmanager
def workers_held(server: ServerProcess) -> Iterator[list[int]]:
    """The default model's worker processes stopped (SIGSTOP) for the block, then continued: a batch sent
    to them meanwhile stays unanswered, so what the server admits stays in flight on any CPU, however fast.
    Keep the block short: a worker silent for 5 s (workers/group.py's HEARTBEAT_TIMEOUT_S) is declared hung
    and restarted."""
    info = httpx.get(server.url + "/info", timeout=30).json()
    pids = [pid for replica in info["replicas"] for pid in replica["pids"]]
    assert pids, info["replicas"]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield pids
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def metric_total(server: ServerProcess, name: str) -> float:
    """The sum of a /metrics series' samples over all their labels (0 when it has none)."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return sum(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith((name + "{", name + " "))
    )


def abandoned_while_queued(server: ServerProcess, body: bytes) -> None:
    """POST `body` to /v1/embeddings on a raw socket with the workers held, hang up once its inputs are
    queued, wait for the server to let the request go (nothing left in flight), then let the workers go
    and return once the queue is empty (the batcher skips the abandoned inputs as it takes them)."""
    with workers_held(server):
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(
            b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_until(lambda: metric_total(server, "embed_queue_size") > 0, "the inputs to be queued", server)
        sock.close()
        wait_until(lambda: metric_total(server, "embed_inputs_in_flight") == 0, "the request let go", server)
    wait_until(lambda: metric_total(server, "embed_queue_size") == 0, "the queue to be emptied", server)


def read_corpus(name: str, n: int) -> list[str]:
    """The first `n` texts of tests/data/<name>; asking for more than the file has is an error."""
    with open(CORPUS / name, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for _, line in zip(range(n), f)]
    if len(texts) < n:
        raise ValueError(f"{CORPUS / name} has {len(texts)} texts, fewer than the {n} asked for")
    return texts


def refusal(*args: str, env: dict[str, str] | None = None, timeout: float = 120.0) -> str:
    """Run `embed-service serve ARGS`, which must refuse to start: a non-zero exit within `timeout`, no
    traceback; the first line that says why (`embed-service: ...` or a logged error) is returned."""
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "embed_service", "serve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    output = run.stdout + run.stderr
    assert run.returncode != 0, output
    assert "Traceback" not in output, output
    why = [ln for ln in run.stderr.splitlines() if ln.startswith("embed-service: ") or " ERROR " in ln]
    assert why, output
    print(f"\nrefused in {time.monotonic() - start:.1f}s with exit {run.returncode}: {why[0]}")
    return why[0]


@contextlib.contextmanager
def in_process_app(settings, model_path: Path, name: str) -> Iterator:
    """A TestClient on `create_app` with one real engine (worker processes on `model_path`), once the model
    serves."""
    from fastapi.testclient import TestClient

    from embed_service.api.app import create_app
    from embed_service.engine.engine import Engine
    from embed_service.models.spec import load_spec
    from embed_service.server import local_plan

    engines = [Engine(settings, load_spec(model_path, None), [name])]
    with TestClient(create_app(settings, engines, local_plan(engines))) as client:
        deadline = time.monotonic() + 120
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the model did not load"
            time.sleep(0.1)
        yield client
