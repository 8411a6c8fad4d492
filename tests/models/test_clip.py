"""CLIP's towers on the project's layers equal transformers' CLIPModel.get_text_features / get_image_features.

Tiny random CLIPModel folders (save_pretrained; weights at N(0, 0.08), norms and biases random), texts from
the corpora through a real tokenizer (SmolLM2's BPE wrapped in <|im_start|> ... <|im_end|>, <|im_end|> as
the end-of-text token), pixel values from the reference image processor on images drawn in the test. Min
cosine >= 0.99999 in float32, >= 0.999 in bfloat16 (against the float32 reference), one flat batch each, the
text batch padded the way a CPU worker pads it (ops/batch.py padded_tokens).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers as T

from embed_service.models.loader import EmbeddingModel
from embed_service.models.spec import load_spec
from embed_service.ops.batch import FlatBatch
from embed_service.outputs import DENSE_ONLY, OutputRequest
from tests.images.pictures import pictures
from tests.models.tiny import load_tokenizer, randomize, texts

VISION = dict(
    hidden_size=48,
    intermediate_size=80,
    num_attention_heads=4,
    num_hidden_layers=2,
    image_size=32,
    patch_size=8,
)
TEXT = dict(
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_hidden_layers=2,
    max_position_embeddings=77,
)
PREPROCESSOR = {  # CLIP's own settings, at the tiny model's resolution
    "image_processor_type": "CLIPImageProcessor",
    "do_resize": True,
    "size": {"shortest_edge": 32},
    "resample": 3,
    "do_center_crop": True,
    "crop_size": {"height": 32, "width": 32},
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_convert_rgb": True,
}


def build_two_tower(
    path: Path,
    model_class: str,
    config: Any,
    tokenizer: Any,
    preprocessor: dict[str, Any],
) -> Path:
    """save_pretrained of a random model, its tokenizer and preprocessor_config.json."""
    torch.manual_seed(0)
    model = getattr(T, model_class)(config).eval()
    randomize(model)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    (path / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    return path


def ours(path: Path, dtype: torch.dtype) -> EmbeddingModel:
    """The worker's own model on the folder, detected from it (models/spec.py)."""
    return EmbeddingModel(load_spec(path), dtype, torch.device("cpu")).eval()


def served(
    model: EmbeddingModel, ids: list[list[int]], pixels: torch.Tensor
) -> tuple[np.ndarray, np.ndarray]:
    """Text and image vectors from one batch, as a worker runs it: the images (placeholder ids as long as
    their vision-tower tokens, the pixels in their requests) interleaved with the texts."""
    per_image = model.spec.tokens_per_image
    seqs, requests, kinds = [], [], []
    images = [p.numpy().astype(np.float32).tobytes() for p in pixels]
    for k in range(max(len(ids), len(images))):
        if k < len(ids):
            seqs.append(ids[k]), requests.append(DENSE_ONLY), kinds.append("text")
        if k < len(images):
            (
                seqs.append([0] * per_image),
                requests.append(OutputRequest(pixels=images[k])),
                kinds.append("image"),
            )
    batch = FlatBatch.from_lengths(torch.tensor([t for s in seqs for t in s]), [len(s) for s in seqs])
    out = model(batch, requests)
    text = np.stack([o.dense for o, kind in zip(out, kinds) if kind == "text"])
    image = np.stack([o.dense for o, kind in zip(out, kinds) if kind == "image"])
    return text, image


def reference_text(path: Path, ids: list[list[int]], pad: int, mask: bool = True) -> np.ndarray:
    model = T.AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for start in range(0, len(ids), 16):
            chunk = ids[start : start + 16]
            width = max(len(s) for s in chunk)
            input_ids = torch.tensor([s + [pad] * (width - len(s)) for s in chunk])
            kw = {}
            if mask:
                kw["attention_mask"] = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in chunk])
            out.append(model.get_text_features(input_ids=input_ids, **kw).pooler_output.numpy())
    return np.concatenate(out)


