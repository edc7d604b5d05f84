"""llama.cpp as a peer (bench/peer/llama_cpp.py, `python -m bench.decode --peer llama.cpp`), without building it:
command lines, the not-built path, parsing of recorded llama.cpp output, and process cleanup. One
test runs the real build on the real GGUF when `make peer` has been run, and skips otherwise."""
from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest
import test_app_support as support

from bench import decode as bench
from bench.peer import llama_cpp as peer
from bench.peer.llama_cpp import PeerConfig, PeerError, PeerResult, PeerRuns, PeerServer

DATA = Path(__file__).parent / "data" / "peer"
TARGET, DRAFT = Path("/models/target.gguf"), Path("/models/draft.gguf")


def configs() -> dict[str, PeerConfig]:
    return {c.name: c for c in peer.peer_configurations()}


def flag(cmd: list[str], name: str) -> str:
    assert cmd.count(name) == 1, f"{name} in {cmd}"
    return cmd[cmd.index(name) + 1]


# ----- command lines -------------------------------------------------------------------------------
def test_configurations_are_target_only_then_speculative():
    names = list(configs())
    assert names[0] == peer.TARGET_ONLY == bench.PEER_TARGET_ONLY
    assert [c.kind for c in configs().values()] == ["server", "server", "server", "speculative"]
    assert [(c.draft_max, c.p_min) for c in configs().values()][1:3] == [(4, 0.0), (4, 0.75)]
    assert configs()["llama.cpp llama-speculative tree np=3 n-max=4"].parallel == 3


def test_target_only_server_command_is_loopback_without_draft():
    cmd = peer.server_command(Path("/bin/llama-server"), configs()[peer.TARGET_ONLY], TARGET, DRAFT, port=8123,
                              threads=2, ctx=4096)
    assert cmd[0] == "/bin/llama-server" and flag(cmd, "-m") == str(TARGET)
    assert flag(cmd, "--host") == "127.0.0.1" and flag(cmd, "--port") == "8123"
    assert flag(cmd, "-t") == "2" and flag(cmd, "-tb") == "2" and flag(cmd, "-c") == "4096" and flag(cmd, "-np") == "1"
    assert "--no-ui" in cmd
    assert not {"-md", "--spec-type", "--spec-draft-n-max"} & set(cmd)


@pytest.mark.parametrize("p_min, shown", [(0.0, "0"), (0.75, "0.75")])
def test_speculative_server_command_names_the_draft_and_its_type(p_min, shown):
    config = configs()[f"llama.cpp draft n-max=4 p-min={shown}"]
    cmd = peer.server_command(Path("llama-server"), config, TARGET, DRAFT, port=9000, threads=2)
    assert flag(cmd, "-md") == str(DRAFT)
    assert flag(cmd, "--spec-type") == "draft-simple"   # -md alone does not speculate in this version
    assert flag(cmd, "--spec-draft-n-max") == "4" and flag(cmd, "--spec-draft-p-min") == shown
    assert flag(cmd, "--spec-draft-threads") == "2" and flag(cmd, "--host") == "127.0.0.1"
    with pytest.raises(ValueError, match="draft GGUF"):
        peer.server_command(Path("llama-server"), config, TARGET, None, port=9000)


