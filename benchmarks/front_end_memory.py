"""Resident memory of each process of a server with ``--http-processes 2``: the engine process, its front
ends (which should import no torch) and its workers, after some requests.

    python benchmarks/front_end_memory.py [--src DIR]

`--src DIR` serves from another source tree (another checkout: the figures before a change).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.server import ServerProcess  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", help="serve from this source tree's src/")
    parser.add_argument("--requests", type=int, default=20)
    args = parser.parse_args()
    env = {"PYTHONPATH": str(Path(args.src) / "src")} if args.src else None
    flags = ("--dtype", "float32", "--data-parallel-size", "1", "--http-processes", "2")
    with ServerProcess(*flags, env=env) as server:
        for _ in range(args.requests):  # 8 texts of ~600 characters each
            r = httpx.post(
                server.url + "/v1/embeddings", json={"input": ["hello world " * 50] * 8}, timeout=60
            )
            r.raise_for_status()
        top = psutil.Process(server.proc.pid)
        print(f"engine process  {top.memory_info().rss / 2**20:7.1f} MiB")
        for child in top.children():
            if "spawn_main" not in " ".join(child.cmdline()):
                continue  # multiprocessing's resource tracker
            torch = any("libtorch" in m.path for m in child.memory_maps())
            kind = (
                "front end" if any(c.laddr.port == server.port for c in child.net_connections()) else "worker"
            )
            print(
                f"{kind:<15} {child.memory_info().rss / 2**20:7.1f} MiB  {'torch' if torch else 'no torch'}"
            )
    print(
        f"CPU: {next((ln.split(':', 1)[1].strip() for ln in open('/proc/cpuinfo') if 'model name' in ln), '?')}"
    )


if __name__ == "__main__":
    main()
