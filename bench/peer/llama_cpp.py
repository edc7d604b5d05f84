"""llama.cpp as a peer: the same GGUF files, the same prompt token ids, decoded by llama.cpp.

``make peer`` builds llama.cpp from the source vendored in the ``llama-cpp-python`` sdist
(:data:`PEER_VERSION`, pinned by SHA-256 in ``bench/peer/build.sh``) into the user cache. This
module finds those binaries (:func:`peer_binaries`) and measures llama.cpp's configurations
(:func:`peer_configurations`):

- ``llama-server`` alone on the target (the reference of every "vs llama.cpp" ratio);
- ``llama-server`` speculating with the draft (``--spec-type draft-simple``, a chain of up to
  ``--spec-draft-n-max`` tokens, cut where the draft's probability falls below ``--spec-draft-p-min``);
- the ``llama-speculative`` example, which drafts a tree of ``-np`` branches.

The servers listen on 127.0.0.1 only, on a free port, with ``-t`` threads, and are always shut
down (terminate, then kill after a timeout). The prompt is posted to ``/completion`` as token
ids, so llama.cpp decodes exactly the tokens our engine decodes, with ``cache_prompt`` off and
every sampler but temperature and top-p neutral; the decode rate is the server's own
``timings.predicted_per_second`` (prompt processing excluded). ``llama-speculative`` takes text,
so it gets the prompt's text (special tokens parsed); its rate is the "decoded ... speed" line
it prints.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.errors import EngineError

PEER_VERSION = "0.3.36"           # llama-cpp-python sdist whose vendor/llama.cpp is built
NOT_BUILT = "llama.cpp peer not built: run `make peer`"
HOST = "127.0.0.1"
DEFAULT_THREADS = 2


class PeerError(EngineError):
    """llama.cpp could not be started or its answer could not be read."""


# ----- binaries ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class PeerBinaries:
    server: Path
    speculative: Path
    bench: Path

    def as_dict(self) -> dict[str, str]:
        return {k: str(v) for k, v in asdict(self).items()}


def peer_dir() -> Path:
    """Where ``make peer`` builds: ``<cache>/peer/llama.cpp-<version>`` (sources, build, stamp)."""
    from engine.user_cache import cache_dir
    return cache_dir() / "peer" / f"llama.cpp-{PEER_VERSION}"


def peer_binaries(bin_dir: Path | str | None = None) -> tuple[PeerBinaries | None, str]:
    """``(binaries, "")`` when llama.cpp is built, else ``(None, reason)``.

    ``bin_dir`` (or ``$SEQUOIA_PEER_BIN``) names a directory holding the binaries; by default the
    build of ``make peer``, which counts only once its stamp is written (a build still running or
    interrupted is "not built")."""
    bin_dir = bin_dir or os.environ.get("SEQUOIA_PEER_BIN")
    if bin_dir is None:
        root = peer_dir()
        if not (root / ".built").exists():
            return None, f"{NOT_BUILT} (nothing built in {root})"
        bin_dir = root / "build" / "bin"
    bin_dir = Path(bin_dir)
    paths = {field_: bin_dir / name for field_, name in
             (("server", "llama-server"), ("speculative", "llama-speculative"), ("bench", "llama-bench"))}
    missing = [p.name for p in paths.values() if not (p.is_file() and os.access(p, os.X_OK))]
    if missing:
        return None, f"{NOT_BUILT} (missing in {bin_dir}: {', '.join(missing)})"
    return PeerBinaries(**paths), ""


def default_ggufs() -> tuple[Path, Path]:
    """The embedded pair's GGUF files (assembled from the installed parts once, SHA-256 checked)."""
    from engine.models.loading import DEFAULT_DRAFT, DEFAULT_TARGET, assemble_gguf
    return assemble_gguf(DEFAULT_TARGET), assemble_gguf(DEFAULT_DRAFT)