def test_llama_speculative_command_drafts_a_tree_with_neutral_samplers(tmp_path):
    config = configs()["llama.cpp llama-speculative tree np=3 n-max=4"]
    cmd = peer.speculative_command(Path("llama-speculative"), config, (TARGET, DRAFT), tmp_path / "p.txt", 32,
                                   (0.6, 0.9, 7), threads=2, ctx=4096)
    assert flag(cmd, "-m") == str(TARGET) and flag(cmd, "-md") == str(DRAFT) and flag(cmd, "-f") == str(tmp_path / "p.txt")
    assert flag(cmd, "-n") == "32" and flag(cmd, "-np") == "3" and flag(cmd, "--spec-draft-n-max") == "4"
    assert flag(cmd, "-t") == "2" and flag(cmd, "--spec-draft-threads") == "2"
    assert (flag(cmd, "--temp"), flag(cmd, "--top-p"), flag(cmd, "--top-k"), flag(cmd, "--min-p")) == ("0.6", "0.9", "0", "0")
    assert flag(cmd, "--seed") == "7" and flag(cmd, "--repeat-penalty") == "1"
    greedy = peer.speculative_command(Path("s"), config, (TARGET, DRAFT), tmp_path / "p.txt", 8)
    assert flag(greedy, "--temp") == "0" and flag(greedy, "--top-p") == "1"
    with pytest.raises(ValueError):
        peer.server_command(Path("s"), config, TARGET, DRAFT, port=1)


def test_completion_request_posts_token_ids_with_neutral_samplers():
    body = peer.completion_request([1, 2, 3], 16, temperature=0.0, top_p=0.9, seed=4)
    assert body["prompt"] == [1, 2, 3] and body["n_predict"] == 16 and body["cache_prompt"] is False
    assert body["temperature"] == 0.0 and body["top_p"] == 1.0 and body["top_k"] == 0 and body["min_p"] == 0.0
    assert body["return_tokens"] is True and body["seed"] == 4 and body["repeat_penalty"] == 1.0
    hot = peer.completion_request([5], 4, temperature=0.6, top_p=0.9)
    assert (hot["temperature"], hot["top_p"], hot["top_k"]) == (0.6, 0.9, 0)


def test_context_holds_prompt_and_answer():
    assert peer.context_size(100, 128) == 4096
    assert peer.context_size(5000, 128) == 5376 and peer.context_size(5000, 128) >= 5000 + 128 + 64


def test_every_flag_exists_in_the_vendored_source():
    """The flag names are version specific: check them against the built source's common/arg.cpp."""
    arg_cpp = peer.peer_dir() / "src" / "common" / "arg.cpp"
    if not arg_cpp.exists():
        pytest.skip("llama.cpp source not unpacked (run `make peer`)")
    source = arg_cpp.read_text()
    server = [peer.server_command(Path("s"), c, TARGET, DRAFT, 1) for c in configs().values() if c.kind == "server"]
    spec = peer.speculative_command(Path("s"), configs()["llama.cpp llama-speculative tree np=3 n-max=4"],
                                    (TARGET, DRAFT), Path("p"), 8)
    flags = {a for cmd in [*server, spec] for a in cmd[1:] if a.startswith("-") and not a[1:2].isdigit()}
    assert flags and all(f'"{f}"' in source for f in flags), sorted(f for f in flags if f'"{f}"' not in source)


def test_ngram_modes_copy_from_the_context_alone_or_beside_the_draft():
    ngram = {c.name: c for c in peer.peer_configurations(ngram=True)}
    assert list(ngram)[0] == peer.TARGET_ONLY
    simple = peer.server_command(Path("s"), ngram["llama.cpp ngram-simple"], TARGET, None, port=1)
    assert flag(simple, "--spec-type") == "ngram-simple" and "-md" not in simple
    assert not ngram["llama.cpp ngram-mod"].uses_draft
    both = ngram["llama.cpp draft-simple,ngram-mod n-max=4 p-min=0.75"]
    cmd = peer.server_command(Path("s"), both, TARGET, DRAFT, port=1)
    assert flag(cmd, "--spec-type") == "draft-simple,ngram-mod" and flag(cmd, "-md") == str(DRAFT) and both.uses_draft
    names = peer.peer_dir() / "src" / "common" / "speculative.cpp"
    if names.exists():  # the mode names are version specific: the built source's table lists them
        source = names.read_text()
        assert all(f'"{mode}"' in source for c in ngram.values() if c.spec_type for mode in c.spec_type.split(","))


