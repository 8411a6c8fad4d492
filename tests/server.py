"""A real server process on loopback, for tests that talk HTTP."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

# The shared material sits beside the checkout (a worktree may sit one level deeper).
SHARED = next(
    (d / "shared" for d in Path(__file__).resolve().parents if (d / "shared" / "bench").is_dir()),
    Path(__file__).resolve().parents[2] / "shared",
)
CORPUS = SHARED / "bench" / "corpus"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """`python -m embed_service serve ...` in a subprocess; its log is kept for failure messages."""

    def __init__(self, *args: str, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="embed-server-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "embed_service", "serve", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )

    def wait_healthy(self, timeout: float = 180.0) -> ServerProcess:
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
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self.wait_healthy()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def read_corpus(name: str, n: int) -> list[str]:
    import json

    with open(CORPUS / name, encoding="utf-8") as f:
        return [json.loads(line)["text"] for _, line in zip(range(n), f)]
