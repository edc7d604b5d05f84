"""launch.py: flags and the error path (no model weights are loaded)."""
from __future__ import annotations

import launch


def test_defaults_are_local_and_private():
    args = launch.parse_args([])
    assert args.host == "127.0.0.1" and args.share is False and args.inbrowser is False
    assert (args.target, args.draft, args.device, args.dtype) == ("default-target", "default-draft", "cpu", "float32")
    assert args.offline is False and args.trust_remote_code is False
    assert args.models_dir and args.offload is False
    args = launch.parse_args(["--port", "8000", "--share", "--offline", "--tree-size", "16", "--depth", "5"])
    assert (args.port, args.share, args.offline, args.tree_size, args.depth) == (8000, True, True, 16, 5)


def test_a_missing_model_exits_2_with_one_line(monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # recorded, so the --offline that main() sets is undone
    code = launch.main(["--offline", "--target", "sequoia-test-org/missing", "--draft", "sequoia-test-org/missing2"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "sequoia-test-org/missing" in err and len(err.splitlines()) == 1


def test_ui_policy_follows_the_flags(tmp_path):
    policy = launch.worker_policy(launch.parse_args(["--models-dir", str(tmp_path)]))
    assert policy == {"models_dir": tmp_path, "allow_remote_code": False, "draft_format": "auto",
                      "draft_vocabulary": "auto", "kv_cache_bytes": 1 << 30}
    # --trust-remote-code is for the launch pair: the Models panel needs its own, explicit flag
    assert launch.worker_policy(launch.parse_args(["--trust-remote-code"]))["allow_remote_code"] is False
    assert launch.worker_policy(launch.parse_args(["--models-panel-remote-code"]))["allow_remote_code"] is True
    assert launch.worker_policy(launch.parse_args(["--draft-format", "int8"]))["draft_format"] == "int8"
    assert launch.worker_policy(launch.parse_args(["--draft-vocab", "0"]))["draft_vocabulary"] == "0"


def test_the_conversation_cache_budget_flag():
    from engine.core.prefix_cache import DEFAULT_BUDGET_BYTES
    assert launch.worker_policy(launch.parse_args([]))["kv_cache_bytes"] == DEFAULT_BUDGET_BYTES
    assert launch.worker_policy(launch.parse_args(["--kv-cache-mb", "64"]))["kv_cache_bytes"] == 64 << 20
    assert launch.worker_policy(launch.parse_args(["--kv-cache-mb", "0"]))["kv_cache_bytes"] == 0


def test_the_app_imports_gradio_without_its_stub_writer():
    """In a fresh interpreter, importing the app swaps Gradio's type-stub writer for a no-op before
    any component class exists, and Gradio's components still build."""
    import subprocess
    import sys

    script = (
        "import app, gradio, gradio.component_meta as meta, app.page.gradio_stubs as stubs\n"
        "assert meta.create_or_modify_pyi is stubs._write_no_stub\n"
        "assert not any(isinstance(f, stubs._StubWriterSwap) for f in sys.meta_path)\n"
        "assert gradio.Textbox(label='x').label == 'x'\n"
    )
    done = subprocess.run([sys.executable, "-c", "import sys\n" + script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_app_process_switches_the_gil_every_half_millisecond(monkeypatch):
    """launch.main shortens the GIL's switch interval before anything else runs, so the engine
    thread waits at most that long for the GIL after each torch op while Gradio's threads work
    (0.9x of headless decoding at Python's default 5 ms, 1.0x at 0.5 ms)."""
    import sys

    import launch
    from engine.errors import EngineError

    def refuse(args):
        raise EngineError("no models in this test")

    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)  # Python's default (another test's main() may have set it already)
    monkeypatch.setattr(launch, "build_worker", refuse)
    try:
        assert launch.main([]) == 2
        assert sys.getswitchinterval() == launch.GIL_SWITCH_INTERVAL_S
    finally:
        sys.setswitchinterval(before)


def test_serving_beyond_this_machine_needs_an_api_key(tmp_path, capsys):
    """--host 0.0.0.0 (or a LAN address) and --share refuse to start without a key, before any model
    loads; --api-key or --api-key-file (its first line) lets them."""
    import pytest

    for argv in (["--host", "0.0.0.0"], ["--host", "192.168.1.20"], ["--share"]):
        with pytest.raises(SystemExit, match="--api-key"):
            launch.main(argv + ["--tiny"])
    assert launch.check_exposure(launch.parse_args(["--host", "0.0.0.0"]), "k") is None
    assert launch.check_exposure(launch.parse_args(["--host", "localhost"]), None) is None
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\nignored\n")
    assert launch.api_key(launch.parse_args(["--api-key-file", str(key_file)])) == "s3cret"
    assert launch.api_key(launch.parse_args(["--api-key", " k "])) == "k"
    assert launch.api_key(launch.parse_args([])) is None
    for argv, message in ((["--api-key", "a", "--api-key-file", str(key_file)], "not both"),
                          (["--api-key-file", str(tmp_path / "missing")], "cannot read"),
                          (["--api-key", "  "], "empty")):
        with pytest.raises(SystemExit, match=message):
            launch.api_key(launch.parse_args(argv))


def test_the_models_panel_is_off_beyond_loopback_unless_asked_for():
    """Whoever reaches the page could load (download) any repository through the Models panel."""
    panel = lambda *argv: launch.models_panel(launch.parse_args(list(argv)))  # noqa: E731
    assert panel() and panel("--host", "localhost") and panel("--host", "::1")
    assert not panel("--host", "0.0.0.0") and not panel("--host", "192.168.1.20") and not panel("--share")
    assert panel("--host", "0.0.0.0", "--models-panel") and panel("--share", "--models-panel")


def test_the_connection_limit_flags():
    import pytest

    from app.web.server_limits import ServerLimits
    assert launch.server_limits(launch.parse_args([])) == ServerLimits()
    limits = launch.server_limits(launch.parse_args(["--header-timeout", "2.5", "--body-timeout", "7",
                                                    "--max-connections", "50"]))
    assert (limits.header_timeout_s, limits.body_timeout_s, limits.max_connections) == (2.5, 7, 50)
    for flag in ("--header-timeout", "--body-timeout", "--max-connections"):
        with pytest.raises(SystemExit, match=f"{flag} must be positive"):
            launch.server_limits(launch.parse_args([flag, "0"]))


def test_binding_every_interface_lists_this_machines_addresses(monkeypatch):
    from app.web import host_guard
    monkeypatch.setattr(host_guard, "reachable_addresses", lambda: ["192.168.1.23", "2001:db8::5"])
    line = launch.other_machines_line("0.0.0.0", "http://localhost:7861/")
    assert "http://192.168.1.23:7861/" in line and "http://[2001:db8::5]:7861/" in line
    assert launch.other_machines_line("::", "http://localhost:7861/") == line
    assert launch.other_machines_line("127.0.0.1", "http://127.0.0.1:7861/") is None


def test_a_stored_profile_the_launch_disagrees_with_is_measured_again():
    """The host got faster or slower since this machine's profile was stored: the launch's own
    target-alone rate says so, and the app measures the profile again (in the background)."""
    from engine.tuning.optimizer import AutoTuner
    from engine.tuning.profile import HardwareProfile

    profile = HardwareProfile("cpu", "pair", "float32", 128, target={1: 0.030, 2: 0.032, 4: 0.036},
                              draft={1: 0.010, 2: 0.011})
    stored = AutoTuner(profile, {(0.0, 1.0): [0.8, 0.1]}, origin="this machine")
    assert launch.stale_profile(stored, 1 / 0.030) == ""             # agrees
    assert launch.stale_profile(stored, 1 / 0.032) == ""             # within the margin
    assert "measured at launch" in launch.stale_profile(stored, 1 / 0.020)  # the host is faster now
    assert "measured at launch" in launch.stale_profile(stored, 1 / 0.045)  # ... or slower
    assert launch.stale_profile(stored, None) == ""                  # nothing measured at launch
    bundled = AutoTuner(profile, {(0.0, 1.0): [0.8, 0.1]}, origin="bundled, measured on x")
    assert launch.stale_profile(bundled, 1 / 0.020) == ""            # not this machine's: measured anyway
