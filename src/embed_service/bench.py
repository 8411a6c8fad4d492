"""`embed-service bench`: closed-loop load against any OpenAI-compatible ``/v1/embeddings`` URL.

The client must not be what is measured. wrk (C, event-driven) drives the load where it is installed, with
a generated Lua script that rotates pre-built request bodies; elsewhere a threaded ``http.client`` loop
does. Either way the client's own ceiling is measured against a null endpoint (a bare asyncio server
that answers every request at once with a constant, correctly shaped embedding response) and printed
beside the result, so a figure close to the ceiling reads as "client-bound", not as the server's speed.

Tokens per second come from the server's own ``usage`` counts, taken once over the texts before the run
(that pass is also the warm-up).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import math
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

DEFAULT_TIMEOUT_S = 120.0


@dataclass
class LoadSpec:
    """One closed-loop run: `concurrency` clients, each sending the next body as soon as it has an answer."""

    url: str  # full URL of the embeddings endpoint
    bodies: list[bytes]  # rotated
    inputs_per_request: int
    concurrency: int
    duration: float
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class LoadResult:
    client: str
    requests: int
    seconds: float
    errors: int
    latency_ms: dict[str, float]  # p50, p95, p99, max

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def endpoint_url(url: str) -> str:
    """A base URL gets /v1/embeddings; a URL that already names the endpoint is kept."""
    url = url.rstrip("/")
    if url.endswith("/embeddings"):
        return url
    if url.endswith("/v1"):
        return url + "/embeddings"
    return url + "/v1/embeddings"


def read_texts(path: str | Path, n: int) -> list[str]:
    texts: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if len(texts) >= n:
                break
            if line.strip():
                texts.append(json.loads(line)["text"])
    if not texts:
        raise SystemExit(f"{path}: no texts")
    return texts


def make_bodies(
    texts: list[str], per_request: int, encoding_format: str, model: str | None, extra: dict | None = None
) -> list[bytes]:
    """Consecutive groups of `per_request` texts, wrapping around so every body is full."""
    bodies = []
    count = max(1, math.ceil(len(texts) / per_request))
    for i in range(count):
        group = [texts[(i * per_request + j) % len(texts)] for j in range(per_request)]
        body: dict[str, Any] = {"input": group, "encoding_format": encoding_format}
        if model:
            body["model"] = model
        body.update(extra or {})
        bodies.append(json.dumps(body, ensure_ascii=False).encode())
    return bodies


def percentiles(latencies_s: list[float]) -> dict[str, float]:
    if not latencies_s:
        return {"p50": math.nan, "p95": math.nan, "p99": math.nan, "max": math.nan}
    xs = sorted(latencies_s)

    def pick(q: float) -> float:
        return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))] * 1e3

    return {"p50": pick(0.50), "p95": pick(0.95), "p99": pick(0.99), "max": xs[-1] * 1e3}


# --- the Python client ---------------------------------------------------------------------------------


def run_python(spec: LoadSpec) -> LoadResult:
    """Threads, each with one keep-alive connection (the GIL is released while a socket waits)."""
    parts = urlsplit(spec.url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    path = parts.path or "/"
    headers = {"Content-Type": "application/json", **spec.headers}
    lock = threading.Lock()
    latencies: list[float] = []
    errors = [0]
    start_barrier = threading.Barrier(spec.concurrency + 1)
    deadline = [0.0]

    def client(offset: int) -> None:
        conn = http.client.HTTPConnection(host, port, timeout=DEFAULT_TIMEOUT_S)
        mine: list[float] = []
        bad = 0
        i = offset
        start_barrier.wait()
        while time.perf_counter() < deadline[0]:
            body = spec.bodies[i % len(spec.bodies)]
            i += 1
            t = time.perf_counter()
            try:
                conn.request("POST", path, body, headers)
                resp = conn.getresponse()
                resp.read()
                ok = resp.status == 200
            except (OSError, http.client.HTTPException):
                ok = False
                conn.close()
                conn = http.client.HTTPConnection(host, port, timeout=DEFAULT_TIMEOUT_S)
            if time.perf_counter() > deadline[0]:
                break  # answered after the window: not counted, as wrk does
            if ok:
                mine.append(time.perf_counter() - t)
            else:
                bad += 1
        conn.close()
        with lock:
            latencies.extend(mine)
            errors[0] += bad

    step = max(1, len(spec.bodies) // spec.concurrency)
    threads = [
        threading.Thread(target=client, args=(k * step,), daemon=True) for k in range(spec.concurrency)
    ]
    for t in threads:
        t.start()
    start = time.perf_counter()
    deadline[0] = start + spec.duration
    start_barrier.wait()
    for t in threads:
        t.join(spec.duration + DEFAULT_TIMEOUT_S)
    seconds = time.perf_counter() - start
    return LoadResult("python", len(latencies), seconds, errors[0], percentiles(latencies))


# --- wrk -----------------------------------------------------------------------------------------------

# Each wrk thread reads the bodies (one JSON document per line) and sends them in turn from its own offset.
# `done` runs once with the merged statistics and prints one marked JSON line.
WRK_SCRIPT = """
local bodies_path = %(bodies)s
local headers = %(headers)s
local bodies = {}
local counter = 0
local thread_index = 0
setup = function(thread)
  thread:set("index", thread_index)
  thread_index = thread_index + 1
