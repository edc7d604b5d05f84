"""The engine's thread keeps the only OpenMP team in the app. libgomp gives each thread that runs a
parallel region a team of its own, kept until that thread ends; once more OpenMP threads live than
there are cores, every waiting thread sleeps almost at once, the engine's too (thousands of sleeps a
second in the app, each a chance for the browser to take the core). So the work the UI threads do
(the tree optimizer's dynamic program) starts no team, and the models load on a thread that ends.
Each check lists the process's native threads with torch set to 2 threads: the old code left one more."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from engine.trees import dp
from launch import on_a_passing_thread


def native_threads() -> set[int]:
    """The process's threads that Python did not start (OpenMP's among them), by thread id."""
    python = {thread.native_id for thread in threading.enumerate()}
    return {int(tid) for tid in os.listdir("/proc/self/task")} - python


def settled(expected: set[int], timeout_s: float = 5.0) -> set[int]:
    """``native_threads()`` once it equals ``expected``, or after ``timeout_s`` (a thread that
    ended a moment ago may still be listed)."""
    deadline = time.monotonic() + timeout_s
    while native_threads() != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return native_threads()


@pytest.fixture
def two_torch_threads():
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("needs /proc to count threads")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def on_a_new_thread(function):
    """Native threads alive before and after ``function()``, counted on a fresh thread (as a UI handler
    thread of the app would run it)."""
    counts = {}

    def run() -> None:
        counts["before"] = native_threads()
        function()
        counts["after"] = native_threads()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return counts["before"], counts["after"]


def test_a_large_torch_op_off_the_main_thread_starts_a_team(two_torch_threads):
    """The premise: without this, the checks below could not fail."""
    before, after = on_a_new_thread(lambda: torch.ones(1 << 20).mul(2).sum())
    assert len(after - before) == 1


def test_the_tree_optimizers_dynamic_program_starts_no_team(two_torch_threads):
    table = None

    def solve() -> None:
        nonlocal table
        table = dp.solve([0.6, 0.2, 0.1, 0.05], 256, 12)  # [257, 257] candidates: past torch's grain

    before, after = on_a_new_thread(solve)
    assert after - before == set()
    assert table.best.dtype == torch.float64 and table.split.dtype == torch.long
    assert dp.optimal_parents(table, 256, 12)[0] == -1


def test_loading_on_a_passing_thread_leaves_no_team_behind(two_torch_threads):
    before = native_threads()
    assert on_a_passing_thread(lambda n: float(torch.ones(n).mul(2).sum()), 1 << 20) == 2.0 * (1 << 20)
    assert settled(before) - before == set()
    with pytest.raises(ValueError, match="bad id"):
        on_a_passing_thread(lambda: (_ for _ in ()).throw(ValueError("bad id")))


def test_the_roofline_measures_this_machine_leaving_no_team_on_the_calling_thread(two_torch_threads, monkeypatch):
    """Why this tree's limits (bandwidth, int8 roof) are measured with large torch ops; asked from a
    UI handler's thread (after an answer) they must not leave that thread a team."""
    from engine.tuning import roofline

    monkeypatch.setattr(roofline, "_measured", {})
    monkeypatch.setattr(roofline, "measure_machine", lambda: roofline.MachineLimits(
        float(torch.ones(1 << 22).mul(2).sum()) / (1 << 22), 1.0, "now", "int8", torch.get_num_threads()))
    limits = {}
    before, after = on_a_new_thread(lambda: limits.setdefault("first", roofline.machine_limits()))
    assert limits["first"].bandwidth_gbs == 2.0
    assert settled(before) - before == set()
    assert roofline.machine_limits() is limits["first"]  # once per process
