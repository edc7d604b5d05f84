"""Import Gradio without its type-stub writer.

Every ``import gradio`` re-derives the ``.pyi`` stub of each of its components: the metaclass of
``gradio.components`` reads the component's source file, parses it, and rewrites the stub next to
it in site-packages (``gradio.component_meta.create_or_modify_pyi``). The stubs serve type
checkers, not the running app, and the work took about 1.3 s of a warm start on 2 cores.
:func:`skip_stub_writer` swaps that function for a no-op as ``gradio.component_meta`` is executed,
before any component class exists. Where a Gradio release renames or drops the function, nothing
is swapped and Gradio imports as it always did.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

MODULE = "gradio.component_meta"
STUB_WRITER = "create_or_modify_pyi"


def _write_no_stub(*args, **kwargs) -> None:
    """Stands in for Gradio's stub writer: the app never reads the stubs."""


class _StubWriterSwap(importlib.abc.MetaPathFinder):
    """Finds ``gradio.component_meta`` as the standard finder does and swaps its stub writer out
    right after the module runs; leaves ``sys.meta_path`` once it has."""

    def find_spec(self, name: str, path=None, target=None):
        if name != MODULE:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run_module = loader.exec_module

        def exec_module(module) -> None:
            run_module(module)
            if callable(getattr(module, STUB_WRITER, None)):
                setattr(module, STUB_WRITER, _write_no_stub)

        loader.exec_module = exec_module
        return spec


def skip_stub_writer() -> None:
    """Make the next ``import gradio`` skip its stub writer (a no-op once Gradio is imported)."""
    if MODULE in sys.modules or any(isinstance(f, _StubWriterSwap) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _StubWriterSwap())