# ----- configurations and command lines ------------------------------------------------------------
@dataclass(frozen=True)
class PeerConfig:
    """One llama.cpp configuration: ``kind`` "server" (``llama-server``; speculative when
    ``draft_max`` or ``spec_type`` is set) or "speculative" (the ``llama-speculative`` example,
    ``parallel`` draft branches). ``spec_type``: llama-server's ``--spec-type`` list (n-gram modes
    such as ``ngram-simple``, or ``draft-simple,ngram-mod``); default ``draft-simple`` with a draft."""

    name: str
    kind: str = "server"
    draft_max: int | None = None
    p_min: float | None = None
    parallel: int | None = None
    spec_type: str | None = None

    @property
    def uses_draft(self) -> bool:
        return self.kind == "speculative" or self.draft_max is not None


TARGET_ONLY = "llama.cpp target-only"


NGRAM_CONFIGURATIONS = [
    PeerConfig("llama.cpp draft n-max=4 p-min=0.75", draft_max=4, p_min=0.75),
    PeerConfig("llama.cpp ngram-simple", spec_type="ngram-simple"),
    PeerConfig("llama.cpp ngram-mod", spec_type="ngram-mod"),
    PeerConfig("llama.cpp ngram-map-k", spec_type="ngram-map-k"),
    PeerConfig("llama.cpp draft-simple,ngram-mod n-max=4 p-min=0.75", draft_max=4, p_min=0.75,
               spec_type="draft-simple,ngram-mod"),
]


def peer_configurations(ngram: bool = False) -> list[PeerConfig]:
    """Target-only first (the reference of the ratios), then the speculative configurations: the
    draft model's, or with ``ngram`` the draft and llama-server's n-gram modes (drafts copied
    from the context, alone and beside the draft)."""
    if ngram:
        return [PeerConfig(TARGET_ONLY), *NGRAM_CONFIGURATIONS]
    return [PeerConfig(TARGET_ONLY),
            PeerConfig("llama.cpp draft n-max=4 p-min=0", draft_max=4, p_min=0.0),
            PeerConfig("llama.cpp draft n-max=4 p-min=0.75", draft_max=4, p_min=0.75),
            PeerConfig("llama.cpp llama-speculative tree np=3 n-max=4", kind="speculative", draft_max=4, parallel=3)]