end
init = function(args)
  for line in io.lines(bodies_path) do bodies[#bodies + 1] = line end
  counter = (index or 0) * 7919
end
request = function()
  counter = counter + 1
  return wrk.format("POST", nil, headers, bodies[(counter %% #bodies) + 1])
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '@@bench {"requests": %%d, "duration_us": %%d, "errors": %%d, "p50": %%d, "p95": %%d, "p99": %%d, "max": %%d}\\n',
    summary.requests, summary.duration, e.connect + e.read + e.write + e.status + e.timeout,
    latency:percentile(50), latency:percentile(95), latency:percentile(99), latency.max))
end
"""


def _lua_string(s: str) -> str:
    return json.dumps(s)  # a JSON string literal is a valid Lua string literal for these characters


def run_wrk(spec: LoadSpec, threads: int | None = None) -> LoadResult:
    wrk = shutil.which("wrk")
    if wrk is None:
        raise RuntimeError("wrk is not installed")
    threads = threads or (1 if spec.concurrency < 8 else 2)
    headers = {"Content-Type": "application/json", **spec.headers}
    lua_headers = "{" + ", ".join(f"[{_lua_string(k)}] = {_lua_string(v)}" for k, v in headers.items()) + "}"
    with tempfile.TemporaryDirectory(prefix="embed-bench-") as tmp:
        bodies = Path(tmp) / "bodies.jsonl"
        bodies.write_bytes(b"\n".join(spec.bodies) + b"\n")
        script = Path(tmp) / "rotate.lua"
        script.write_text(WRK_SCRIPT % {"bodies": _lua_string(str(bodies)), "headers": lua_headers})
        cmd = [
            wrk,
            f"-t{threads}",
            f"-c{max(spec.concurrency, threads)}",
            f"-d{max(1, round(spec.duration))}s",
            f"--timeout={int(DEFAULT_TIMEOUT_S)}s",
            "-s",
            str(script),
            spec.url,
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=spec.duration + DEFAULT_TIMEOUT_S)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("@@bench ")), None)
    if line is None:
        raise RuntimeError(f"wrk failed (exit {out.returncode}): {out.stderr.strip() or out.stdout.strip()}")
    r = json.loads(line[len("@@bench ") :])
    lat = {k: r[k] / 1e3 for k in ("p50", "p95", "p99", "max")}
    errors = r["errors"]
    # wrk counts non-2xx answers among its requests; the throughput counts only the good ones.
    return LoadResult("wrk", r["requests"] - min(errors, r["requests"]), r["duration_us"] / 1e6, errors, lat)


def run_load(spec: LoadSpec, client: str = "auto") -> LoadResult:
    if client == "wrk" or (client == "auto" and shutil.which("wrk")):
        return run_wrk(spec)
    return run_python(spec)


# --- the null endpoint ---------------------------------------------------------------------------------


def _null_response(inputs: int, dimension: int, encoding_format: str) -> bytes:
    import base64
    import struct

    vector = [0.0123456789] * dimension
    if encoding_format == "base64":
        embedding: Any = base64.b64encode(struct.pack(f"<{dimension}f", *vector)).decode()
    else:
        embedding = vector
    body = {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": embedding} for i in range(inputs)],
        "model": "null",
        "usage": {"prompt_tokens": 0, "total_tokens": 0},
    }
    payload = json.dumps(body).encode()
    head = (
        f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n"
    ).encode()
    return head + payload


def _serve_null(sock: socket.socket, response: bytes) -> None:
    """Answer every HTTP/1.1 request on `sock` with `response` (keep-alive; bodies read by Content-Length)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                if length:
                    await reader.readexactly(length)
                writer.write(response)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, sock=sock, limit=1 << 24)
        await server.serve_forever()

    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())