def test_bench_command_line_takes_the_code_edit_set_and_copies(monkeypatch):
    seen = {}
    monkeypatch.setattr(bench, "run", lambda plan, out_dir: seen.update(vars(plan)))
    bench.main(["--quick", "--prompt-set", "code-edit", "--copies"])
    assert seen["prompt_set"] == "code-edit" and seen["copies"] is True
    names = [c.name for c in bench.configurations(True, draft=object(), acceptance=[0.5, 0.2], auto=True, copies=True)]
    assert names[0] == "target-only" and "target + copies" in names and "sequoia, optimizer's tree + copies" in names
    from engine.models.prompts import load_prompt_set
    edits = load_prompt_set("code-edit")
    assert len(edits) >= 6 and all("```python" in e["messages"][0]["content"] for e in edits)


# ----- not built ---------------------------------------------------------------------------------------
def test_missing_binaries_name_the_fix(tmp_path, monkeypatch):
    monkeypatch.delenv("SEQUOIA_PEER_BIN", raising=False)
    monkeypatch.setenv("SEQUOIA_CACHE", str(tmp_path / "cache"))
    binaries, reason = peer.peer_binaries()
    assert binaries is None and reason.startswith("llama.cpp peer not built: run `make peer`")
    assert str(tmp_path / "cache" / "peer" / f"llama.cpp-{peer.PEER_VERSION}") in reason
    (tmp_path / "bin").mkdir()
    server = tmp_path / "bin" / "llama-server"
    server.write_text("#!/bin/sh\n")
    server.chmod(0o755)
    binaries, reason = peer.peer_binaries(tmp_path / "bin")
    assert binaries is None and "llama-speculative, llama-bench" in reason and "llama-server" not in reason
    for name in ("llama-speculative", "llama-bench"):
        (tmp_path / "bin" / name).write_text("#!/bin/sh\n")
        (tmp_path / "bin" / name).chmod(0o755)
    binaries, reason = peer.peer_binaries(tmp_path / "bin")
    assert reason == "" and binaries.server == server
    monkeypatch.setenv("SEQUOIA_PEER_BIN", str(tmp_path / "nothing"))
    with pytest.raises(PeerError, match="make peer"):
        peer.run_peer(peer.PeerRequest([[1, 2]], 4), ggufs=(TARGET, DRAFT))


def test_bench_says_peer_not_built_and_goes_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SEQUOIA_PEER_BIN", str(tmp_path / "empty"))
    target, draft = support.tiny_pair()
    report = bench.run(bench.BenchPlan(prompts=1, new_tokens=2, quick=True, peer="llama.cpp"),
                       tmp_path, pair=(target, draft, support.tokenizer()))
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "llama.cpp" in line]
    assert len(lines) == 1 and lines[0].startswith("llama.cpp peer not built: run `make peer`")
    assert report["peer"]["skipped"].startswith("llama.cpp peer not built")
    assert not any(r.get("peer") for r in report["results"]) and report["results"][0]["name"] == "target-only"
    assert all(r["vs_llamacpp_target_only"] is None for r in report["results"])
    assert "vs llama.cpp" not in bench.markdown_table(report)


