"""The Triton kernels' folder: installed as embed_service.kernels, never importable as a bare ``kernels``.

Hugging Face's ``kernels`` package has that bare name, and transformers probes for it: Python run from the
repository root (the current directory first on sys.path) found the folder, imported it, and transformers
then took it for Hugging Face's package.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile

from tests.deploy.tools import ROOT

# Whether a regular package `kernels` is found in the repository's folder, whether transformers says
# Hugging Face's kernels is there, and whether the `kernels` it would import is a real install (transformers 5
# depends on it, so a fresh install has it in site-packages).
PROBE = """
import importlib.util, pathlib
from transformers.utils.import_utils import is_kernels_available
spec = importlib.util.find_spec("kernels")
origin = spec.origin if spec is not None else None
ours = origin is not None and pathlib.Path(origin).resolve().is_relative_to(pathlib.Path.cwd().resolve() / "kernels")
installed = origin is not None and "site-packages" in pathlib.Path(origin).parts
print(ours, is_kernels_available(), installed)
from sentence_transformers import SentenceTransformer
"""


def test_transformers_does_not_take_the_folder_for_hugging_faces_kernels():
    """As a user runs it: `python -c` in the repository root, no PYTHONPATH."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(ROOT)}
    r = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    ours, transformers_sees_it, installed = r.stdout.split()
    assert ours == "False", "kernels/ is importable as a regular package `kernels`"
    # transformers sees a `kernels` only where Hugging Face's is installed, never this folder
    assert transformers_sees_it == installed, r.stdout


def test_every_kernel_module_is_part_of_the_installed_package():
    linked = {p.name for p in (ROOT / "src" / "embed_service" / "kernels").glob("*.py")}
    modules = {p.name for p in (ROOT / "kernels").glob("*.py")}
    assert modules and modules | {"__init__.py"} == linked
    assert not (ROOT / "kernels" / "__init__.py").exists()


def test_the_wheel_holds_the_kernels_under_embed_service_only(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            tmp_path,
            ROOT,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    (wheel,) = tmp_path.glob("embed_service-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    kernels = {n for n in names if n.startswith("embed_service/kernels/")}
    assert {f"embed_service/kernels/{m}" for m in ("__init__.py", "norm.py", "rotary.py")} <= kernels
    assert not [n for n in names if n.startswith("kernels/")]
