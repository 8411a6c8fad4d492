"""The test harness's servers never outlive their test run: not when they fail to come up, not when the
test process is killed outright."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.server import ServerProcess

ROOT = Path(__file__).resolve().parents[1]


def gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # A zombie still answers kill(0): reaped or not, it runs nothing.
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def test_a_server_that_does_not_come_up_in_time_is_killed():
    server = ServerProcess("--dtype", "float32")
    with pytest.raises(TimeoutError):
        server.wait_healthy(timeout=0.0)  # not up yet on any machine: it was started a moment ago
    assert server.proc.poll() is not None
    assert server not in ServerProcess.running


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the kernel's parent-death signal is Linux's"
)
def test_servers_die_with_a_test_process_killed_outright():
    script = (
        "import sys, time\n"
        "from tests.server import ServerProcess\n"
        "s = ServerProcess('--dtype', 'float32')\n"
        "print(s.proc.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    runner = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert runner.stdout is not None
        server_pid = int(runner.stdout.readline())
        runner.send_signal(signal.SIGKILL)  # no atexit, no fixture teardown: only the kernel is left
        runner.wait(10)
        assert gone(server_pid, within=15), f"server {server_pid} outlived the test process"
    finally:
        if runner.poll() is None:
            runner.kill()
