"""``python -m bench.ui``: the speed a person sees.

Launches the app as a user does (``launch.py`` with its defaults, the embedded pair), drives a real
Chromium through Playwright (1440x960), types each bundled prompt into the chat, sends it with
Enter and records, as the answer's text changes on screen: the time to the first visible token
and the decode rate (the answer's tokens after the first, over the time from the first visible
token to the last change). It also reads the CPU seconds Chromium and the server spent per answer.
After each answer, once the page is idle, the headless engine (in this process) decodes the same
prompt with the same settings (``tree="auto"``, T = 0, copies): never two at once on these cores,
and a host whose speed drifts meets both alike. ``--rounds`` sends every prompt again. After the
app is closed, llama.cpp's ``llama-server`` does target-only decoding when ``make peer`` has built
it. JSON and a plot go to ``results/`` (or ``--out``).

With ``--compare`` the page's own Compare runs after each answer: the target alone decodes the same
prompt in the same page, and the bench records Compare's verdict (the answer's speed over the
target alone's, both as this page drew them) beside the stats line's, whose baseline it then is.
Chromium's and the server's CPU per answer then include that second decode.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
URL_LINE = re.compile(r"running at (http://\S+)")
ENGINE_RATE = re.compile(r"measured ([0-9.]+) tokens/s")  # the stats line: the engine's own step clock
STATS_SPEEDUP = re.compile(r"([0-9.]+)× the target alone")   # the stats line's first: its headline
COMPARE_SPEEDUP = re.compile(r"speculative ([0-9.]+)× the target alone")
COMPARE_RATES = re.compile(r"decoding\s+([0-9.]+) tokens/s\s+([0-9.]+) tokens/s")
COMPARE_BOX = "Compare with the target alone"

SETTLE_MS = 5000
POLL_MS = 250  # how often the bench looks whether an answer is done (its samples come from a MutationObserver)
FINAL_TEXT_JS = """() => { const m = document.querySelectorAll("#sc-chatbot [data-testid='bot']");
  return !document.querySelector('#sc-chatbot .sc-live-text') && m.length && !/^…?$/.test(m[m.length - 1].innerText.trim()); }"""
BOT_MESSAGES = "#sc-chatbot .message.bot, #sc-chatbot [data-testid='bot']"
# Records (ms since the page's origin, text, whether the text is the live feed's) of the new assistant
# message whenever the chat changes: the answer to the message about to be sent is the first bot
# message past the ``before`` already shown.
OBSERVER_JS = """(before) => {
  window.__sc = [];
  if (window.__scObserver) window.__scObserver.disconnect();
  const chat = document.querySelector('#sc-chatbot');
  const answer = () => { const m = document.querySelectorAll("%s");
                         return m.length > before ? m[m.length - 1].innerText : ''; };
  window.__scObserver = new MutationObserver(() => window.__sc.push(
    [performance.now(), answer(), !!chat.querySelector('.sc-live-text')]));
  window.__scObserver.observe(chat, {subtree: true, childList: true, characterData: true});
}""" % BOT_MESSAGES


@dataclass
class ScreenTiming:
    """When an answer's text showed on screen (ms on the page's clock) and what it said."""

    first_ms: float | None  # the first visible text
    last_ms: float | None   # the last new text: the live feed's last change, when the feed carried it
    updates: int            # changes of the text up to ``last_ms``
    text: str               # the answer's raw text as streamed (else as finally shown)


def on_screen_timing(samples: list, final_text: str) -> ScreenTiming:
    """``samples``: ``[ms, text, live]`` each time the chat changed (OBSERVER_JS). The answer's last
    token is on screen at the live feed's last change; Gradio's Markdown replaces that text later
    with the same tokens formatted (``**`` made bold), which is not decoding, so it only counts when
    no live feed carried the answer."""
    visible = [(t, text, bool(live)) for t, text, live in samples if text.strip() and text.strip() != "…"]
    if not visible:
        return ScreenTiming(None, None, 0, final_text)
    changes = [(t, text, live) for (t, text, live), (_, before, _) in zip(visible[1:], visible) if text != before]
    if any(live for _, _, live in visible):
        live_changes = [c for c in changes if c[2]]
        last, text = (live_changes[-1][0], live_changes[-1][1]) if live_changes else (visible[0][0], visible[0][1])
        return ScreenTiming(visible[0][0], last, len(live_changes) + 1, text)
    last = changes[-1][0] if changes else visible[0][0]
    return ScreenTiming(visible[0][0], last, len(changes) + 1, final_text)


def page_speedups(stats: str, compare: str) -> dict:
    """What the page said of the answer's speed-up: the stats line's headline (× the target alone)
    and, when Compare ran, its verdict with the two decode rates it raced in the page (None where
    the page did not say)."""
    headline, verdict, rates = STATS_SPEEDUP.search(stats), COMPARE_SPEEDUP.search(compare), COMPARE_RATES.search(compare)
    return {"stats_line_speedup": float(headline[1]) if headline else None,
            "compare_speedup": float(verdict[1]) if verdict else None,
            "compare_tokens_per_s": float(rates[1]) if rates else None,
            "compare_target_alone_tokens_per_s": float(rates[2]) if rates else None}


def process_tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and all its descendants (children still running)."""
    import psutil

    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            continue
    return total


