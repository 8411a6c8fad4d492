"""A CLIP and a SigLIP folder served by a real server on loopback: text and image vectors on /v1/embeddings
(OpenAI content parts and Jina's objects) and Cohere's /v2/embed equal transformers' get_text_features /
get_image_features in float32 (min cosine >= 0.99999), and every image refusal is a 400 naming the input and
the limit while the server keeps serving."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import transformers as T
from transformers.image_utils import load_image

from tests.images.pictures import encode, from_array, noise, shapes
from tests.images.test_decode import png_claiming
from tests.images.test_preprocess import encoded
from tests.models.test_clip import PREPROCESSOR, TEXT, VISION, build_two_tower, min_cos
from tests.models.test_siglip import siglip_folder
from tests.models.tiny import load_tokenizer, texts
from tests.server import ServerProcess

LIMITS = (
    "--max-image-pixels",
    "250000",
    "--max-image-bytes",
    "300000",
    "--max-request-image-bytes",
    "600000",
)


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def clip_path(tmp_path_factory, tokenizer_sources) -> Path:
    tok = load_tokenizer("wordpiece", tokenizer_sources)
    text = dict(TEXT, vocab_size=len(tok), eos_token_id=tok.sep_token_id, pad_token_id=0)
    config = T.CLIPConfig(text_config=text, vision_config=VISION, projection_dim=40)
    return build_two_tower(tmp_path_factory.mktemp("clip") / "clip", "CLIPModel", config, tok, PREPROCESSOR)


@pytest.fixture(scope="module")
def clip_server(clip_path) -> Iterator[ServerProcess]:
    with ServerProcess("--model", str(clip_path), "--dtype", "float32", *LIMITS) as server:
        yield server


def reference(path: Path, texts_: list[str], images: list[bytes], pad: str | None = None):
    model = T.AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    tok = T.AutoTokenizer.from_pretrained(str(path))
    processor = T.AutoImageProcessor.from_pretrained(str(path))
    kw = {"padding": "max_length", "max_length": 64} if pad else {"padding": True, "max_length": 77}
    batch = tok(texts_, truncation=True, return_tensors="pt", **kw)
    if pad:
        batch.pop("attention_mask", None)  # SigLIP: no mask, as its processor gives none
    pictures = [load_image(base64.b64encode(d).decode()) for d in images]
    with torch.inference_mode():
        text = model.get_text_features(**batch).pooler_output.numpy()
        pixels = processor(images=pictures, return_tensors="pt")["pixel_values"]
        image = model.get_image_features(pixel_values=pixels).pooler_output.numpy()
    return text, image


def post(server: ServerProcess, body: dict, route: str = "/v1/embeddings") -> httpx.Response:
    return httpx.post(server.url + route, json=body, timeout=120)


def vectors(r: httpx.Response) -> np.ndarray:
    assert r.status_code == 200, r.text
    return np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)


def check_model(server: ServerProcess, path: Path, pad: str | None = None) -> None:
    sample = texts()[:30]
    images = [d for _, d in encoded()]
    want_text, want_image = reference(path, sample, images, pad)
    # One request: texts as strings and as text parts, images as image_url parts and as Jina objects.
    items: list = []
    for i, text in enumerate(sample):
        items.append(text if i % 2 else {"type": "text", "text": text})
    for i, data in enumerate(images):
        url = data_url(data)
        items.append({"type": "image_url", "image_url": {"url": url}} if i % 2 else {"image": url})
    got = vectors(post(server, {"input": items}))
    t, i = min_cos(got[: len(sample)], want_text), min_cos(got[len(sample) :], want_image)
    print(f"\n{path.name} served: text min cosine {t:.7f} ({len(sample)}), image {i:.7f} ({len(images)})")
    assert t >= 0.99999 and i >= 0.99999
    # Jina's text objects and bare base64 images, one per request
    one = vectors(post(server, {"input": [{"image": base64.b64encode(images[0]).decode()}]}))
    assert min_cos(one, want_image[:1]) >= 0.99999
    text_only = vectors(post(server, {"input": [{"text": sample[0]}]}))
    assert min_cos(text_only, want_text[:1]) >= 0.99999


def test_clip_text_and_images_equal_transformers(clip_server, clip_path):
    check_model(clip_server, clip_path)


def test_siglip_text_and_images_equal_transformers(tmp_path, tokenizer_sources):
    path, _ = siglip_folder(tmp_path, tokenizer_sources)
    with ServerProcess("--model", str(path), "--dtype", "float32") as server:
        check_model(server, path, pad="max_length")


def refused(server: ServerProcess, item, pattern: str) -> str:
    r = post(server, {"input": ["a text", item]})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert pytest.importorskip("re").search(pattern, message), message
    return message


def test_image_refusals_are_400s_naming_the_input_and_the_limit(clip_server):
    big = encode(from_array(noise(400, 400, 3, 1), "RGB"), "PNG")  # 160,000 pixels, ~480 KB
    cases = [
        (
            {"image": data_url(png_claiming(10000, 10000))},
            r"input 1: 10000x10000 = 100000000 pixels; the limit is 250000 pixels \(--max-image-pixels\)",
        ),
        (
            {"image": data_url(big)},
            r"input 1: .*bytes; the limit is 300000 bytes per image \(--max-image-bytes\)",
        ),
        (
            {"image": data_url(encode(shapes(32, 32), "BMP"), "image/png")},
            r"input 1: not an image in an allowed format \(PNG, JPEG, WebP, GIF\)",
        ),
        (
            {"image": data_url(encode(shapes(32, 32), "PNG"), "image/tiff")},
            r"input 1: media type 'image/tiff'",
        ),
        (
            {"image": data_url(encode(from_array(noise(96, 96, 3, 5), "RGB"), "PNG")[:3000])},
            r"input 1: the PNG image is corrupt or truncated",
        ),
        (
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
            r"input 1: remote image URLs are not fetched by default; .*--allowed-media-domains",
        ),
        ({"image": "not base64!"}, r"input 1: not valid base64"),
        ({"type": "video_url", "video_url": {}}, r"item 1: unknown input object"),
    ]
    for item, pattern in cases:
        print("\n", refused(clip_server, item, pattern))
    # per request: three images of ~200 KB each are 600 KB at most
    third = encode(from_array(noise(250, 270, 3, 2), "RGB"), "PNG")
    assert 200_000 < len(third) < 300_000
    r = post(clip_server, {"input": [{"image": data_url(third)}] * 3})
    assert r.status_code == 400, r.text
    assert "the limit is 600000 bytes per request (--max-request-image-bytes)" in r.json()["error"]["message"]
    # and it still serves
    assert vectors(
        post(clip_server, {"input": [{"image": data_url(encode(shapes(40, 30), "PNG"))}]})
    ).shape == (1, 40)


def test_front_end_processes_decode_and_send_pixels(clip_path, clip_server):
    """With --http-processes 2 the front ends decode the images and send their pixels to the engine
    process: the same vectors as one process, and the same refusals."""
    images = [d for _, d in encoded()][:6]
    items = ["a text", *({"image": data_url(d)} for d in images)]
    want = vectors(post(clip_server, {"input": items}))
    with ServerProcess(
        "--model", str(clip_path), "--dtype", "float32", "--http-processes", "2", *LIMITS
    ) as s:
        for _ in range(4):  # each front end answers some
            assert min_cos(vectors(post(s, {"input": items})), want) >= 0.99999
        refused(
            s, {"image": data_url(png_claiming(10000, 10000))}, r"input 1: 10000x10000 = 100000000 pixels"
        )


def test_info_lists_modalities(clip_server):
    info = httpx.get(clip_server.url + "/info", timeout=30).json()
    assert info["modalities"] == ["image", "text"]
    assert info["dimension"] == 40


def test_text_model_refuses_images(exact_server):
    r = post(exact_server, {"input": ["a text", {"image": data_url(encode(shapes(20, 20), "PNG"))}]})
    assert r.status_code == 400, r.text
    assert "does not embed images (it serves text only)" in r.json()["error"]["message"]
    info = httpx.get(exact_server.url + "/info", timeout=30).json()
    assert info["modalities"] == ["text"]


def test_cohere_images_and_image_parts_equal_transformers(clip_server, clip_path):
    """The real cohere client: images with input_type "image", and inputs holding image_url parts; every
    embedding type; output_dimension as for texts."""
    import cohere

    images = [d for _, d in encoded()][:8]
    urls = [data_url(d) for d in images]
    want_text, want_image = reference(clip_path, ["a photo of shapes"], images)
    co = cohere.ClientV2(base_url=clip_server.url, api_key="unused", timeout=120)
    res = co.embed(model="clip", images=urls, input_type="image", embedding_types=["float", "int8", "base64"])
    assert min_cos(np.array(res.embeddings.float_, dtype=np.float32), want_image) >= 0.99999
    assert len(res.embeddings.int8) == len(images) and len(res.embeddings.base64) == len(images)
    b64 = np.stack([np.frombuffer(base64.b64decode(v), np.float32) for v in res.embeddings.base64])
    assert min_cos(b64, want_image) >= 0.99999
    parts = [
        {"content": [{"type": "image_url", "image_url": {"url": urls[0]}}]},
        {"content": [{"type": "text", "text": "a photo of shapes"}]},
    ]
    r = post(
        clip_server, {"inputs": parts, "embedding_types": ["float"], "output_dimension": 16}, "/v2/embed"
    )
    assert r.status_code == 200, r.text
    got = np.array(r.json()["embeddings"]["float"], dtype=np.float32)
    assert got.shape == (2, 16)
    assert min_cos(got[:1], want_image[:1, :16]) >= 0.99999 and min_cos(got[1:], want_text[:, :16]) >= 0.99999
    # refusals: images without input_type image, an image and a text in one input, a bomb
    r = post(clip_server, {"images": urls[:1], "input_type": "search_query"}, "/v2/embed")
    assert r.status_code == 400 and 'input_type "image"' in r.json()["error"]["message"]
    mixed = [
        {"content": [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": urls[0]}}]}
    ]
    r = post(clip_server, {"inputs": mixed}, "/v2/embed")
    assert r.status_code == 400 and "one image per input" in r.json()["error"]["message"]
    r = post(
        clip_server, {"images": [data_url(png_claiming(10000, 10000))], "input_type": "image"}, "/v2/embed"
    )
    assert r.status_code == 400 and "--max-image-pixels" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "images"


def test_python_api_encodes_pil_images_paths_and_bytes(clip_path, tmp_path):
    """Embedder.encode of PIL images (as the processor takes them), bytes and paths (as load_image
    decodes them), alone and beside texts, equals transformers."""
    from embed_service import Embedder

    picture = shapes(70, 50).convert("RGBA")
    data = encode(picture, "PNG")
    (tmp_path / "p.png").write_bytes(data)
    model = T.AutoModel.from_pretrained(str(clip_path), dtype=torch.float32).eval()
    processor = T.AutoImageProcessor.from_pretrained(str(clip_path))
    with torch.inference_mode():
        from_pil = model.get_image_features(
            **processor(images=picture, return_tensors="pt")
        ).pooler_output.numpy()
        decoded = processor(images=load_image(str(tmp_path / "p.png")), return_tensors="pt")
        from_file = model.get_image_features(**decoded).pooler_output.numpy()
    want_text, _ = reference(clip_path, ["a photo"], [data])
    with Embedder(str(clip_path), dtype="float32") as e:
        one = e.encode(picture)
        assert one.shape == (40,)
        assert min_cos(one[None], from_pil) >= 0.99999
        mixed = e.encode(["a photo", picture, data, tmp_path / "p.png"])
    assert min_cos(mixed[:1], want_text) >= 0.99999
    assert min_cos(mixed[1:2], from_pil) >= 0.99999
    assert min_cos(mixed[2:], np.repeat(from_file, 2, 0)) >= 0.99999