def test_bench_puts_peer_rows_beside_ours(tmp_path, monkeypatch, capsys):
    """With a (stand-in) built peer, its rows join ours in the JSON, the table and the plot."""
    fake = peer.PeerBinaries(Path("/x/llama-server"), Path("/x/llama-speculative"), Path("/x/llama-bench"))
    monkeypatch.setattr(peer, "peer_binaries", lambda bin_dir=None: (fake, ""))
    seen = {}

    def fake_run_peer(request, configs, binaries, ggufs):
        new_tokens = request.new_tokens
        seen.update(prompts=request.prompts, new_tokens=new_tokens, texts=request.prompt_texts, ggufs=ggufs,
                    binaries=binaries)
        runs = []
        for config, tps in zip(configs, (20.0, 10.0, 14.0, 12.0)):
            r = PeerRuns(config, [PeerResult(config.name, tps, new_tokens, "x", [1] * new_tokens,
                                             draft_tokens=8 if config.uses_draft else None,
                                             draft_accepted=6 if config.uses_draft else None)])
            runs.append(r)
        peer.mark_same_as_target_only(runs)
        return runs

    monkeypatch.setattr(peer, "run_peer", fake_run_peer)
    target, draft = support.tiny_pair()
    report = bench.run(bench.BenchPlan(prompts=1, new_tokens=3, quick=True, peer="llama.cpp", peer_ggufs=(TARGET, DRAFT)),
                       tmp_path, pair=(target, draft, support.tokenizer()))
    assert seen["new_tokens"] == 3 and seen["ggufs"] == (TARGET, DRAFT) and seen["binaries"] == fake
    assert len(seen["prompts"]) == 1 and seen["texts"][0] == support.tokenizer().decode(seen["prompts"][0])
    rows = {r["name"]: r for r in report["results"]}
    assert list(rows)[0] == "target-only" and list(rows)[-4:] == [c.name for c in peer.peer_configurations()]
    assert rows[peer.TARGET_ONLY]["vs_llamacpp_target_only"] == 1.0
    assert rows["llama.cpp draft n-max=4 p-min=0"]["vs_llamacpp_target_only"] == 0.5
    assert rows["target-only"]["vs_llamacpp_target_only"] == pytest.approx(rows["target-only"]["tokens_per_s"] / 20.0)
    assert rows["llama.cpp draft n-max=4 p-min=0"]["draft_acceptance"] == 0.75
    assert rows[peer.TARGET_ONLY]["speedup"] == pytest.approx(20.0 / rows["target-only"]["tokens_per_s"])
    assert report["peer"]["outputs_identical_to_target_only"] is True
    saved = json.loads(next(tmp_path.glob("bench-*.json")).read_text())
    assert saved["results"][-1]["peer"] == "llama.cpp"
    assert "llama.cpp target-only" in next(tmp_path.glob("bench-*.html")).read_text()
    table = bench.markdown_table(report)
    assert "| vs llama.cpp target-only |" in table and "| llama.cpp draft n-max=4 p-min=0 |  | 10.00 |" in table
    assert "llama.cpp outputs identical to llama.cpp target-only: True" in capsys.readouterr().out