def start_app(port: int, extra: list[str], log, wait_measure_s: float) -> tuple[subprocess.Popen, str]:
    """``launch.py`` on ``port``; returns once it printed its URL and (when it measures this
    machine on a first start) the measurement's end."""
    process = subprocess.Popen([sys.executable, str(ROOT / "launch.py"), "--port", str(port), *extra], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    url, measuring, deadline = None, False, time.monotonic() + 600
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            raise RuntimeError("the app exited before it was ready")
        log("app: " + line.rstrip())
        url = url or (URL_LINE.search(line)[1] if URL_LINE.search(line) else None)
        measuring = measuring or line.startswith(("Measuring this machine", "This machine's stored profile disagrees"))
        if line.startswith("Press Ctrl-C") and not measuring:
            return process, url
        if line.startswith(("Measured this machine:", "Measuring this machine did not finish")):
            return process, url
        if line.startswith("Press Ctrl-C"):
            deadline = time.monotonic() + wait_measure_s
    raise RuntimeError("the app was not ready in time")


def on_screen(url: str, prompts: list[str], server_pid: int, log, shots: Path | None, rounds: int = 1,
              after_each: Callable[[int], None] | None = None, compare: bool = False) -> list[dict]:
    """Each prompt through the page, ``rounds`` times over; what the screen showed, when, and the CPU
    it took. ``after_each(i)`` runs once the page has settled after the answer to prompt ``i``;
    ``compare`` ticks the page's Compare first."""
    from playwright.sync_api import sync_playwright

    from app.serving.pair import load_tokenizer

    tokenizer = load_tokenizer()
    results = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium") or shutil.which("chromium-browser"),
                                    args=["--no-sandbox"])
        browser_pid = _browser_pid(browser)
        page = browser.new_page(viewport={"width": 1440, "height": 960})
        cdp = page.context.new_cdp_session(page)
        cdp.send("Performance.enable")
        page.goto(url)
        page.wait_for_selector("#sc-chatbot")
        page.wait_for_timeout(SETTLE_MS)  # as a person reads the page before typing: its first render is done
        if compare:  # in the settings sidebar, open at this width
            page.get_by_label(COMPARE_BOX).check()
        box = page.get_by_placeholder("Ask something…")
        for n, (i, prompt) in enumerate((i, p) for _ in range(rounds) for i, p in enumerate(prompts)):
            if n:  # each prompt in a conversation of its own, as the headless engine gets it
                page.locator("#sc-clear").click()
                page.wait_for_function("() => /Cleared/.test(document.querySelector('#sc-status').innerText)")
                page.wait_for_timeout(SETTLE_MS)  # the last answer's charts and tabs are drawn, as a person reads
            before = page.locator(BOT_MESSAGES).count()
            page.evaluate(OBSERVER_JS, before)
            chrome0, server0 = process_tree_cpu_seconds(browser_pid), process_tree_cpu_seconds(server_pid)
            page0 = page_metrics(cdp)
            box.fill(prompt)
            sent = page.evaluate("() => performance.now()")
            box.press("Enter")
            page.wait_for_function(  # looked for a few times a second, as a person would: Playwright's
                """(before) => document.querySelectorAll("%s").length > before &&
                     /Done|Stopped|failed/.test(document.querySelector('#sc-status').innerText)""" % BOT_MESSAGES,
                arg=before, timeout=600_000, polling=POLL_MS)  # default (every frame) lays the page out 60 times a second
            page.wait_for_function(FINAL_TEXT_JS, timeout=60_000, polling=POLL_MS)  # Gradio's Markdown replaced the live text
            page.wait_for_timeout(300)
            samples = page.evaluate("() => window.__sc")
            chrome, server = process_tree_cpu_seconds(browser_pid) - chrome0, process_tree_cpu_seconds(server_pid) - server0
            shown = on_screen_timing(samples, page.locator(BOT_MESSAGES).last.inner_text())
            first, tokens, decode = shown.first_ms, len(tokenizer.encode(shown.text, add_special_tokens=False)), None
            if first is not None and shown.last_ms > first:
                decode = (tokens - 1) / ((shown.last_ms - first) / 1000)
            page1 = page_metrics(cdp)
            stats = page.locator("#sc-stats").inner_text()
            engine_rate = ENGINE_RATE.search(stats)
            said = page_speedups(stats, page.locator("#sc-compare").inner_text() if compare else "")
            result = {"prompt": prompt, "prompt_index": i, "tokens": tokens, "first_token_s": None if first is None else (first - sent) / 1000,
                      "decode_tokens_per_s": decode, "updates": shown.updates,
                      "engine_in_app_tokens_per_s": float(engine_rate[1]) if engine_rate else None,
                      "chromium_cpu_s": chrome, "server_cpu_s": server,
                      "page_main_thread_s": {k: page1[k] - page0[k] for k in PAGE_METRICS},
                      "status": page.locator("#sc-status").inner_text(), "stats": stats, **said}
            log(f"on screen {i + 1}/{len(prompts)} (round {n // len(prompts) + 1}): {tokens} tokens, first after {result['first_token_s'] or float('nan'):.2f} s, "
                f"{decode or 0:.2f} tokens/s ({result['engine_in_app_tokens_per_s']} by the engine's own clock), "
                f"{shown.updates} updates; Chromium {chrome:.1f} s CPU, server {server:.1f} s CPU; page main "
                f"thread: " + ", ".join(f"{k} {v:.2f} s" for k, v in result["page_main_thread_s"].items())
                + f"; the stats line said {said['stats_line_speedup']}× the target alone"
                + (f", Compare {said['compare_speedup']}× ({said['compare_tokens_per_s']} against "
                   f"{said['compare_target_alone_tokens_per_s']} tokens/s)" if compare else ""))
            if shots is not None:
                page.screenshot(path=str(shots / f"bench-ui-{i + 1}.png"))
            results.append(result)
            if after_each is not None:
                page.wait_for_timeout(SETTLE_MS)  # the answer's charts are drawn
                wait_quiet(browser_pid, page)     # and the page is idle
                chrome0, server0 = process_tree_cpu_seconds(browser_pid), process_tree_cpu_seconds(server_pid)
                after_each(i)  # what the idle page and app took from it, in CPU seconds:
                result["idle_cpu_s_beside_headless"] = {"chromium": process_tree_cpu_seconds(browser_pid) - chrome0,
                                                        "server": process_tree_cpu_seconds(server_pid) - server0}
                log("  beside it the idle page took {chromium:.2f} s of CPU and the idle app {server:.2f} s"
                    .format(**result["idle_cpu_s_beside_headless"]))
        browser.close()
    return results


