"""One sentence-transformers contender, run in the peers' virtual environment (benchmarks/peers.py starts it).

    python st_peer.py --model DIR --backend KIND --exports DIR --shared-peers DIR --out DIR NAME=CORPUS.jsonl...

Loads the backend with ``st_backends.load`` from the shared peers folder (torch float32 / bfloat16, ONNX
Runtime plain / O3 / dynamic int8, OpenVINO; ONNX and OpenVINO exports are made once and cached under
--exports), then for each corpus encodes its first --n texts with ``SentenceTransformer.encode`` (batch 32,
after a warm-up on 64 of them), writes the vectors to OUT/NAME.npy and prints one JSON line:
``{"threads": ..., NAME: {"texts_per_s": ..., "seconds": ...}, ...}``. Imports nothing of embed_service.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def read_texts(path: str, n: int) -> list[str]:
    """The same texts as embed_service.bench.read_texts (the first n non-blank lines)."""
    texts: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if len(texts) >= n:
                break
            if line.strip():
                texts.append(json.loads(line)["text"])
    return texts


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--backend", required=True)
    p.add_argument("--exports", required=True)
    p.add_argument("--shared-peers", required=True, help="the folder holding st_backends.py")
    p.add_argument("--out", required=True)
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("corpora", nargs="+", metavar="NAME=PATH")
    a = p.parse_args()
    sys.path.insert(0, a.shared_peers)
    import numpy as np
    import torch
    from st_backends import load  # type: ignore[import-not-found]

    os.makedirs(a.exports, exist_ok=True)
    os.makedirs(a.out, exist_ok=True)
    if a.backend == "openvino-f32":
        # OpenVINO computes in bf16 where the CPU has it (its default precision hint); a decoder can come out
        # all NaN that way. The same export with float32 inference precision.
        from sentence_transformers import SentenceTransformer

        load("openvino", a.model, a.exports)  # makes the export once
        model = SentenceTransformer(os.path.join(a.exports, "openvino"), backend="openvino",
                                    model_kwargs={"ov_config": {"INFERENCE_PRECISION_HINT": "f32"}})  # fmt: skip
    else:
        model = load(a.backend, a.model, a.exports)
    result: dict = {"threads": torch.get_num_threads(), "max_seq_length": model.max_seq_length}
    for spec in a.corpora:
        name, path = spec.split("=", 1)
        texts = read_texts(path, a.n)
        model.encode(texts[:64], batch_size=a.batch_size)  # warm-up
        t = time.perf_counter()
        emb = model.encode(texts, batch_size=a.batch_size, convert_to_numpy=True)
        dt = time.perf_counter() - t
        np.save(os.path.join(a.out, f"{name}.npy"), np.asarray(emb, dtype=np.float32))
        result[name] = {"texts_per_s": len(texts) / dt, "seconds": dt}
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