def test_the_peer_runs_each_prompt_right_after_ours_and_a_failed_configuration_stops(tmp_path, monkeypatch, capsys):
    """Interleaved per prompt, so that a shared machine's load meets both engines alike; a
    configuration failing on one prompt is left out from then on, the others keep every prompt."""
    fake = peer.PeerBinaries(Path("/x/llama-server"), Path("/x/llama-speculative"), Path("/x/llama-bench"))
    monkeypatch.setattr(peer, "peer_binaries", lambda bin_dir=None: (fake, ""))
    calls = []

    def fake_run_peer(request, configs, binaries, ggufs):
        order = request.order
        print(f"peer {order}", flush=True)
        calls.append(([c.name for c in configs], order))
        runs = []
        for config in configs:
            failing = config.kind == "speculative" and order == [(0, 0)]
            runs.append(PeerRuns(config, [] if failing else [PeerResult(config.name, 10.0 + order[0][1], 2, "x", [1, 2])],
                                 error="GGML_ASSERT" if failing else None))
        return runs

    monkeypatch.setattr(peer, "run_peer", fake_run_peer)
    target, draft = support.tiny_pair()
    report = bench.run(bench.BenchPlan(prompts=2, new_tokens=2, quick=True, peer="llama.cpp", peer_ggufs=(TARGET, DRAFT)),
                       tmp_path, pair=(target, draft, support.tokenizer()))
    names = [c.name for c in peer.peer_configurations()]
    tree = next(c.name for c in peer.peer_configurations() if c.kind == "speculative")
    assert calls == [(names, [(0, 0)]), ([n for n in names if n != tree], [(0, 1)])]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("prompt", "peer"))]
    assert [line.split(":")[0] if line.startswith("prompt") else line for line in lines] == \
        ["prompt 0"] * (len(lines) // 2 - 1) + ["peer [(0, 0)]"] + ["prompt 1"] * (len(lines) // 2 - 1) + ["peer [(0, 1)]"]
    rows = {r["name"]: r for r in report["results"]}
    assert tree not in rows and report["peer"]["failed"] == {tree: "GGML_ASSERT"}
    assert rows[peer.TARGET_ONLY]["runs_tokens_per_s"] == [10.0, 11.0]
    assert report["peer"]["outputs_identical_to_target_only"] is True


def test_bench_command_line_takes_the_peer(monkeypatch):
    seen = {}
    monkeypatch.setattr(bench, "run", lambda plan, out_dir: seen.update(vars(plan)))
    bench.main(["--quick", "--peer", "llama.cpp"])
    assert seen["peer"] == "llama.cpp"
    bench.main(["--quick"])
    assert seen["peer"] is None
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--peer", "vllm"])


# ----- parsing recorded output ---------------------------------------------------------------------------
def test_parse_recorded_server_completion():
    response = json.loads((DATA / "server-completion.json").read_text())
    result = peer.parse_completion(response, "target")
    assert result.tokens_per_s == response["timings"]["predicted_per_second"] > 0
    assert result.tokens == response["timings"]["predicted_n"] == len(result.token_ids) > 0
    assert result.text == response["content"] and result.text
    assert result.draft_tokens is None


def test_parse_recorded_speculative_server_completion():
    response = json.loads((DATA / "server-completion-draft.json").read_text())
    result = peer.parse_completion(response, "draft")
    assert result.tokens_per_s > 0 and result.draft_tokens > 0 and 0 <= result.draft_accepted <= result.draft_tokens


def test_parse_recorded_llama_speculative_output():
    stdout = (DATA / "speculative.stdout").read_text()
    stderr = (DATA / "speculative.stderr").read_text()
    prompt = (DATA / "prompt.txt").read_text()
    result = peer.parse_speculative_output(stdout, stderr, prompt, "tree")
    expected = json.loads((DATA / "speculative-expected.json").read_text())
    assert result.tokens_per_s == pytest.approx(expected["tokens_per_s"]) and result.tokens == expected["tokens"]
    assert result.text == expected["text"] and not result.text.startswith(prompt)
    assert result.draft_tokens == expected["draft_tokens"] and result.draft_accepted == expected["draft_accepted"]


def test_unreadable_output_is_a_one_line_error():
    with pytest.raises(PeerError, match="no decode speed"):
        peer.parse_speculative_output("hello", "error: something else")
    with pytest.raises(PeerError, match="without timings"):
        peer.parse_completion({"error": "x"})


def test_greedy_outputs_compared_with_target_only():
    c = peer.peer_configurations()
    runs = [PeerRuns(c[0], [PeerResult("a", 1, 2, "ab", [1, 2])]), PeerRuns(c[1], [PeerResult("b", 1, 2, "ab", [1, 3])]),
            PeerRuns(c[3], [PeerResult("d", 1, 3, "abc")])]   # llama-speculative: text only, may overshoot
    peer.mark_same_as_target_only(runs)
    assert [r.identical_to_target_only() for r in runs] == [True, False, True]
    runs[2].results[0].text = "ax"
    peer.mark_same_as_target_only(runs)
    assert runs[2].identical_to_target_only() is False


# ----- processes ------------------------------------------------------------------------------------------
STUBBORN_SERVER = textwrap.dedent("""
    import http.server, signal, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)   # only SIGKILL stops it
    mode, port = sys.argv[1], int(sys.argv[2])
    if mode == "exit":
        print("boom: cannot load model", flush=True)
        sys.exit(3)
    if mode == "silent":
        time.sleep(600)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
""")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture
def stub(tmp_path) -> Path:
    path = tmp_path / "stub_server.py"
    path.write_text(STUBBORN_SERVER)
    return path


def test_server_is_killed_when_the_block_fails(stub):
    port = peer.free_port()
    with pytest.raises(RuntimeError, match="inside"):
        with PeerServer([sys.executable, str(stub), "serve", str(port)], port, startup_timeout_s=30, grace_s=0.5) as s:
            pid = s.process.pid
            assert s.process.poll() is None
            raise RuntimeError("inside")
    assert s.process.returncode is not None and _gone(pid)


def test_server_that_never_gets_ready_is_stopped_after_the_timeout(stub):
    port = peer.free_port()
    server = PeerServer([sys.executable, str(stub), "silent", str(port)], port, startup_timeout_s=1.0, grace_s=0.5)
    with pytest.raises(PeerError, match="not ready after 1 s"):
        server.__enter__()
    assert server.process.returncode is not None and _gone(server.process.pid)


def test_server_that_exits_reports_its_log(stub):
    port = peer.free_port()
    with pytest.raises(PeerError, match=r"exited with code 3.*boom: cannot load model"):
        with PeerServer([sys.executable, str(stub), "exit", str(port)], port, startup_timeout_s=30):
            pass


def test_command_past_its_timeout_is_killed(stub):
    with pytest.raises(PeerError, match="still running after 1 s"):
        peer.run_command([sys.executable, str(stub), "silent", "0"], timeout_s=1.0, grace_s=0.5)


# ----- the real build (skipped unless `make peer` has been run) -----------------------------------------
def test_real_target_only_decodes(tmp_path):
    binaries, reason = peer.peer_binaries()
    if binaries is None:
        pytest.skip(reason)
    from engine.models.loading import DEFAULT_DRAFT, DEFAULT_TARGET
    from engine.user_cache import cache_dir
    ggufs = tuple(cache_dir() / "gguf" / s.filename for s in (DEFAULT_TARGET, DEFAULT_DRAFT))
    if not ggufs[0].exists():
        pytest.skip(f"{ggufs[0]} not assembled yet (any `make run` or `make test` assembles it)")
    prompt = json.loads((DATA / "prompt-ids.json").read_text())
    (runs,) = peer.run_peer(peer.PeerRequest([prompt], 8), configs=[peer.peer_configurations()[0]], binaries=binaries,
                            ggufs=ggufs,
                            log=lambda *a, **k: None)
    (result,) = runs.results
    assert result.tokens_per_s > 0 and 0 < result.tokens <= 8 and result.token_ids and result.text


def test_a_failing_configuration_costs_only_its_own_rows(tmp_path):
    """llama-speculative crashing (as this version does at T > 0 with some drafts) is reported on its
    configuration; the server configurations before it keep their figures."""
    crashing = tmp_path / "llama-speculative"
    crashing.write_text("#!/bin/sh\necho 'GGML_ASSERT(logits != nullptr) failed' >&2\nexit 134\n")
    crashing.chmod(0o755)
    binaries = peer.PeerBinaries(Path("/nonexistent/llama-server"), crashing, Path("/nonexistent/llama-bench"))
    configs = [peer.PeerConfig("tree", kind="speculative", draft_max=4, parallel=3),
               peer.PeerConfig("server", kind="server")]
    runs = peer.run_peer(peer.PeerRequest([[1, 2, 3]], 4, 0.6, 0.9, prompt_texts=["hi"]), configs=configs, binaries=binaries,
                         ggufs=(tmp_path / "t.gguf", tmp_path / "d.gguf"), log=lambda *a, **k: None)
    assert [r.name for r in runs] == ["tree", "server"]
    assert "exited with code 134" in runs[0].error and "GGML_ASSERT" in runs[0].error
    assert runs[1].error and "llama-server" in runs[1].error  # a missing binary is that configuration's error
    assert all(r.results == [] for r in runs)
