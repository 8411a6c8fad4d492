"""gpu_check's steps (benchmarks/gpu_check.py): each within a hard time limit, each recorded, and the summary
rewritten after every one, so that a run killed at its limit still returns what it measured."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def log(text: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


# Seconds each step may take at most (also capped by what is left of --budget-s); a step past its limit is
# stopped (StepTimeout), and one that does not stop within STEP_GRACE_S more ends the run.
STEP_LIMITS = {"kernels": 100, "attention": 45, "write": 60, "cuda_graphs": 90, "in_process": 45, "http": 150}
STEP_GRACE_S = 20
MIN_STEP_S = 10  # a step with less than this left is skipped


class StepTimeout(Exception):
    pass


class Run:
    """The summary and its steps, written to `out` after every step."""

    def __init__(self, summary: dict[str, Any], out: Path | None, budget_s: float, limit_scale: float = 1.0):
        self.summary, self.out, self.limit_scale = summary, out, limit_scale
        self.deadline = time.monotonic() + budget_s
        summary["steps"] = []
        self.write()

    def write(self) -> None:
        if self.out is None:
            return
        self.out.parent.mkdir(parents=True, exist_ok=True)
        scratch = self.out.with_name(self.out.name + ".partial")
        scratch.write_text(json.dumps(self.summary) + "\n")
        scratch.replace(self.out)  # a reader never sees half a summary

    @contextmanager
    def _limit(self, name: str, seconds: float) -> Iterator[None]:
        def alarm(signum, frame):
            raise StepTimeout(f"{name}: over its limit of {seconds:.0f} s")

        done = threading.Event()

        def watchdog() -> None:  # a step stuck where the alarm cannot reach (inside one C call)
            if not done.wait(seconds + STEP_GRACE_S):
                self.summary["steps"].append({"step": name, "status": "killed", "limit_s": round(seconds)})
                self.summary["ok"] = False
                self.write()
                log(f"{name}: killed, {STEP_GRACE_S} s past its limit")
                from tests.server import kill_all_servers

                kill_all_servers()
                os._exit(3)

        previous = signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        threading.Thread(target=watchdog, daemon=True).start()
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            done.set()

    def step(self, name: str, kind: str, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) (with `limit_s=` when it takes one) within its limit; its outcome recorded, the summary
        written. Returns fn's result, or None when it did not finish."""
        left = self.deadline - time.monotonic()
        limit = min(STEP_LIMITS[kind] * self.limit_scale, left)
        record: dict[str, Any] = {"step": name, "limit_s": round(limit)}
        if limit < MIN_STEP_S:
            record.update(status="skipped", error=f"{left:.0f} s left of --budget-s")
            self.summary["steps"].append(record)
            self.write()
            return None
        log(f"{name} (at most {limit:.0f} s)")
        t0, result = time.perf_counter(), None
        try:
            with self._limit(name, limit):
                kwargs = {"limit_s": limit} if "limit_s" in fn.__code__.co_varnames else {}
                result = fn(*args, **kwargs)
            record["status"] = "ok"
        except StepTimeout as exc:
            record.update(status="timeout", error=str(exc))
        except Exception as exc:
            record.update(status="failed", error=f"{type(exc).__name__}: {exc}"[:2000])
            log(traceback.format_exc())
        record["seconds"] = round(time.perf_counter() - t0, 1)
        self.summary["steps"].append(record)
        self.write()
        return result
