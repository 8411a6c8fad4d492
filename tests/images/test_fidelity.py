"""The start-up fidelity check of a model that embeds images: one synthetic picture runs through the fast
path and the float32 reference pass beside the texts, so a vision tower that is wrong only in the fast path
keeps the server from becoming ready, and /info's figure counts the picture."""

from __future__ import annotations

import httpx
import numpy as np

from tests.images.test_server import clip_path  # noqa: F401  (the tiny CLIP folder)
from tests.server import ServerProcess, refusal
from tests.workers.test_faults import faults_env


def test_a_vision_tower_broken_in_the_fast_path_is_refused(clip_path):  # noqa: F811
    """Texts untouched, image vectors with every odd feature zeroed outside the reference pass."""
    why = refusal(
        "--model", str(clip_path), "--dtype", "float32", env=faults_env("break-vision"), timeout=180
    )
    assert "fidelity check failed" in why and "1 synthetic image" in why, why
    assert "broken vision (test fault)" in why, why


def test_a_tiny_clip_reports_a_figure_that_counts_the_image(clip_path):  # noqa: F811
    with ServerProcess("--model", str(clip_path), "--dtype", "bfloat16") as server:
        fidelity = httpx.get(server.url + "/info", timeout=30).json()["fidelity"]
    assert fidelity["images"] == 1 and fidelity["inputs"] == 4, fidelity  # 3 texts and the picture
    assert fidelity["passed"] and 0.999 <= fidelity["min_cosine"] <= 1.0, fidelity


def test_the_synthetic_image_is_fixed_and_varied():
    from embed_service.workers.fidelity import check_image

    a, b = np.asarray(check_image((30, 40))), np.asarray(check_image((30, 40)))
    assert a.shape == (30, 40, 3) and np.array_equal(a, b)
    assert len(np.unique(a.reshape(-1, 3), axis=0)) > 100  # not a blank: every patch differs
