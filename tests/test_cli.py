"""The command line: bad input gives one line and exit code 2; a real run prints the answer."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine.cli.generate import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "engine.cli.generate", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


TOP_P_OUT_OF_RANGE = (["--prompt", "hi", "--top-p", "1.5"], "top_p")
BAD_INPUT = [
    (["--prompt", "hi", "--tree-size", "0"], "--tree-size"),
    (["--prompt", "   "], "--prompt"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "max_new_tokens"),
    (["--prompt", "hi", "--temperature", "-1"], "temperature"),
    TOP_P_OUT_OF_RANGE,
    (["--prompt", "hi", "--tree-size", "5", "--depth", "7"], "--depth"),
    (["--prompt", "hi", "--method", "beam"], "method"),
    (["--prompt", "hi", "--method", "chain", "--tree-size", "8", "--depth", "3"], "--method chain"),
    (["--prompt", "hi", "--confidence", "1.5"], "confidence"),
]


@pytest.mark.parametrize("args,needle", BAD_INPUT)
def test_bad_input_is_one_line_and_exit_2(args, needle, capsys):
    """Every check, through ``main`` as the command runs it (the process itself: below)."""
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and err.count("\n") == 1


@pytest.mark.parametrize("args,needle", [TOP_P_OUT_OF_RANGE,
                                         (["--prompt", "hi", "--target", "no-such-org/no-such-model"],
                                          "no-such-org/no-such-model")])
def test_the_command_prints_one_line_and_exits_2(args, needle):
    """The process: a bad parameter, and a model id that is not there with the hub offline."""
    proc = run_cli(*args)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and needle in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.real_pair
def test_json_output_on_the_real_pair(real_pair, capsys):
    # in-process: load_model is memoised, so this reuses the session's weights
    assert main(["--prompt", "Reply with only the word yes.", "--max-new-tokens", "8", "--tree-size", "4",
                 "--confidence", "0.5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"].strip().lower().startswith("yes")
    assert out["steps"] and out["tree"]["size"] == 4 and out["finish_reason"] == "stop"
