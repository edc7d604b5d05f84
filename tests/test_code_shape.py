"""The code's shape: functions a reader can hold in mind (at most 80 lines) and signatures of at
most 8 parameters, ``self`` aside, in the library, the app, the benchmarks and the launcher. What
Gradio itself fixes is exempt: the page's layout, and the three chat events to which Gradio hands the
sidebar's components one by one."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXEMPT_LENGTH = {("app/page/ui.py", "build")}  # Gradio's layout: one component after another
EXEMPT_WIDTH = {("app/page/handlers.py", "respond"), ("app/page/handlers.py", "regenerate"),
                ("app/page/handlers.py", "edit_message")}


def functions():
    paths = [p for top in ("engine", "app", "bench") for p in (ROOT / top).rglob("*.py")] + [ROOT / "launch.py"]
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield str(path.relative_to(ROOT)), node


def parameters(node) -> int:
    a = node.args
    named = [x for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
    return len(named) + (a.vararg is not None) + (a.kwarg is not None)


def test_no_function_is_longer_than_80_lines():
    long = [f"{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path, node in functions()
            if node.end_lineno - node.lineno + 1 > 80 and (path, node.name) not in EXEMPT_LENGTH]
    assert long == []


def test_no_signature_has_more_than_8_parameters():
    wide = [f"{path}:{node.lineno} {node.name} ({parameters(node)})" for path, node in functions()
            if parameters(node) > 8 and (path, node.name) not in EXEMPT_WIDTH]
    assert wide == []
