"""What chunked requests cost a server with the default limits, for one or more source trees.

Per tree, a server of the default model (float32), then:
- `worst`: the worst chunked request a client can send under the 8 MiB body limit: 1015 texts of 8255
  one-token characters ("1.1.1..."), `chunking.overlap` 127, 64 windows each (16.6 M tokens). Where it is
  refused, the figures of the refusal; where it runs, the client gives up after `--give-up` seconds.
- `largest`: the largest request the per-request bound admits: 32 of those texts, 2048 windows, 524,288
  tokens (--max-client-batch-size x max input length).
- `small`: one of those texts alone (64 windows): its wall time, then, run again, the peak of
  `embed_inputs_in_flight` while it runs (the admission's slots held, sampled from /metrics).

CPU is the server process's (HTTP, tokenization) and its workers' (the model) apart, over the request;
memory is the server process's peak resident growth. Example, this tree against an older commit
checked out with `git worktree add /tmp/old <rev>`:

    python benchmarks/chunking_cost.py --tree old=/tmp/old/src --tree new=src
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Any

import httpx
import psutil

from benchmarks.http_cpu import Served, served
from embed_service.workers.group import free_port

TEXT = ("1." * 4200)[:8255]
OVERLAP = 127


def cpu(processes: list[psutil.Process]) -> float:
    total = 0.0
    for p in processes:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


class Sampler(threading.Thread):
    """Samples the server's resident memory (and, with `metrics`, its inputs in flight from /metrics every
    20 ms: a request of its own to the server, so not while timing) until stopped."""

    def __init__(self, target: Served, metrics: bool):
        super().__init__(daemon=True)
        self.target, self.metrics, self.rss, self.in_flight = target, metrics, 0, 0
        self.done = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self.done.is_set():
                self.rss = max(self.rss, self.target.processes[0].memory_info().rss)
                if self.metrics:
                    for line in client.get(self.target.url + "/metrics").text.splitlines():
                        if line.startswith("embed_inputs_in_flight{"):
                            self.in_flight = max(self.in_flight, int(float(line.rsplit(" ", 1)[1])))
                time.sleep(0.02 if self.metrics else 0.01)


def measure(target: Served, inputs: list[str], give_up: float, metrics: bool = False) -> dict[str, Any]:
    server = target.processes
    workers = server[0].children(recursive=True)
    rss0 = server[0].memory_info().rss
    before = (cpu(server), cpu(workers))
    sampler = Sampler(target, metrics)
    sampler.start()
    t0 = time.perf_counter()
    body = {"input": inputs, "chunking": {"overlap": OVERLAP}}
    try:
        r = httpx.post(target.url + "/v1/embeddings", json=body, timeout=give_up)
        answer: dict[str, Any] = {"status": r.status_code}
        if r.status_code == 200:
            answer["prompt_tokens"] = r.json()["usage"]["prompt_tokens"]
        else:
            answer["message"] = r.json()["error"]["message"]
    except httpx.TimeoutException:
        answer = {"status": f"no answer in {give_up:.0f} s (client gave up)"}
    wall = time.perf_counter() - t0
    sampler.done.set()
    sampler.join()
    return {
        **answer,
        "wall_s": round(wall, 3),
        "server_cpu_s": round(cpu(server) - before[0], 2),
        "workers_cpu_s": round(cpu(workers) - before[1], 2),
        "rss_growth_mib": round((sampler.rss - rss0) / 2**20, 1),
        **({"peak_inputs_in_flight": sampler.in_flight} if metrics else {}),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", required=True, help="NAME=SRC_DIR (repeatable)")
    ap.add_argument("--cases", default="small,worst,largest", help="which requests, comma-separated")
    ap.add_argument("--give-up", type=float, default=45.0, help="client timeout for each request (s)")
    args = ap.parse_args()
    cases = {"small": [TEXT], "worst": [TEXT] * 1015, "largest": [TEXT] * 32}
    results: dict[str, Any] = {}
    for spec in args.tree:
        name, src = spec.split("=", 1)
        with served(src, free_port(), ["--dtype", "float32"], null_model=False) as target:
            measure(target, ["warm up"], args.give_up)
            for case in args.cases.split(","):
                results[f"{name} {case}"] = got = measure(target, cases[case], args.give_up)
                print(f"{name} {case}: {json.dumps(got)}", flush=True)
                if case == "small":  # again, for the inputs in flight
                    got = measure(target, cases[case], args.give_up, metrics=True)
                    results[f"{name} small in flight"] = got
                    print(f"{name} small, sampled: {json.dumps(got)}", flush=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