def wait_quiet(pid: int, page, window_s: float = 1.0, busy_s: float = 0.05, limit_s: float = 20.0) -> float:
    """Wait until ``pid``'s process tree (Chromium) spends under ``busy_s`` CPU seconds in a
    ``window_s`` window, at most ``limit_s``; the seconds waited."""
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        before = process_tree_cpu_seconds(pid)
        page.wait_for_timeout(window_s * 1000)
        if process_tree_cpu_seconds(pid) - before < busy_s:
            break
    return time.monotonic() - started


PAGE_METRICS = ("TaskDuration", "ScriptDuration", "LayoutDuration", "RecalcStyleDuration")


def page_metrics(cdp) -> dict[str, float]:
    """Seconds the page's main thread spent so far: in all tasks, in script, in layout and in style
    recalculation (Chrome DevTools Protocol ``Performance.getMetrics``)."""
    metrics = {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}
    return {name: float(metrics.get(name, 0.0)) for name in PAGE_METRICS}


def _browser_pid(browser) -> int:
    """The browser process's pid (Playwright keeps it on its connection's transport)."""
    import psutil

    me = psutil.Process()
    candidates = [c for c in me.children(recursive=True) if "chrom" in c.name().lower()]
    return min(candidates, key=lambda c: c.create_time()).pid if candidates else me.pid