def client_ceiling(spec: LoadSpec, client: str, dimension: int, encoding_format: str) -> LoadResult:
    """The same load against a null endpoint: what this client reaches when the server costs nothing."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    port = sock.getsockname()[1]
    response = _null_response(spec.inputs_per_request, dimension, encoding_format)
    proc = mp.get_context("spawn").Process(target=_serve_null, args=(sock, response), daemon=True)
    proc.start()
    sock.close()
    try:
        null = LoadSpec(
            f"http://127.0.0.1:{port}/v1/embeddings",
            spec.bodies,
            spec.inputs_per_request,
            spec.concurrency,
            min(spec.duration, 5.0),
            spec.headers,
        )
        return run_load(null, client)
    finally:
        proc.kill()
        proc.join(5)


# --- usage counts and the whole benchmark --------------------------------------------------------------


def post(url: str, body: bytes, headers: dict[str, str], timeout: float = DEFAULT_TIMEOUT_S) -> dict:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=timeout)
    try:
        conn.request("POST", parts.path, body, {"Content-Type": "application/json", **headers})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}: {data[:300]!r}")
        return json.loads(data)
    finally:
        conn.close()


def count_tokens(
    url: str, texts: list[str], model: str | None, headers: dict[str, str]
) -> tuple[float | None, int]:
    """(mean tokens per text by the server's usage, embedding dimension); also warms the server up."""
    tokens, dimension = 0, 0
    for i in range(0, len(texts), 32):
        group = texts[i : i + 32]
        body: dict[str, Any] = {"input": group}
        if model:
            body["model"] = model
        out = post(url, json.dumps(body).encode(), headers)
        dimension = len(out["data"][0]["embedding"])
        usage = out.get("usage") or {}
        if "prompt_tokens" not in usage:
            return None, dimension
        tokens += int(usage["prompt_tokens"])
    return tokens / len(texts), dimension


@dataclass
class BenchReport:
    """What `embed-service bench` prints: the figures and the client's ceiling beside them."""

    url: str
    corpus: str
    texts: int
    inputs_per_request: int
    concurrency: int
    encoding_format: str
    client: str
    seconds: float
    requests: int
    errors: int
    requests_per_s: float
    texts_per_s: float
    tokens_per_s: float | None
    tokens_per_text: float | None
    latency_ms: dict[str, float]
    ceiling_requests_per_s: float | None
    ceiling_texts_per_s: float | None

    def table(self) -> str:
        def fmt(x: float | None, digits: int = 1) -> str:
            return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.{digits}f}"

        lat = self.latency_ms
        rows = [
            ("url", self.url),
            ("corpus", f"{self.corpus} ({self.texts} texts, {fmt(self.tokens_per_text)} tokens/text)"),
            ("load", f"{self.inputs_per_request} input(s)/request, concurrency {self.concurrency}, "
             f"{self.encoding_format}, {self.seconds:.1f}s, client {self.client}"),
            ("texts/s", fmt(self.texts_per_s)),
            ("tokens/s", fmt(self.tokens_per_s, 0)),
            ("requests/s", fmt(self.requests_per_s)),
            ("latency ms p50/p95/p99", f"{fmt(lat['p50'], 2)} / {fmt(lat['p95'], 2)} / {fmt(lat['p99'], 2)}"),
            ("errors", str(self.errors)),
            ("client ceiling", f"{fmt(self.ceiling_requests_per_s)} requests/s = "
             f"{fmt(self.ceiling_texts_per_s)} texts/s (null endpoint)"),
        ]  # fmt: skip
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def bench(
    url: str,
    corpus: str | Path,
    texts: int = 1000,
    inputs_per_request: int = 1,
    concurrency: int = 32,
    encoding_format: str = "float",
    duration: float = 10.0,
    model: str | None = None,
    client: str = "auto",
    api_key: str | None = None,
    ceiling: bool = True,
    warmup: bool = True,
) -> BenchReport:
    url = endpoint_url(url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sample = read_texts(corpus, texts)
    tokens_per_text, dimension = (
        count_tokens(url, sample, model, headers) if warmup else (None, 0)
    )  # also the warm-up
    bodies = make_bodies(sample, inputs_per_request, encoding_format, model)
    spec = LoadSpec(url, bodies, inputs_per_request, concurrency, duration, headers)
    result = run_load(spec, client)
    top = client_ceiling(spec, client, dimension or 384, encoding_format) if ceiling else None
    texts_per_s = result.requests_per_s * inputs_per_request
    return BenchReport(
        url=url,
        corpus=str(corpus),
        texts=len(sample),
        inputs_per_request=inputs_per_request,
        concurrency=concurrency,
        encoding_format=encoding_format,
        client=result.client,
        seconds=round(result.seconds, 3),
        requests=result.requests,
        errors=result.errors,
        requests_per_s=round(result.requests_per_s, 1),
        texts_per_s=round(texts_per_s, 1),
        tokens_per_s=round(texts_per_s * tokens_per_text, 0) if tokens_per_text else None,
        tokens_per_text=round(tokens_per_text, 2) if tokens_per_text else None,
        latency_ms={k: round(v, 3) for k, v in result.latency_ms.items()},
        ceiling_requests_per_s=round(top.requests_per_s, 1) if top else None,
        ceiling_texts_per_s=round(top.requests_per_s * inputs_per_request, 1) if top else None,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL or embeddings URL")
    parser.add_argument("--corpus", required=True, help='JSONL file, one {"text": ...} per line')
    parser.add_argument("--texts", type=int, default=1000, help="distinct texts taken from the corpus")
    parser.add_argument("--inputs-per-request", "--batch", type=int, default=1, dest="inputs_per_request")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight (closed loop)")
    parser.add_argument("--encoding-format", choices=["float", "base64"], default="float")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of load")
    parser.add_argument("--model", default=None, help="model name to ask for")
    parser.add_argument("--client", choices=["auto", "wrk", "python"], default="auto")
    parser.add_argument("--api-key", default=os.environ.get("EMBED_API_KEY"))
    parser.add_argument("--no-ceiling", action="store_true", help="skip the null-endpoint ceiling probe")
    parser.add_argument("--json", dest="json_path", help="also write the JSON report to this file")


def main(args: argparse.Namespace) -> int:
    try:
        report = bench(
            args.url,
            args.corpus,
            args.texts,
            args.inputs_per_request,
            args.concurrency,
            args.encoding_format,
            args.duration,
            args.model,
            args.client,
            args.api_key,
            ceiling=not args.no_ceiling,
        )
    except (RuntimeError, OSError) as exc:
        print(f"embed-service bench: {exc}", file=sys.stderr)
        return 2
    print(report.table())
    text = json.dumps(asdict(report))
    print(text)
    if args.json_path:
        Path(args.json_path).write_text(text + "\n")
    sys.stdout.flush()
    return 1 if report.errors else 0
