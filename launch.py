"""Entry point of `make run`: the Sequoia Chat web app (chat + live token tree) on a local server.

Loads the target/draft pair (the embedded Qwen2.5-Coder pair unless --target/--draft say
otherwise), then serves the UI and prints its local URL. `make run ARGS="--port 8000"`.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path

from engine.backends.hugepages import restart_with_huge_pages

if __name__ == "__main__":  # before torch loads: glibc reads its tunables when a process starts
    restart_with_huge_pages()

from engine.cli.arguments import add_format_arguments, formats_of  # noqa: E402
from engine.errors import EngineError  # noqa: E402
from engine.models.loading import DTYPES  # noqa: E402
from app.api.openai_requests import DEFAULT_MAX_TOKENS, MAX_TOKENS_LIMIT  # noqa: E402
from app.web.cross_origin import parse_origins  # noqa: E402
from app.web.server_limits import BODY_TIMEOUT_S, HEADER_TIMEOUT_S, MAX_CONNECTIONS  # noqa: E402

KV_CACHE_MB = 1024  # default budget of the conversation KV caches (engine.core.prefix_cache.DEFAULT_BUDGET_BYTES)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="interface to serve on (0.0.0.0 exposes it to the network)")
    parser.add_argument("--allowed-hosts", default="",
                        help="comma-separated extra Host names the server answers to (beyond the loopback names and "
                             "--host); * answers any (turns the DNS-rebinding guard off)")
    parser.add_argument("--cors-origins", default="",
                        help="comma-separated web origins (https://app.example:8443) whose pages may call /v1 "
                             "from the browser, without credentials; none by default, and never the UI")
    parser.add_argument("--api-key", default=None,
                        help="a key every client must give: Bearer token on /v1, password on the page "
                             "(needed with a non-loopback --host or --share)")
    parser.add_argument("--api-key-file", default=None, help="read the API key from this file (first line)")
    parser.add_argument("--port", type=int, default=None, help="port (default: the first free one from 7860)")
    parser.add_argument("--share", action="store_true", help="also create a public gradio.live link (off)")
    parser.add_argument("--inbrowser", action="store_true", help="open the app in the default browser")
    parser.add_argument("--target", default="default-target",
                        help="a GGUF file (or a folder holding one), an HF id or local dir (default: embedded 1.5B)")
    parser.add_argument("--draft", default="default-draft",
                        help="a GGUF file (or a folder holding one), an HF id or local dir (default: embedded 0.5B)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, or auto (spread a large target over the GPUs)")
    parser.add_argument("--offload", action="store_true",
                        help="keep the target's layers in pinned CPU memory and stream them to the GPU (needs --device cuda)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    add_format_arguments(parser)
    parser.add_argument("--offline", action="store_true", help="never contact the Hugging Face hub (HF_HUB_OFFLINE=1)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="let --target and --draft run their repositories' own code (the launch pair only)")
    parser.add_argument("--models-panel", action="store_true",
                        help="show the Models panel (load another pair from the page) when the app is reachable "
                             "beyond this machine (a non-loopback --host, or --share): whoever reaches the page "
                             "could make the server download any repository; on loopback it is always on")
    parser.add_argument("--models-panel-remote-code", action="store_true",
                        help="let whoever reaches the page load repositories that run their own code from the "
                             "Models panel: remote code execution for every client of the port")
    parser.add_argument("--models-dir", default=os.environ.get("SEQUOIA_MODELS_DIR", "~/models"),
                        help="the only folder the UI may load local models from (~/models, or $SEQUOIA_MODELS_DIR)")
    parser.add_argument("--tree-size", type=int, default=8, help="initial tree size in the UI (nodes, root included)")
    parser.add_argument("--depth", type=int, default=4, help="initial tree depth in the UI")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="initial answer budget in the UI")
    parser.add_argument("--max-tokens-limit", type=int, default=MAX_TOKENS_LIMIT,
                        help=f"the most new tokens an API request may ask for ({MAX_TOKENS_LIMIT}); one that names "
                             f"none gets {DEFAULT_MAX_TOKENS}, or the rest of the context where less is left")
    parser.add_argument("--kv-cache-mb", type=int, default=KV_CACHE_MB,
                        help=f"memory for KV caches kept between turns, all conversations together, one per "
                             f"session, least recently used evicted ({KV_CACHE_MB}; 0 keeps none)")
    parser.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT_S,
                        help=f"seconds a client may take to send a request's head ({HEADER_TIMEOUT_S:g})")
    parser.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT_S,
                        help=f"seconds a client may take to send a request's body, from the head's end "
                             f"({BODY_TIMEOUT_S:g})")
    parser.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS,
                        help=f"open connections at once; more are closed at once, requests past it get 503 "
                             f"({MAX_CONNECTIONS})")
    parser.add_argument("--no-measure", action="store_true",
                        help="do not measure this machine's forward times for the optimizer on a first start, or "
                             "again when the stored ones disagree with the launch (the nearest bundled profile is "
                             "used then; python -m engine.cli.profile measures), nor the target alone's rate at T = 0 "
                             "and the memory and arithmetic limits before serving on each start (a few seconds)")
    parser.add_argument("--data-dir", default=None,
                        help="folder of the conversation history (default: $SEQUOIA_DATA, else "
                             "$XDG_DATA_HOME/sequoia-chat, else ~/.local/share/sequoia-chat)")
    parser.add_argument("--no-history", action="store_true",
                        help="keep no conversations on disk (they last as long as the browser tab)")
    # development: a tiny random pair with the real tokenizer, to work on the UI without the weights
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def open_history(args: argparse.Namespace):
    """``(store, line)``: the conversation store (None: history off) and the line that says where
    it is or why it is off. ``--tiny`` keeps none unless ``--data-dir`` names a folder."""
    if args.no_history or (args.tiny and not args.data_dir):
        return None, "History is off (--no-history): conversations last as long as the browser tab."
    from app.serving.history import open_store
    return open_store(args.data_dir)


def build_worker(args: argparse.Namespace):
    from app.serving.worker import Worker
    from engine.tuning.optimizer import load_tuner
    from engine.tuning.planner import TreePlanner

    if args.tiny:
        import torch

        from app.serving.pair import load_tokenizer, tiny_pair
        torch.set_num_threads(1)
        tokenizer = load_tokenizer()
        target, draft = tiny_pair(tokenizer)
        return Worker.from_models(target, draft, tokenizer, "tiny-random-qwen2 (dev)",
                                  "tiny-random-qwen2-perturbed (dev)", **worker_policy(args))

    import time

    from engine.models.loading import load_pair, pair_name
    print("loading models (a first start assembles and packs the embedded pair's weights: under a minute)...",
          flush=True)
    started = time.perf_counter()
    target, draft, tokenizer = load_pair(args.target, args.draft, DTYPES[args.dtype], args.device,
                                         args.trust_remote_code, offload=args.offload,
                                         formats=formats_of(args))
    print(f"loaded in {time.perf_counter() - started:.1f} s: " + "; ".join(
        f"{role} {name} ({getattr(model, 'as_stored', None) or 'as loaded'})"
        for role, name, model in (("target", args.target, target), ("draft", args.draft, draft))), flush=True)
    pair = pair_name(args.target, args.draft, draft, target)
    return Worker.from_models(target, draft, tokenizer, args.target, args.draft,
                              planner=TreePlanner(pair, load_tuner(pair, target)), **worker_policy(args))


def on_a_passing_thread(function, *args):
    """``function(*args)`` on a thread that ends with it (its exception re-raised here).

    Loading runs torch ops large enough to start an OpenMP team on the thread that runs them; a
    thread that ends takes its team with it. Loaded on the main thread, the team would stay beside
    the engine thread's own: with more OpenMP threads than cores, libgomp makes its waiting threads
    sleep almost at once: the engine's threads then slept thousands of times a second, and lost
    their cores to the browser's renderer each time.
    """
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = function(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="load", daemon=True)  # Ctrl-C still ends the process
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def worker_policy(args: argparse.Namespace) -> dict:
    """What UI requests may load: local folders under --models-dir only; remote code only with
    --models-panel-remote-code (--trust-remote-code is for the launch pair alone). Also how drafts loaded from the UI are stored (--draft-format, --draft-vocab)
    and the memory the conversation KV caches may hold (--kv-cache-mb)."""

    if args.kv_cache_mb < 0:
        raise SystemExit("error: --kv-cache-mb must be >= 0")
    return {"models_dir": Path(args.models_dir).expanduser(), "allow_remote_code": args.models_panel_remote_code,
            "draft_format": args.draft_format, "draft_vocabulary": args.draft_vocab, "kv_cache_bytes": args.kv_cache_mb << 20}


def report_measurement(job, worker) -> None:
    """Print how the background measurement of this machine ended (the optimizer's new pick), and
    one line for each profile refused on the way (it is measured again later)."""
    for last in job.iter_events():
        if last.kind == "progress" and str(last.data).startswith("This machine's profile was refused"):
            print(last.data, flush=True)
    if last.kind == "done" and worker.tuner is not None:
        from engine.core.settings import DecodeSettings

        choice = worker.decide(DecodeSettings(temperature=0.0, top_p=1.0)).choice
        print(f"Measured this machine: the target alone {1 / last.data.token_time():.1f} tokens/s; at T = 0 the "
              f"optimizer picks a tree of {choice.size} nodes, depth {choice.depth} "
              f"(predicted {choice.predicted_speedup:.2f}x the target alone).", flush=True)
    else:
        print(f"Measuring this machine did not finish ({last.kind}: {last.data}); the bundled profile stays.", flush=True)


def start_measuring(worker, rate: float | None) -> None:
    """Measure this machine's profile in the background when it has none of its own, or when the
    one it stored disagrees with the launch's target-alone ``rate`` (:func:`stale_profile`)."""
    tuner = worker.tuner
    stale = stale_profile(tuner, rate)
    if tuner is None or (tuner.measured_here and not stale):
        return
    from engine.tuning.profile import QUIET_CORES

    # in slices between answers, while the machine is quiet; refused when its target alone is off `rate`
    job = worker.measure_machine(reference_tokens_per_s=rate, quiet_cores=QUIET_CORES, checked=True)
    print((f"This machine's stored profile disagrees with the launch ({stale}): measuring it again"
           if stale else "Measuring this machine for the optimizer") + " (about a minute, between answers, "
          f"once); until then it uses {tuner.profile_words}.", flush=True)
    threading.Thread(target=report_measurement, args=(job, worker), daemon=True).start()


def stale_profile(tuner, rate: float | None) -> str:
    """Why the profile this machine stored earlier no longer agrees with the target-alone ``rate``
    the launch measured (the host got faster or slower since), or "" (none stored, or it agrees)."""
    if tuner is None or not tuner.measured_here:
        return ""
    from engine.tuning.profile import launch_disagreement

    return launch_disagreement(tuner.profile, rate)


GIL_SWITCH_INTERVAL_S = 0.0005


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def api_key(args: argparse.Namespace) -> str | None:
    """The key from --api-key or --api-key-file (its first line), or None. Raises SystemExit with
    one line when both are given, the file cannot be read, or the key is empty."""
    if args.api_key is not None and args.api_key_file is not None:
        raise SystemExit("error: give --api-key or --api-key-file, not both")
    key = args.api_key
    if args.api_key_file is not None:
        try:
            lines = Path(args.api_key_file).expanduser().read_text().splitlines()
        except OSError as exc:
            raise SystemExit(f"error: cannot read --api-key-file: {exc.strerror}") from None
        key = lines[0] if lines else ""
    if key is not None and not key.strip():
        raise SystemExit("error: the API key is empty")
    return None if key is None else key.strip()


def check_exposure(args: argparse.Namespace, key: str | None) -> None:
    """Refuse (SystemExit, one line) to serve beyond this machine without a key."""
    if key is None and (args.share or args.host not in LOOPBACK_HOSTS):
        where = "a public share link" if args.share else f"--host {args.host}"
        raise SystemExit(f"error: {where} lets other machines reach the app and its API; give --api-key "
                         f"or --api-key-file too")


def reachable_beyond_loopback(args: argparse.Namespace) -> bool:
    return args.share or args.host not in LOOPBACK_HOSTS


def models_panel(args: argparse.Namespace) -> bool:
    """Whether the page may load another pair: always on loopback, beyond it only with --models-panel."""
    return args.models_panel or not reachable_beyond_loopback(args)


def server_limits(args: argparse.Namespace):
    """The connection limits of --header-timeout, --body-timeout and --max-connections (SystemExit,
    one line, for a value that is not positive)."""
    from app.web.server_limits import ServerLimits
    for flag, value in (("--header-timeout", args.header_timeout), ("--body-timeout", args.body_timeout),
                        ("--max-connections", args.max_connections)):
        if not value > 0:
            raise SystemExit(f"error: {flag} must be positive")
    return ServerLimits(header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                        max_connections=args.max_connections)


def other_machines_line(host: str, local_url: str) -> str | None:
    """When the server binds every interface: the line that lists this machine's addresses (the
    Host allowlist takes them, app.web.host_guard); None otherwise."""
    from app.web.host_guard import ANY_INTERFACE, host_name, reachable_addresses

    if host_name(host) not in ANY_INTERFACE:
        return None
    port = local_url.rstrip("/").rsplit(":", 1)[1]
    urls = [f"http://[{a}]:{port}/" if ":" in a else f"http://{a}:{port}/" for a in reachable_addresses()]
    return ("From other machines: " + (", ".join(urls) or "no network address found")
            + " (or this machine's name; --allowed-hosts adds other names)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    key = api_key(args)
    check_exposure(args, key)
    limits = server_limits(args)
    try:
        origins = parse_origins(args.cors_origins.split(","))
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    if args.offline:
        os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    # The engine thread gives up the GIL at every torch op and takes it back after; with Gradio's
    # threads busy it waited up to the 5 ms switch interval each time. At 0.5 ms the engine decodes
    # as fast in the app as alone (measured: 0.9x of headless at 5 ms, 1.0x at 0.5 ms, no browser).
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    try:
        worker = on_a_passing_thread(build_worker, args)
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    from app.page import ui
    from engine.models.loading import pair_name
    from engine.tuning.calibrate import find_acceptance

    pair = pair_name(args.target, args.draft, worker.engine.draft, worker.engine.target)
    measured = bool(find_acceptance(pair))
    history, history_line = open_history(args)
    print(history_line, flush=True)
    demo = ui.build_demo(worker, worker.tokenizer, {
        "tree_size": max(1, args.tree_size), "depth": max(1, args.depth),
        "max_new_tokens": max(1, args.max_new_tokens),
        "predict": measured and not args.tiny, "models_panel": models_panel(args),
        "history": history, "history_note": history_line})
    rate = None
    if not args.no_measure:  # before any page can draw on the cores: the stats line's "× the target alone"
        rate = demo.chat_app.measure_baseline_now(0.0, 1.0)
        print(f"Measured the target alone on this machine: {rate:.1f} tokens/s at T = 0." if rate else
              "Measuring the target alone did not finish; the stats line estimates it from the profile.", flush=True)
        from engine.tuning.roofline import machine_limits
        roof = machine_limits()  # for Why this tree's roofline, while no page draws
        print(f"Measured this machine's limits: memory {roof.bandwidth_gbs:.0f} GB/s, {roof.compute} arithmetic "
              f"{roof.int8_gops:.0f} GOPS.", flush=True)
    guards = ui.Guards(extra_hosts=args.allowed_hosts.split(","), api_key=key, cors_origins=origins, limits=limits)
    app, local_url, share_url = ui.launch(demo, server_name=args.host, server_port=args.port, guards=guards,
                                          share=args.share, inbrowser=args.inbrowser, prevent_thread_lock=True,
                                          quiet=True)
    from app.api import openai_api
    if args.max_tokens_limit < 1:
        raise SystemExit("error: --max-tokens-limit must be >= 1")
    openai_api.mount(app, worker, {"tree_size": max(1, args.tree_size), "depth": max(1, args.depth),
                                   "max_tokens_limit": args.max_tokens_limit}, api_key=key)
    print(f"Sequoia Chat is running at {local_url}" + (f" (public link: {share_url})" if share_url else ""),
          flush=True)
    print(f"OpenAI-compatible API: {local_url.rstrip('/')}/v1 (chat/completions, models)", flush=True)
    if (line := other_machines_line(args.host, local_url)) is not None:
        print(line, flush=True)
    if not args.no_measure:
        start_measuring(worker, rate)
    print("Press Ctrl-C to stop.", flush=True)
    try:
        demo.block_thread()
    except KeyboardInterrupt:
        pass
    finally:
        worker.close()
        demo.close()
        if history is not None:
            history.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