def reference_images(path: Path, pixels: torch.Tensor) -> np.ndarray:
    model = T.AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        return model.get_image_features(pixel_values=pixels).pooler_output.numpy()


def pixel_values(path: Path) -> torch.Tensor:
    """The reference processor's pixels for the test pictures (every size and mode of tests/images)."""
    processor = T.AutoImageProcessor.from_pretrained(str(path))
    return processor(images=[p.image for p in pictures()], return_tensors="pt")["pixel_values"]


def min_cos(a: np.ndarray, b: np.ndarray) -> float:
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return float(cos.min())


def check_towers(path: Path, ids: list[list[int]], ref_text: np.ndarray, label: str):
    pixels = pixel_values(path)
    ref_img = reference_images(path, pixels)
    for dtype, bound in ((torch.float32, 0.99999), (torch.bfloat16, 0.999)):
        got_text, got_img = served(ours(path, dtype), ids, pixels)
        assert got_text.shape == ref_text.shape and got_img.shape == ref_img.shape
        t, i = min_cos(got_text, ref_text), min_cos(got_img, ref_img)
        print(
            f"\n{label} {dtype}: text min cosine {t:.7f} ({len(ids)} texts), image {i:.7f} ({len(pixels)} images)"
        )
        assert t >= bound, f"{label} {dtype} text min cosine {t}"
        assert i >= bound, f"{label} {dtype} image min cosine {i}"


@pytest.mark.parametrize(
    "tokenizer, eos_token",
    [("wordpiece", "[SEP]"), ("bpe-template", None)],
    ids=["eos-token-id", "legacy-eos-2-highest-id"],
)
def test_clip_matches_transformers(tmp_path, tokenizer_sources, tokenizer, eos_token):
    """eos_token_id [SEP] (102): the first [SEP] is pooled. eos_token_id 2 (configs from before
    transformers#24773): the highest token id is pooled, wherever it stands."""
    tok = load_tokenizer(tokenizer, tokenizer_sources)
    eos = tok.convert_tokens_to_ids(eos_token) if eos_token else 2
    text = dict(TEXT, vocab_size=len(tok), eos_token_id=eos, bos_token_id=1, pad_token_id=0)
    config = T.CLIPConfig(text_config=text, vision_config=VISION, projection_dim=40)
    path = build_two_tower(tmp_path / "clip", "CLIPModel", config, tok, PREPROCESSOR)
    ids = tok(texts(), truncation=True, max_length=TEXT["max_position_embeddings"])["input_ids"]
    # A text with no end-of-text token, and one with it mid-text: the pooled position is transformers' too.
    ids += [ids[0][:-1], (ids[1][:3] + [eos] + ids[1][3:])[: TEXT["max_position_embeddings"]]]
    # Padded with 0 in the reference batches: never the highest id, so the legacy rule sees the real ones.
    check_towers(path, ids, reference_text(path, ids, pad=0), f"CLIP {tokenizer}")


def test_sentence_transformers_clip_layout_loads_and_matches(tmp_path, tokenizer_sources):
    """sentence-transformers' CLIP layout (modules.json naming one CLIPModel module in 0_CLIPModel/) is
    detected, and its text and image vectors equal SentenceTransformer.encode on the same folder."""
    from sentence_transformers import SentenceTransformer

    tok = load_tokenizer("wordpiece", tokenizer_sources)
    text = dict(TEXT, vocab_size=len(tok), eos_token_id=tok.sep_token_id, pad_token_id=0)
    config = T.CLIPConfig(text_config=text, vision_config=VISION, projection_dim=40)
    build_two_tower(tmp_path / "st" / "0_CLIPModel", "CLIPModel", config, tok, PREPROCESSOR)
    modules = [
        {"idx": 0, "name": "0", "path": "0_CLIPModel", "type": "sentence_transformers.models.CLIPModel"}
    ]
    (tmp_path / "st" / "modules.json").write_text(json.dumps(modules))
    spec = load_spec(tmp_path / "st")
    assert spec.path == (tmp_path / "st" / "0_CLIPModel").resolve()
    assert (spec.modalities, spec.dimension, spec.tokens_per_image) == (frozenset({"text", "image"}), 40, 17)
    st = SentenceTransformer(str(tmp_path / "st"), device="cpu")
    sample = texts()[:20]
    images = [p.image for p in pictures()]
    want_text = st.encode(sample, convert_to_numpy=True)
    want_img = st.encode(images, convert_to_numpy=True)
    ids = tok(sample, truncation=True, max_length=TEXT["max_position_embeddings"])["input_ids"]
    processor = spec.image_processor
    pixels = torch.from_numpy(np.stack([processor(i) for i in images]))
    got_text, got_img = served(ours(tmp_path / "st", torch.float32), ids, pixels)
    assert min_cos(got_text, want_text) >= 0.99999
    assert min_cos(got_img, want_img) >= 0.99999


