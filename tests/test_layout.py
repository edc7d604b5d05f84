"""The repository's layout: the library under engine/ is grouped by concern, and only command
lines import the command-line package."""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "engine"
LIBRARY_PACKAGES = {"core", "trees", "tuning", "backends", "models", "peer"}


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


def test_the_app_uses_the_library_not_the_command_lines():
    for path in (ROOT / "app").glob("*.py"):
        assert not any(package_of(m) == "cli" for m in engine_imports(path)), path


def test_the_core_does_not_reach_into_tuning_or_command_lines():
    """The decoding core needs trees but no optimizer, backend or CLI: it is the part a reader
    learns first; and trees need nothing but the errors."""
    for path in (ENGINE / "core").glob("*.py"):
        used = {package_of(m) for m in engine_imports(path)} - {None}
        assert used <= {"core", "trees", "errors"}, (path.name, used)
    for path in (ENGINE / "trees").glob("*.py"):
        used = {package_of(m) for m in engine_imports(path)} - {None}
        assert used <= {"trees", "errors"}, (path.name, used)


def test_each_command_runs_by_one_name_only():
    """``python -m engine.cli.<tool>`` is the one way to run a command line: the old top-level
    names (``engine.generate``, ...) are gone rather than forwarded."""
    commands = sorted(p.stem for p in (ENGINE / "cli").glob("*.py") if p.stem not in ("__init__", "arguments"))
    assert "generate" in commands
    for tool in commands:
        assert importlib.util.find_spec(f"engine.{tool}") is None, tool


def test_figures_and_text_are_pure():
    """The app's figures and text are functions of records and plain values: no Gradio, no worker."""
    for name in ("figures.py", "text.py", "explain_figures.py"):
        tree = ast.parse((ROOT / "app" / name).read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not any(m.split(".")[0] == "gradio" or m in ("worker", "handlers") for m in imported), (name, imported)
