"""Every package the server imports when a module loads is one `pip install embed-service` installs.

A module-level import of a package that only a dev or test tool brings along works in this repository's
environment and fails on a user's machine at start-up. This reads pyproject.toml's dependencies (and each
extra), follows them through the installed distributions' own requirements, and checks every module-level
import in src/embed_service against that set: a module gated by an extra (the Triton kernels, loaded only on
CUDA) may import that extra's packages too. Imports inside functions are deliberately lazy (optional
extras imported when a feature is used) and are not held to this.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "embed_service"

EXTRA_GATED = {"kernels": "gpu"}
"""Subpackages whose modules load only with an extra, by the extra that brings their imports."""


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _applies(requirement: str) -> bool:
    """A requirement without an extra marker whose environment marker holds here."""
    from packaging.requirements import Requirement

    req = Requirement(requirement)
    if req.marker is None:
        return True
    if "extra" in str(req.marker):
        return False
    return bool(req.marker.evaluate())


def _closure(names: set[str]) -> set[str]:
    """The distributions `names` install, with their own requirements, transitively (as installed here)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        todo.extend(_name(r) for r in requires if _applies(r))
    return seen


def _declared() -> tuple[set[str], dict[str, set[str]]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {_name(r) for r in project["dependencies"] if _applies(r)}
    extras = {k: {_name(r) for r in v} for k, v in project["optional-dependencies"].items()}
    return core, extras


def _module_level_imports(path: Path) -> set[str]:
    """Top-level package names imported at module level: not inside functions, not under TYPE_CHECKING, not
    in a ``try`` that falls back when the import fails (an optional package)."""
    out: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, ast.Try) and any(
            h.type is None or re.search(r"ImportError|ModuleNotFoundError|Exception", ast.unparse(h.type))
            for h in node.handlers
        ):
            continue
        for n in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
            if isinstance(n, ast.Import):
                out.update(a.name.split(".")[0] for a in n.names)
            elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
                out.add(n.module.split(".")[0])
    return {m for m in out if m not in sys.stdlib_module_names and m not in ("embed_service", "__future__")}


def test_every_module_level_import_is_installed_by_the_package_s_own_requirements() -> None:
    core, extras = _declared()
    installed = _closure(core)
    by_module = md.packages_distributions()
    missing: list[str] = []
    for path in sorted(SRC.rglob("*.py")):
        sub = path.relative_to(SRC).parts[0]
        allowed = installed | (_closure(core | extras[EXTRA_GATED[sub]]) if sub in EXTRA_GATED else set())
        for module in sorted(_module_level_imports(path)):
            dists = {d.lower().replace("_", "-") for d in by_module.get(module, [])}
            assert dists, (
                f"{path.relative_to(ROOT)} imports {module}, which no installed distribution provides"
            )
            if not dists & allowed:
                missing.append(f"{path.relative_to(ROOT)}: {module} ({', '.join(sorted(dists))})")
    assert not missing, (
        "imported at module level but not installed by pyproject's dependencies:\n" + "\n".join(missing)
    )
