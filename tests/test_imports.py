"""The package's imports go one way: no module imports, at its top or inside a function, a module that
imports it back (directly or around a circle); and an HTTP front-end process loads no torch."""

from __future__ import annotations

import ast
import json
import pickle
import subprocess
import sys
from pathlib import Path

import embed_service
from embed_service.engine.tokenizer import Tokenizer
from embed_service.models.spec import load_spec
from embed_service.server import default_model_path

SRC = Path(embed_service.__file__).resolve().parent


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """Each module's imports of the package's modules, wherever in the file they stand (a package's
    ``__init__`` is not counted as imported by its submodules: Python runs it first either way)."""
    modules = {module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
        graph[name] = {m for m in found if m in modules and m != name and not name.startswith(m + ".")}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_not_even_through_function_level_imports():
    graph = imports()
    assert "embed_service.frontends.host" in graph["embed_service.server"]  # the walk sees the package
    assert circles(graph) == []


def test_a_front_end_loads_no_torch():
    spec = load_spec(default_model_path(), None)
    files = Tokenizer(spec).files()  # as the engine process sends them
    code = (
        "import json, pickle, sys\n"
        "from embed_service.frontends import frontend\n"
        "from embed_service.engine.tokenizer import Tokenizer\n"
        "from embed_service.models.spec import load_spec\n"
        "spec, files = pickle.load(sys.stdin.buffer)\n"
        "ids = Tokenizer(spec, files).backend.encode('hello world').ids\n"
        "print(json.dumps([ids, 'torch' in sys.modules, 'transformers' in sys.modules]))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], input=pickle.dumps((spec, files)), capture_output=True, timeout=120
    )
    assert run.returncode == 0, run.stderr.decode()
    ids, torch, transformers = json.loads(run.stdout)
    assert not torch and not transformers
    assert ids == Tokenizer(spec).backend.encode("hello world").ids  # the engine's tokenizer, rebuilt


def test_the_http_layer_imports_nothing_from_the_workers():
    # A function-level import counts: it loads torch into whatever process runs it.
    graph = imports()
    api = [m for m in graph if m == "embed_service.api" or m.startswith("embed_service.api.")]
    assert "embed_service.api.routes" in api
    reached = {m: sorted(w for w in graph[m] if w.startswith("embed_service.workers")) for m in api}
    assert {m: ws for m, ws in reached.items() if ws} == {}


def test_the_python_api_and_the_requests_package_import_nothing_from_the_http_layer():
    """What HTTP and in-process callers share (request models, options, encodings) is below both."""
    graph = imports()
    shared = [m for m in graph if m == "embed_service.requests" or m.startswith("embed_service.requests.")]
    callers = ["embed_service.embedder", "embed_service.offline", *shared]
    reached = {
        m: sorted(w for w in graph[m] if w.split(".")[:2] == ["embed_service", "api"]) for m in callers
    }
    assert {m: ws for m, ws in reached.items() if ws} == {}
    assert "embed_service.requests.embed" in shared  # the walk sees the package


# The files of src/ allowed past MAX_LINES, each with its reason (none now). An entry whose file is back
# under the limit is refused too, so the list says what is true.
MAX_LINES = 500
LONG_FILES: dict[str, str] = {}


def test_no_source_file_is_over_500_lines_but_the_listed_ones():
    lengths = {str(p.relative_to(SRC.parent)): len(p.read_text().splitlines()) for p in SRC.rglob("*.py")}
    over = {path: n for path, n in lengths.items() if n > MAX_LINES}
    assert {path: n for path, n in over.items() if path not in LONG_FILES} == {}
    assert sorted(path for path in LONG_FILES if path not in over) == []