class Headless:
    """The engine alone with the app's defaults (T = 0, tree="auto", copies from the conversation and
    steps of the target alone timed, as the app's defaults have them), in this process: it decodes a
    prompt while the app waits idle."""

    def __init__(self, max_new: int, log) -> None:
        from engine import SpeculativeEngine
        from engine.models.loading import load_default_pair, pair_name
        from engine.tuning.optimizer import load_tuner
        from engine.tuning.planner import TreePlanner

        target, draft, self.tokenizer = load_default_pair()
        pair = pair_name("default-target", "default-draft", draft, target)
        self.tuner = load_tuner(pair, target)
        self.engine = SpeculativeEngine(target, draft, planner=TreePlanner(pair, self.tuner))
        self.max_new, self.log = max_new, log

    def decode(self, prompt: str, index: int) -> dict:
        """The answer to ``prompt`` (the ``index``-th bundled one): its decode rate and first token."""
        from app.page.controls import DEFAULTS
        from engine.core.timed_alone import TimedAlone
        from engine.models.prompts import encode_chat

        ids = encode_chat(self.tokenizer, [{"role": "user", "content": prompt}])
        started = time.perf_counter()
        result = self.engine.generate(ids, max_new_tokens=self.max_new, temperature=0.0,  # the app's other defaults
                                      timed_alone=TimedAlone(DEFAULTS["time_alone_every"]))
        out = {"prompt": prompt, "prompt_index": index, "tokens": len(result.tokens), "decode_tokens_per_s": result.tokens_per_second,
               "first_token_s": result.first_token_s, "wall_s": time.perf_counter() - started,
               "tuner": self.tuner.origin if self.tuner else None}
        self.log(f"headless: {out['tokens']} tokens, {result.tokens_per_second:.2f} tokens/s, first token after "
                 f"{out['first_token_s']:.2f} s (profile: {out['tuner']})")
        return out


def peer(prompts: list[str], max_new: int, log) -> list[dict] | str:
    """llama.cpp target-only on the same prompts (chat template applied the same way), or why not."""
    from engine.models.loading import load_default_pair
    from engine.models.prompts import encode_chat
    from bench.peer.llama_cpp import TARGET_ONLY, PeerError, PeerRequest, peer_binaries, peer_configurations, run_peer

    binaries, reason = peer_binaries()
    if binaries is None:
        return reason
    tokenizer = load_default_pair()[2]
    ids = [encode_chat(tokenizer, [{"role": "user", "content": p}]) for p in prompts]
    try:
        runs = run_peer(PeerRequest(ids, max_new), configs=[c for c in peer_configurations() if c.name == TARGET_ONLY],
                        binaries=binaries, log=lambda *a, **k: log(" ".join(map(str, a))))
    except PeerError as exc:
        return str(exc)
    return [{"decode_tokens_per_s": r, "binaries": str(binaries.server.parent)} for r in runs[0].tokens_per_s]


def per_prompt(runs: list[dict], key: str) -> list[float | None]:
    """``key``'s median over the rounds, prompt by prompt (runs in order, ``prompt_index`` naming
    the prompt; a run without one is a prompt of its own)."""
    by_prompt: dict[int, list] = {}
    for i, run in enumerate(runs):
        by_prompt.setdefault(run.get("prompt_index", i), []).append(run[key])
    return [median(values) for _, values in sorted(by_prompt.items())]