def context_size(prompt_tokens: int, new_tokens: int, minimum: int = 4096) -> int:
    """A context holding the prompt, the answer and a draft's overshoot, in steps of 256."""
    need = prompt_tokens + new_tokens + 64
    return max(minimum, -(-need // 256) * 256)


def server_command(binary: Path, config: PeerConfig, target: Path, draft: Path | None, port: int,
                   threads: int = DEFAULT_THREADS, ctx: int = 4096) -> list[str]:
    """``llama-server`` on loopback, one slot, no web UI; with the draft when ``config`` speculates."""
    if config.kind != "server":
        raise ValueError(f"{config.name} is not a llama-server configuration")
    cmd = [str(binary), "-m", str(target), "--host", HOST, "--port", str(port), "-t", str(threads),
           "-tb", str(threads), "-c", str(ctx), "-np", "1", "--no-ui"]
    if config.draft_max is not None:
        if draft is None:
            raise ValueError(f"{config.name} needs the draft GGUF")
        cmd += ["-md", str(draft), "--spec-type", config.spec_type or "draft-simple",
                "--spec-draft-n-max", str(config.draft_max),
                "--spec-draft-p-min", f"{config.p_min or 0.0:g}", "--spec-draft-threads", str(threads),
                "--spec-draft-threads-batch", str(threads)]
    elif config.spec_type is not None:  # n-gram modes: no draft model
        cmd += ["--spec-type", config.spec_type]
    return cmd


def sampling_args(temperature: float, top_p: float, seed: int) -> list[str]:
    """Command-line sampling matching :func:`completion_request`: temperature and top-p only."""
    return ["--temp", f"{temperature:g}", "--top-k", "0", "--top-p", f"{top_p if temperature > 0 else 1.0:g}",
            "--min-p", "0", "--typical", "1", "--repeat-penalty", "1", "--presence-penalty", "0",
            "--frequency-penalty", "0", "--dry-multiplier", "0", "--xtc-probability", "0", "--mirostat", "0",
            "--seed", str(seed)]


def speculative_command(binary: Path, config: PeerConfig, ggufs: tuple[Path, Path], prompt_file: Path,
                        new_tokens: int, sampling: tuple[float, float, int] = (0.0, 1.0, 0),
                        threads: int = DEFAULT_THREADS, ctx: int = 4096) -> list[str]:
    """The ``llama-speculative`` example: a tree of ``parallel`` branches, ``draft_max`` deep, on the
    (target, draft) ``ggufs``; ``sampling``: (temperature, top-p, seed)."""
    if config.kind != "speculative":
        raise ValueError(f"{config.name} is not a llama-speculative configuration")
    target, draft = ggufs
    temperature, top_p, seed = sampling
    return [str(binary), "-m", str(target), "-md", str(draft), "-f", str(prompt_file), "-n", str(new_tokens),
            "-t", str(threads), "-tb", str(threads), "--spec-draft-threads", str(threads),
            "--spec-draft-threads-batch", str(threads), "-c", str(ctx), "-np", str(config.parallel or 1),
            "--spec-draft-n-max", str(config.draft_max or 4), *sampling_args(temperature, top_p, seed)]


def completion_request(prompt_ids: list[int], new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                       seed: int = 0) -> dict:
    """The ``/completion`` body: the prompt as token ids, greedy at temperature 0, else temperature
    and top-p with every other sampler neutral; nothing reused from an earlier request."""
    return {"prompt": [int(t) for t in prompt_ids], "n_predict": int(new_tokens), "temperature": float(temperature),
            "top_k": 0, "top_p": float(top_p) if temperature > 0 else 1.0, "min_p": 0.0, "typical_p": 1.0,
            "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "dry_multiplier": 0.0,
            "xtc_probability": 0.0, "mirostat": 0, "seed": int(seed), "cache_prompt": False,
            "return_tokens": True, "stream": False}


# ----- results and parsing --------------------------------------------------------------------------
@dataclass
class PeerResult:
    """One run of one configuration on one prompt."""

    name: str
    tokens_per_s: float              # decode rate, prompt processing excluded
    tokens: int                      # tokens generated
    text: str
    token_ids: list[int] | None = None   # llama-speculative prints text only
    draft_tokens: int | None = None
    draft_accepted: int | None = None
    same_as_target_only: bool | None = None   # greedy: equal to llama.cpp's own target-only answer


@dataclass
class PeerRuns:
    """All runs of one configuration (prompts x rounds, in the bench's order)."""

    config: PeerConfig
    results: list[PeerResult] = field(default_factory=list)
    error: str | None = None  # why this configuration stopped (its results are then incomplete)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def tokens_per_s(self) -> list[float]:
        return [r.tokens_per_s for r in self.results]

    def median_tokens_per_s(self) -> float:
        return statistics.median(self.tokens_per_s)

    def identical_to_target_only(self) -> bool | None:
        flags = [r.same_as_target_only for r in self.results]
        return None if any(f is None for f in flags) else all(flags)


def parse_completion(response: dict, name: str = "") -> PeerResult:
    """A ``/completion`` answer: decode tokens/s from ``timings``, the tokens and the text."""
    try:
        timings = response["timings"]
        tps = float(timings["predicted_per_second"])
        n = int(timings.get("predicted_n", response.get("tokens_predicted", 0)))
    except (KeyError, TypeError, ValueError) as exc:
        raise PeerError(f"llama-server answer without timings: {json.dumps(response)[:200]}") from exc
    return PeerResult(name=name, tokens_per_s=tps, tokens=n, text=response.get("content", ""),
                      token_ids=[int(t) for t in response.get("tokens") or []] or None,
                      draft_tokens=timings.get("draft_n"), draft_accepted=timings.get("draft_n_accepted"))


_DECODED = re.compile(r"decoded\s+(\d+)\s+tokens\s+in\s+([\d.]+)\s+seconds,\s+speed:\s+([\d.]+|inf|nan)\s+t/s")
_DRAFTED = re.compile(r"n_drafted\s*=\s*(\d+)")
_ACCEPTED = re.compile(r"n_accept\s*=\s*(\d+)")


def parse_speculative_output(stdout: str, stderr: str, prompt_text: str = "", name: str = "") -> PeerResult:
    """What ``llama-speculative`` prints: on stdout a blank line, the prompt, the answer, a blank
    line, and another at exit; on stderr ``decoded N tokens in S seconds, speed: R t/s`` and the
    draft counts. It stops once it has at least ``-n`` tokens, so N can exceed the budget by a
    draft's length."""
    match = _DECODED.search(stderr) or _DECODED.search(stdout)
    if match is None:
        tail = (stderr or stdout)[-300:]
        raise PeerError(f"llama-speculative printed no decode speed; its output ended with: {tail!r}")
    n, seconds, rate = int(match.group(1)), float(match.group(2)), float(match.group(3))
    text = stdout.removeprefix("\n\n")
    if prompt_text and text.startswith(prompt_text):
        text = text[len(prompt_text):]
    text = text.removesuffix("\n\n\n\n") if text.endswith("\n\n\n\n") else text.removesuffix("\n\n")
    drafted, accepted = _DRAFTED.search(stderr), _ACCEPTED.search(stderr)
    return PeerResult(name=name, tokens_per_s=rate if rate == rate and seconds > 0 else n / max(seconds, 1e-9),
                      tokens=n, text=text, draft_tokens=int(drafted.group(1)) if drafted else None,
                      draft_accepted=int(accepted.group(1)) if accepted else None)


# ----- processes ------------------------------------------------------------------------------------
def free_port(host: str = HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _stop(process: subprocess.Popen, grace_s: float) -> None:
    """Terminate ``process`` (and the session it leads, while it still leads it), kill it after
    ``grace_s``, reap it."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait(timeout=30)


class PeerServer:
    """A ``llama-server`` (or anything answering ``/health``) for the duration of a ``with`` block.

    Started in a session of its own with its output in a log file; ready once ``GET /health``
    answers 200; stopped on leaving the block whatever happens (SIGTERM, SIGKILL after
    ``grace_s``)."""

    def __init__(self, command: list[str], port: int, startup_timeout_s: float = 180.0, grace_s: float = 10.0,
                 host: str = HOST):
        self.command, self.port, self.host = command, port, host
        self.startup_timeout_s, self.grace_s = startup_timeout_s, grace_s
        self.process: subprocess.Popen | None = None
        self._log = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log_tail(self, chars: int = 600) -> str:
        if self._log is None:
            return ""
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-chars:]

    def __enter__(self) -> "PeerServer":
        self._log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=self._log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        try:
            if self.process is not None:
                _stop(self.process, self.grace_s)
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self.process.poll() is not None:
                raise PeerError(f"{Path(self.command[0]).name} exited with code {self.process.returncode} while "
                                f"starting: {self.log_tail()!r}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                raise PeerError(f"{Path(self.command[0]).name} not ready after {self.startup_timeout_s:.0f} s: "
                                f"{self.log_tail()!r}")
            time.sleep(0.25)

    def post(self, path: str, body: dict, timeout_s: float = 600.0) -> dict:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            raise PeerError(f"llama-server answered {exc.code} to {path}: {exc.read()[:300]!r}") from exc
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            raise PeerError(f"llama-server did not answer {path}: {exc}; log: {self.log_tail()!r}") from exc


def run_command(command: list[str], timeout_s: float, grace_s: float = 5.0) -> tuple[int, str, str]:
    """Run ``command`` in a session of its own; kill it (and its session) past ``timeout_s``."""
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _stop(process, grace_s)
        process.communicate()
        raise PeerError(f"{Path(command[0]).name} still running after {timeout_s:.0f} s; stopped") from None
    except BaseException:
        _stop(process, grace_s)
        raise
    return process.returncode, stdout.decode(errors="replace"), stderr.decode(errors="replace")


# ----- the runs -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PeerRequest:
    """What every configuration decodes: the prompts as token ids (and as text for
    ``llama-speculative``, which reads text), ``new_tokens`` each, with this sampling, over
    ``repeats`` rounds or on the ``(round, prompt index)`` pairs of ``order`` only."""

    prompts: list[list[int]]
    new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    prompt_texts: list[str] | None = None
    repeats: int = 1
    order: list[tuple[int, int]] | None = None

    def runs(self) -> list[tuple[int, int]]:
        """The (round, prompt index) pairs to decode, in order."""
        return self.order or [(round_, i) for round_ in range(self.repeats) for i in range(len(self.prompts))]


@dataclass(frozen=True)
class _Setup:
    """Where and how the configurations run: the binaries, the (target, draft) GGUF files, threads,
    the context and each request's timeout."""

    binaries: PeerBinaries
    ggufs: tuple[Path, Path]
    threads: int
    ctx: int
    timeout_s: float


def run_peer(request: PeerRequest, configs: list[PeerConfig] | None = None, binaries: PeerBinaries | None = None,
             ggufs: tuple[Path, Path] | None = None, threads: int = DEFAULT_THREADS, timeout_s: float = 900.0,
             log=print) -> list[PeerRuns]:
    """Every configuration on the request's (round, prompt) pairs (seed ``i + 1000 * round``, as the
    bench seeds ours): one server per configuration, the prompts posted in turn. At temperature 0
    each answer is compared with llama.cpp's target-only answer to the same prompt (token ids;
    text for ``llama-speculative``, which prints text only, and which needs ``prompt_texts``)."""
    if binaries is None:
        binaries, reason = peer_binaries()
        if binaries is None:
            raise PeerError(reason)
    setup = _Setup(binaries, ggufs or default_ggufs(), threads,
                   context_size(max(len(p) for p in request.prompts), request.new_tokens), timeout_s)
    configs = configs or peer_configurations()
    all_runs = []
    for config in configs:
        runs = PeerRuns(config)
        try:
            _run_configuration(runs, setup, request, log)
        except (PeerError, OSError) as exc:  # one configuration failing must not cost the others' figures
            runs.error = str(exc)
            log(f"{config.name}: failed: {runs.error}", flush=True)
        all_runs.append(runs)
    if request.temperature == 0:
        mark_same_as_target_only(all_runs)
    return all_runs


def _run_configuration(runs: PeerRuns, setup: _Setup, request: PeerRequest, log) -> None:
    """One configuration of :func:`run_peer` over every (round, prompt) the request names, into ``runs``."""
    config, (target, draft), r = runs.config, setup.ggufs, request
    if config.kind == "server":
        command = server_command(setup.binaries.server, config, target, draft if config.uses_draft else None,
                                 free_port(), threads=setup.threads, ctx=setup.ctx)
        with PeerServer(command, int(command[command.index("--port") + 1])) as server:
            for round_, i in r.runs():
                body = completion_request(r.prompts[i], r.new_tokens, r.temperature, r.top_p, seed=i + 1000 * round_)
                result = parse_completion(server.post("/completion", body, setup.timeout_s), config.name)
                runs.results.append(result)
                log(f"prompt {i}: {config.name:<42} {result.tokens_per_s:6.2f} tok/s", flush=True)
    else:
        if r.prompt_texts is None:
            raise PeerError(f"{config.name} takes the prompt as text: pass prompt_texts")
        with tempfile.TemporaryDirectory(prefix="sequoia-peer-") as tmp:
            for round_, i in r.runs():
                prompt_file = Path(tmp, f"prompt{i}.txt")
                prompt_file.write_text(r.prompt_texts[i] + "\n", encoding="utf-8")  # -f drops one trailing newline
                command = speculative_command(setup.binaries.speculative, config, setup.ggufs, prompt_file,
                                              r.new_tokens, (r.temperature, r.top_p, i + 1000 * round_),
                                              threads=setup.threads, ctx=setup.ctx)
                code, stdout, stderr = run_command(command, setup.timeout_s)
                if code != 0:
                    raise PeerError(f"llama-speculative exited with code {code}: {stderr[-400:]!r}")
                result = parse_speculative_output(stdout, stderr, r.prompt_texts[i], config.name)
                runs.results.append(result)
                log(f"prompt {i}: {config.name:<42} {result.tokens_per_s:6.2f} tok/s", flush=True)


def mark_same_as_target_only(all_runs: list[PeerRuns]) -> None:
    """Set ``same_as_target_only`` on every greedy run against the target-only run at the same index:
    equal token ids, or for ``llama-speculative`` (text only, and it may overshoot the budget by a
    few tokens) equal text up to the shorter of the two."""
    reference = next((r for r in all_runs if r.config.name == TARGET_ONLY), None)
    if reference is None:
        return
    for runs in all_runs:
        for result, ref in zip(runs.results, reference.results):
            if result.token_ids is not None and ref.token_ids is not None:
                result.same_as_target_only = result.token_ids == ref.token_ids
            else:
                result.same_as_target_only = result.text.startswith(ref.text) or ref.text.startswith(result.text)
