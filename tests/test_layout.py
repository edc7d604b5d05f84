"""The repository's layout: the library under engine/ is grouped by concern into layers that only
import downwards, only command lines import the command-line package, and no module of app/ or
engine/ imports itself back."""
from __future__ import annotations

import ast
import re
import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "engine"
LIBRARY_PACKAGES = {"kernels", "core", "trees", "tuning", "backends", "models"}

# The library's layers, bottom up, and what each package's modules may import besides their own
# package: only packages of lower layers, and of those only the ones it uses (a new arrow is a
# decision, made here). The command lines (cli) stand above them all and may import anything.
LAYERS = ["errors", "user_cache", "kernels", "trees", "core", "backends", "models", "tuning"]
ALLOWED = {
    "errors": set(),
    "user_cache": set(),
    "kernels": {"errors", "user_cache"},
    "trees": {"errors"},
    "core": {"trees", "kernels", "errors"},
    "backends": {"core", "kernels", "errors", "user_cache"},
    "models": {"backends", "errors", "user_cache"},
    "tuning": {"core", "trees", "kernels", "models", "errors", "user_cache"},
}


def engine_imports(path: Path) -> set[str]:
    """The ``engine.*`` modules a file imports. The engine imports absolutely, so a reader (and
    this test) sees which package each name comes from."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0 or ENGINE not in path.parents, f"{path}: relative import"
            if node.module and node.module.split(".")[0] == "engine":
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "engine")
    return found


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "engine" else None


def test_engine_lists_one_folder_per_concern():
    entries = sorted(p.name for p in ENGINE.iterdir() if p.name != "__pycache__")
    assert entries == sorted(["__init__.py", "errors.py", "user_cache.py", "cli", *LIBRARY_PACKAGES])
    for package in [*LIBRARY_PACKAGES, "cli"]:
        assert (ENGINE / package / "__init__.py").read_text().strip(), f"engine/{package} says what it holds"


def test_no_library_module_imports_a_command_line():
    offenders = {}
    for path in ENGINE.rglob("*.py"):
        if path.parent.name == "cli":
            continue
        bad = sorted(m for m in engine_imports(path) if package_of(m) == "cli")
        if bad:
            offenders[str(path.relative_to(ROOT))] = bad
    assert offenders == {}


APP_PACKAGES = {"page", "views", "serving", "api", "web"}


def test_the_app_has_one_folder_per_concern_and_leaves_the_benchmarks_apart():
    """app/ by concern (the page, pure views, the worker, the OpenAI API, web guards), each saying
    what it holds; neither the app nor the library imports the benchmarks (bench/), which import both."""
    app = ROOT / "app"
    assert sorted(p.name for p in app.iterdir() if p.name != "__pycache__") == sorted(["__init__.py", *APP_PACKAGES])
    for package in APP_PACKAGES:
        assert (app / package / "__init__.py").read_text().strip(), f"app/{package} says what it holds"
    graph = import_graph()
    assert not {name: sorted(m for m in used if m.split(".")[0] == "bench") for name, used in graph.items()
                if any(m.split(".")[0] == "bench" for m in used)}
    assert (ROOT / "bench" / "__init__.py").is_file() and not (ENGINE / "peer").exists()


def test_pure_views_import_nothing_of_the_page_the_worker_or_gradio():
    """app/views: step records and plain values in, figures and HTML out."""
    for path in (ROOT / "app" / "views").glob("*.py"):
        text = path.read_text()
        assert "import gradio" not in text and "from gradio" not in text, path
        assert not re.search(r"^\s*from app\.(page|serving|api|web)\b", text, re.M), path


def test_the_app_uses_the_library_not_the_command_lines():
    for path in (ROOT / "app").rglob("*.py"):
        assert not any(package_of(m) == "cli" for m in engine_imports(path)), path


def test_each_command_runs_by_one_name_only():
    """``python -m engine.cli.<tool>`` is the one way to run a command line: the old top-level
    names (``engine.generate``, ...) are gone rather than forwarded."""
    commands = sorted(p.stem for p in (ENGINE / "cli").glob("*.py") if p.stem not in ("__init__", "arguments"))
    assert "generate" in commands
    for tool in commands:
        assert importlib.util.find_spec(f"engine.{tool}") is None, tool


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, known: set[str], root: Path = ROOT) -> set[str]:
    """The modules of ``known`` that ``path`` imports anywhere in it (at the top, in a function or
    under ``TYPE_CHECKING``), relative imports resolved; ``from package import name`` counts as
    importing ``package.name`` when that is a module, else ``package``."""
    name = module_name(path, root)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.update(f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names)
    return (found & known) - {name}


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for top in ("app", "engine") for p in (ROOT / top).rglob("*.py")}
    return {name: imported_modules(path, set(paths)) for name, path in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_cycle_check_finds_a_cycle_through_function_level_and_relative_imports(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from . import b\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    from .c import g\n")
    (tmp_path / "pkg" / "c.py").write_text("import pkg.a\n")
    (tmp_path / "pkg" / "d.py").write_text("from pkg import a\n")
    known = {"pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.d"}
    graph = {module_name(p, tmp_path): imported_modules(p, known, tmp_path) for p in (tmp_path / "pkg").glob("*.py")}
    assert graph["pkg.d"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_no_module_imports_itself_back():
    """No import cycle among the modules of app/ and engine/, counting imports made inside
    functions: each layer stands on the ones below it."""
    assert cycles(import_graph()) == []


def test_the_layers_stand_only_on_the_layers_below():
    """Every import of every library module (at the top, in a function or under ``TYPE_CHECKING``)
    names its own package or one :data:`ALLOWED` to it, and never the package root ``engine``
    (whose lazy names reach every layer). The table itself only points down :data:`LAYERS`. So the
    decoding core, the part a reader learns first, needs trees and the compiled kernels but no
    backend, model, optimizer or command line; the kernels need nothing above the errors and the
    user cache; trees nothing but the errors."""
    assert sorted(ALLOWED) == sorted(LAYERS) == sorted([*LIBRARY_PACKAGES, "errors", "user_cache"])
    for layer, allowed in ALLOWED.items():
        assert allowed <= set(LAYERS[:LAYERS.index(layer)]), (layer, allowed - set(LAYERS[:LAYERS.index(layer)]))
    paths = {module_name(p): p for p in ENGINE.rglob("*.py")}
    upward = {}
    for name, path in sorted(paths.items()):
        layer = package_of(name)
        if layer not in ALLOWED:  # the root and the command lines
            continue
        used = {package_of(module) or module for module in imported_modules(path, set(paths))}
        if used - ALLOWED[layer] - {layer}:
            upward[name] = sorted(used - ALLOWED[layer] - {layer})
    assert upward == {}


def test_the_package_root_imports_nothing_of_the_library():
    """``engine/__init__.py`` has no import statement naming an engine module, anywhere in it (at
    the top or in a function): its names (:data:`engine._HOMES`, read here from its source) each
    load their module on first use, and each names a module file of a library package (never a
    command line). So ``import engine`` loads no subpackage, as a fresh interpreter shows."""
    source = ENGINE / "__init__.py"
    assert engine_imports(source) == set()
    homes = next(ast.literal_eval(node.value) for node in ast.parse(source.read_text()).body
                 if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["_HOMES"])
    for name, home in homes.items():
        assert home.split(".")[0] in ALLOWED and (ENGINE / f"{home.replace('.', '/')}.py").is_file(), (name, home)
    loaded = subprocess.run([sys.executable, "-c", "import engine, sys; print(sorted(m for m in sys.modules "
                             "if m.startswith('engine.')))"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert loaded.stdout.strip() == "[]", loaded.stderr[-2000:]