def test_siglip2_naflex_is_refused():
    from embed_service.models.registry import UnsupportedModelError, resolve_family

    with pytest.raises(UnsupportedModelError, match="Siglip2Model"):
        resolve_family({"architectures": ["Siglip2Model"]})


def _tp_rank(rank: int, world: int, init: str, path: str, ids, pixels, out) -> None:
    import torch.distributed as dist

    from embed_service.parallel import set_tensor_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    set_tensor_parallel(rank, world)
    try:
        text, image = served(ours(Path(path), torch.float32), ids, pixels)
        if rank == 0:
            out.put((text, image))
            out.close()
            out.join_thread()  # the vectors are in the pipe before this process goes
        dist.barrier()  # both ranks are done with gloo
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    # Out without gloo's teardown: clean-clone runs saw a rank abort in destroy_process_group or the exit
    # after it (SIGABRT, "terminate called without an active exception": a joinable C++ thread destroyed),
    # with and without a barrier before it, each time after the right vectors. What the test checks is the
    # vectors and that no rank failed before the barrier; the server's workers do not exit this way
    # (workers/group.py stops them and does not read their exit codes).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def tensor_parallel_vectors(path: Path, ids, pixels: torch.Tensor, world: int = 2):
    """The towers' vectors with the weights split over `world` ranks (processes joined over gloo)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{path.parent / 'tp-rendezvous'}"
    procs = [
        ctx.Process(target=_tp_rank, args=(r, world, init, str(path), ids, pixels, out)) for r in range(world)
    ]
    for p in procs:
        p.start()
    result = out.get(timeout=600)
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    return result


def test_clip_tensor_parallel_2_equals_transformers(tmp_path, tokenizer_sources):
    """Both towers split over 2 ranks (heads, MLP, vocabulary) give transformers' vectors."""
    tok = load_tokenizer("wordpiece", tokenizer_sources)
    text = dict(TEXT, vocab_size=len(tok), eos_token_id=tok.sep_token_id, pad_token_id=0)
    config = T.CLIPConfig(text_config=text, vision_config=VISION, projection_dim=40)
    path = build_two_tower(tmp_path / "clip", "CLIPModel", config, tok, PREPROCESSOR)
    ids = tok(texts()[:24], truncation=True, max_length=TEXT["max_position_embeddings"])["input_ids"]
    pixels = pixel_values(path)
    got_text, got_img = tensor_parallel_vectors(path, ids, pixels)
    assert min_cos(got_text, reference_text(path, ids, pad=0)) >= 0.99999
    assert min_cos(got_img, reference_images(path, pixels)) >= 0.99999


def test_processor_size_must_match_the_vision_tower(tmp_path, tokenizer_sources):
    tok = load_tokenizer("wordpiece", tokenizer_sources)
    text = dict(TEXT, vocab_size=len(tok), eos_token_id=tok.sep_token_id, pad_token_id=0)
    config = T.CLIPConfig(text_config=text, vision_config=VISION, projection_dim=40)
    crop = {**PREPROCESSOR, "crop_size": {"height": 48, "width": 48}}
    path = build_two_tower(tmp_path / "clip", "CLIPModel", config, tok, crop)
    with pytest.raises(ValueError, match="images come out 48x48, but the vision tower takes 32x32"):
        load_spec(path)
