"""A benchmark's result file: the machine, the load around the run, the command and the figures.

record = ResultFile()          # at the start: the date, the arguments, the load average
...
record.write(path, figures)    # at the end: adds the load average then, writes JSON
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    """lscpu's 'Model name' ('?' where lscpu is missing)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return "?"
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")


class ResultFile:
    def __init__(self) -> None:
        self.date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.load_start = [round(x, 2) for x in os.getloadavg()]
        main = sys.modules["__main__"]
        spec = getattr(main, "__spec__", None)
        # as typed: `python -m benchmarks.x ...` or `python benchmarks/x.py ...` from the repository root
        head = ["-m", spec.name] if spec is not None else [os.path.relpath(sys.argv[0])]
        self.argv = [*head, *sys.argv[1:]]

    def write(self, path: str | Path, figures: dict[str, Any]) -> None:
        record = {
            "date": self.date,
            "command": " ".join(["python", *self.argv]),
            "cpu": cpu_model(),
            "cpus": os.cpu_count(),
            "load_average": {"start": self.load_start, "end": [round(x, 2) for x in os.getloadavg()]},
            **figures,
        }
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
