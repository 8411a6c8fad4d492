"""Where ``--model`` points: a local folder, a Hugging Face cache folder, or a Hugging Face repo id.

- A model folder (config.json and weights) is served as it is.
- A cache folder (``models--org--name``, as ``huggingface_hub`` lays out ``$HF_HUB_CACHE``) resolves to its
  snapshot of ``--revision`` (a branch or tag under ``refs/``, or a commit), ``main`` by default.
- Anything else that is a valid repo id (``BAAI/bge-small-en-v1.5``) is looked up in the local cache first,
  with no network; when it is missing there it is downloaded, unless ``HF_HUB_OFFLINE`` is set. Only what
  the server reads is fetched (configs, tokenizer, safetensors weights; ``pytorch_model*.bin`` only where a
  repo has no safetensors), not ONNX or OpenVINO exports.

``huggingface_hub`` (a dependency of transformers) does the lookups, so the cache is shared with every other
tool that uses it and ``HF_HOME``, ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``, ``HF_ENDPOINT`` and ``HF_TOKEN``
mean what they mean there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# What the loader and the tokenizer read; "*" matches across "/" (1_Pooling/config.json).
CONFIG_PATTERNS = ["*.json", "*.txt", "*.model", "*.tiktoken"]
WEIGHT_PATTERNS = (["*.safetensors"], ["pytorch_model*.bin"])
CACHE_PREFIX = "models--"


@dataclass(frozen=True)
class ModelSource:
    """A folder to load and the name the model is served under unless ``--served-model-name`` says otherwise."""

    path: Path
    name: str


class ModelSourceError(ValueError):
    """``--model`` names nothing that can be served; the message says what was tried."""


def resolve_model(model: str, revision: str | None = None, cache_dir: Path | None = None) -> ModelSource:
    """``--model`` (and ``--revision``) to a local folder; ``cache_dir`` overrides ``$HF_HUB_CACHE``."""
    revision = revision or None  # EMBED_REVISION="" (an image built without a revision) means main
    path = Path(model).expanduser()
    if path.is_dir():
        if path.name.startswith(CACHE_PREFIX) and (path / "snapshots").is_dir():
            return ModelSource(_snapshot(path, revision), _repo_id(path.name))
        if revision is not None:
            raise ModelSourceError(
                f"--revision {revision}: {model} is a plain folder; a revision applies to a Hugging Face "
                "repo id or cache folder (models--org--name)"
            )
        # The name as the user wrote it (a symlink's own name), else the resolved folder's ("." -> its name).
        return ModelSource(path, path.name or path.resolve().name)
    if not _is_repo_id(model):
        raise ModelSourceError(
            f"model {model} (--model / EMBED_MODEL): no such directory, and not a Hugging Face repo id"
        )
    return ModelSource(_from_hub(model, revision, cache_dir), model)


def _repo_id(folder: str) -> str:
    # huggingface_hub names a repo's folder models--{repo_id with "/" as "--"}; repo ids never hold "--".
    return folder[len(CACHE_PREFIX) :].replace("--", "/")


def _snapshot(cache_folder: Path, revision: str | None) -> Path:
    revision = revision or "main"
    ref = cache_folder / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = cache_folder / "snapshots" / commit
    if not snapshot.is_dir():
        have = (
            sorted(p.name for p in (cache_folder / "refs").glob("*"))
            if (cache_folder / "refs").is_dir()
            else []
        )
        raise ModelSourceError(
            f"--model {cache_folder}: no snapshot for revision {revision} "
            f"(refs: {', '.join(have) or 'none'}; snapshots: "
            f"{', '.join(sorted(p.name for p in (cache_folder / 'snapshots').iterdir())) or 'none'})"
        )
    return snapshot


def _is_repo_id(name: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _from_hub(repo_id: str, revision: str | None, cache_dir: Path | None) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    where = cache_dir or Path(constants.HF_HUB_CACHE)
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    if constants.HF_HUB_OFFLINE:
        raise ModelSourceError(
            f"--model {repo_id}: no such directory, and not in the Hugging Face cache at {where} "
            f"(revision {revision or 'main'}); HF_HUB_OFFLINE is set: download it where the hub is reachable "
            f"(`hf download {repo_id}`) or mount a cache with it"
        )
    try:
        snapshot = Path("")
        for weights in WEIGHT_PATTERNS:
            snapshot = Path(
                snapshot_download(
                    repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=CONFIG_PATTERNS + weights
                )
            )
            if any(snapshot.glob(weights[0])):
                break
        return snapshot
    except Exception as exc:  # the hub's many error kinds (unreachable, gated, not found) read the same here
        raise ModelSourceError(
            f"--model {repo_id}: no such directory, not in the Hugging Face cache at {where}, and "
            f"downloading it failed: {exc}"
        ) from None


def main(argv: list[str] | None = None) -> int:
    """``python -m embed_service.model_source MODEL [REVISION]``: fetch into the cache, print the folder.

    The Dockerfile bakes a model into an image with it, by the same resolution the server does at start-up.
    """
    import sys

    args = sys.argv[1:] if argv is None else argv
    if not 1 <= len(args) <= 2:
        print("usage: python -m embed_service.model_source MODEL [REVISION]", file=sys.stderr)
        return 2
    try:
        source = resolve_model(args[0], args[1] if len(args) > 1 else None)
    except ModelSourceError as exc:
        print(f"embed-service: {exc}", file=sys.stderr)
        return 1
    print(source.path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
