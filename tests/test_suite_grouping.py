"""The suite's own scheduling: under ``pytest -n 2 --dist loadgroup`` (``make test``) every test of
the real pair runs in one worker, so the pair is never loaded twice at a time on a 24 GiB machine.
pytest-xdist groups by renaming items; a pytest that ignores the renaming (9.x with xdist 3.8)
spreads the group over both workers and two copies of the models exhaust the memory."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

SAMPLE_TESTS = '''
import os, time
import pytest

def record(name):
    with open(os.environ["GROUPING_LOG"], "a") as f:
        f.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')} {name}\\n")

@pytest.mark.real_pair
@pytest.mark.parametrize("i", range(6))
def test_real(i):
    record("real")
    time.sleep(0.1)

@pytest.mark.parametrize("i", range(6))
def test_tiny(i):
    record("tiny")
    time.sleep(0.1)
'''


def test_real_pair_tests_share_one_worker(tmp_path):
    pytest.importorskip("xdist")
    (tmp_path / "conftest.py").write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('suite_conftest', {str(TESTS / 'conftest.py')!r})\n"
        "suite = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(suite)\n"
        "pytest_configure = suite.pytest_configure\n"
        "pytest_collection_modifyitems = suite.pytest_collection_modifyitems\n")
    (tmp_path / "test_sample.py").write_text(SAMPLE_TESTS)
    log = tmp_path / "workers.log"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider",
                           str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "GROUPING_LOG": str(log),
                               "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])})
    assert done.returncode == 0, done.stdout + done.stderr
    runs = [line.split() for line in log.read_text().splitlines()]
    real_workers = {worker for worker, kind in runs if kind == "real"}
    assert len([1 for _, kind in runs if kind == "real"]) == 6
    assert len(real_workers) == 1, f"the real-pair tests ran on {sorted(real_workers)}: --dist loadgroup did not group them"