def median(values) -> float | None:
    """The median of the values that are not None (the mean of the middle two for an even count)."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ui", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=3, help="bundled chat prompts to send (first N)")
    parser.add_argument("--port", type=int, default=7899)
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    parser.add_argument("--rounds", type=int, default=1, help="times each prompt is sent (ratios: medians)")
    parser.add_argument("--no-headless", action="store_true", help="skip the headless engine run")
    parser.add_argument("--app-args", default="", help="extra launch.py arguments, e.g. '--no-measure'")
    parser.add_argument("--compare", action="store_true",
                        help="tick the page's Compare: after each answer the target alone decodes it in the page too")
    args = parser.parse_args(argv)
    from engine.models.prompts import load_prompt_set

    args.out.mkdir(parents=True, exist_ok=True)
    log = lambda line: print(line, flush=True)  # noqa: E731
    prompts = [p["messages"][-1]["content"] for p in load_prompt_set("chat")[: args.prompts]]
    max_new = 256  # the app's default answer budget
    quiet: list[dict] = []
    process, url = start_app(args.port, args.app_args.split(), log, wait_measure_s=300)
    try:
        # loaded once the app is ready: a first start's measurement of this machine is the profile both use
        solo = None if args.no_headless else Headless(max_new, log)
        # each answer on screen, then the headless engine on its prompt: a drifting host meets both alike
        screen = on_screen(url, prompts, process.pid, log, args.out, rounds=max(1, args.rounds),
                           after_each=None if solo is None else lambda i: quiet.append(solo.decode(prompts[i], i)),
                           compare=args.compare)
    finally:
        process.terminate()
        process.wait(30)
    from engine.kernels.build import simd_path

    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": _cpu(), "kernels": simd_path(), "threads": os.cpu_count(),
              "rounds": max(1, args.rounds), "on_screen": screen, "headless": quiet or None}
    report["llama_cpp_target_only"] = peer(prompts, max_new, log)
    summary = {"on_screen_tokens_per_s": median(r["decode_tokens_per_s"] for r in screen),
               "on_screen_first_token_s": median(r["first_token_s"] for r in screen),
               "engine_in_app_tokens_per_s": median(r["engine_in_app_tokens_per_s"] for r in screen),
               "chromium_cpu_s_per_answer": median(r["chromium_cpu_s"] for r in screen),
               "stats_line_speedup_per_answer": [r["stats_line_speedup"] for r in screen]}
    if args.compare:
        summary["compare_speedup_per_answer"] = [r["compare_speedup"] for r in screen]
        summary["compare_speedup"] = median(r["compare_speedup"] for r in screen)
        summary["compare_target_alone_tokens_per_s"] = median(r["compare_target_alone_tokens_per_s"] for r in screen)
    if report["headless"]:
        summary["headless_tokens_per_s"] = median(r["decode_tokens_per_s"] for r in report["headless"])
        summary["headless_first_token_s"] = median(r["first_token_s"] for r in report["headless"])
        # each answer on screen over the headless answer that followed it, then medians
        ratios = [{"prompt_index": s["prompt_index"], "ratio": s["decode_tokens_per_s"] / h["decode_tokens_per_s"]
                   if s["decode_tokens_per_s"] else None} for s, h in zip(screen, report["headless"])]
        summary["on_screen_over_headless_per_answer"] = [r["ratio"] for r in ratios]
        summary["on_screen_over_headless_per_prompt"] = per_prompt(ratios, "ratio")
        summary["on_screen_over_headless"] = median(r["ratio"] for r in ratios)
    if isinstance(report["llama_cpp_target_only"], list):
        summary["llama_cpp_tokens_per_s"] = median(r["decode_tokens_per_s"] for r in report["llama_cpp_target_only"])
        summary["on_screen_over_llama_cpp"] = summary["on_screen_tokens_per_s"] / summary["llama_cpp_tokens_per_s"]
    report["summary"] = summary
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = args.out / f"bench-ui-{stamp}.json"
    path.write_text(json.dumps(report, indent=2))
    _plot(report, args.out / f"bench-ui-{stamp}.html")
    log(json.dumps(summary, indent=2))
    log(f"saved {path}")
    return 0


def _cpu() -> str:
    from engine.kernels.cpu import cpu_flags

    flags = cpu_flags()
    isa = "avx512-vnni" if {"avx512f", "avx512_vnni"} <= flags else "avx2" if "avx2" in flags else "generic"
    return f"{isa}, {os.cpu_count()} cores"


def _plot(report: dict, path: Path) -> None:
    """Decode tokens/s per prompt: on screen, headless, llama.cpp target-only (an HTML plotly figure)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    alone = [{**r, "decode_tokens_per_s": r["compare_target_alone_tokens_per_s"]} for r in report["on_screen"]
             if r.get("compare_target_alone_tokens_per_s") is not None]
    rows = [("on screen (Chromium)", report["on_screen"]), ("the target alone in the page (Compare)", alone),
            ("headless engine", report["headless"] or []),
            ("llama.cpp target-only", report["llama_cpp_target_only"]
             if isinstance(report["llama_cpp_target_only"], list) else [])]
    for name, runs in rows:
        if runs:
            rates = per_prompt(runs, "decode_tokens_per_s")
            fig.add_bar(name=name, x=[f"prompt {i + 1}" for i in range(len(rates))], y=rates)
    fig.update_layout(title=f"Decode tokens/s, {report['cpu']}, kernels {report.get('kernels')} ({report['date']})",
                      barmode="group",
                      yaxis_title="tokens/s")
    fig.write_html(str(path), include_plotlyjs="cdn")


if __name__ == "__main__":
    sys.exit(main())
