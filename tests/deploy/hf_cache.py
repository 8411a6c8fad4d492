"""A Hugging Face hub cache laid out on disk the way huggingface_hub writes one, from a local model folder."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def lay_out_cache(cache: Path, repo_id: str, model: Path, commits: dict[str, list[str]]) -> Path:
    """``commits``: commit hash -> the refs (branches, tags) pointing at it. Returns models--org--name.

    As huggingface_hub does: snapshot files are relative symlinks into blobs/ (here the blobs link on to the
    model folder's files, so nothing large is copied).
    """
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    for commit, refs in commits.items():
        for file in sorted(model.rglob("*")):
            if not file.is_file():
                continue
            rel = file.relative_to(model)
            blob = repo / "blobs" / hashlib.sha256(str(file).encode()).hexdigest()
            if not blob.exists():
                blob.symlink_to(file.resolve())
            link = repo / "snapshots" / commit / rel
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
        for ref in refs:
            (repo / "refs" / ref).write_text(commit)
    return repo
