"""Benchmark: target-only decoding, Hugging Face's ``generate`` and assisted generation, and tree
speculative decoding, side by side in one process.

``python -m bench.decode --quick`` prints a table (tokens/s, ratio to target-only, tokens/step,
draft share) and writes the raw figures to ``results/bench-*.json``. Runs are interleaved per
prompt so machine noise hits every configuration alike; figures are medians over the runs, plus
each row's tokens over its decode time across all runs ("all answers": weighted by answer length,
where the median counts a two-token answer as much as a long one). ``--temperature``
samples (outputs are compared with target-only decoding at temperature 0 only). With
``--device cuda`` it runs the GPU benchmark (:mod:`bench.gpu`). ``--peer llama.cpp`` also
runs llama.cpp (:mod:`bench.peer.llama_cpp`, built by ``make peer``) on the same GGUF files, prompts, token
counts and sampling, prompt by prompt right after ours (so both meet the same load on a shared
machine), and adds a "vs llama.cpp target-only" ratio to every row.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import platform
import resource
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.trees.tree import Tree


@dataclass
class ConfigRuns:
    """Per-prompt measurements of one configuration: our engine with ``tree`` (a Tree, ``"auto"``
    for the hardware-aware optimizer's, None for the target alone) and ``method``, or Hugging
    Face's ``generate`` with ``hf`` keyword arguments (``{}``: target only; ``assistant_model``:
    assisted)."""

    name: str
    tree: Tree | str | None
    hf: dict | None = None
    method: str = "sequoia"
    tokens_per_s: list[float] = field(default_factory=list)
    tokens_per_step: list[float] = field(default_factory=list)
    draft_share: list[float] = field(default_factory=list)
    step_ms: list[dict[str, float]] = field(default_factory=list)  # per prompt: mean ms per step by phase
    outputs: list[list[int]] = field(default_factory=list)
    tokens_generated: list[int] = field(default_factory=list)  # per run, as tokens_per_s
    predicted_speedup: float | None = None  # the optimizer's, for tree="auto"
    predicted_tokens_per_step: float | None = None
    predicted_step_ms: float | None = None
    chosen: Tree | None = None               # the tree "auto" resolved to
    confidence: float = 0.0                  # its growth threshold (0: the whole tree every step)
    copies: bool = False                     # continuations copied from the context beside the tree
    predicted: bool = False                  # the prompt's code block given as the expected output
    copied_per_step: list[float] = field(default_factory=list)  # per run: accepted copied tokens per step

    def summary(self, baseline_tps: float) -> dict:
        tps = statistics.median(self.tokens_per_s)
        tree = self.chosen or (self.tree if isinstance(self.tree, Tree) else None)
        step_ms = {phase: statistics.median(run[phase] for run in self.step_ms)
                   for phase in ("draft", "verify", "bookkeeping")} if self.step_ms else None
        return {"name": self.name, "method": self.method, "tree": tree.to_dict() if tree else None,
                "tree_size": tree.size if tree else None, "tree_depth": tree.depth if tree else None,
                "confidence": self.confidence,
                "tokens_per_s": tps, "ms_per_token": 1e3 / tps, "speedup": tps / baseline_tps,
                "predicted_speedup": self.predicted_speedup,
                "measured_over_predicted": tps / baseline_tps / self.predicted_speedup if self.predicted_speedup else None,
                "predicted_tokens_per_step": self.predicted_tokens_per_step,
                "predicted_step_ms": self.predicted_step_ms,
                "step_ms_total": sum(step_ms.values()) if step_ms else None,
                "tokens_per_step": statistics.median(self.tokens_per_step) if self.tokens_per_step else None,
                "copies": self.copies,
                "copied_per_step": statistics.median(self.copied_per_step) if self.copied_per_step else None,
                "draft_share": statistics.median(self.draft_share) if self.draft_share else None,
                "step_ms": step_ms, "runs_tokens_per_s": self.tokens_per_s,
                "runs_tokens_generated": self.tokens_generated,
                "all_answers_tokens_per_s": all_answers_rate(self.tokens_generated, self.tokens_per_s)}


def code_block(text: str) -> str:
    """The first fenced code block of ``text`` (its body), or the whole text."""
    start = text.find("```")
    if start < 0:
        return text
    body = text[text.index("\n", start) + 1:]
    end = body.find("```")
    return body if end < 0 else body[:end]


def all_answers_rate(tokens: list[int], tokens_per_s: list[float]) -> float | None:
    """Every run's tokens over every run's decode time: throughput weighted by answer length, where the
    median of the runs' rates counts a two-token answer as much as a long one (None without counts)."""
    if not tokens or len(tokens) != len(tokens_per_s) or min(tokens_per_s) <= 0:
        return None
    return sum(tokens) / sum(n / rate for n, rate in zip(tokens, tokens_per_s))


def configurations(quick: bool, draft=None, acceptance: list[float] | None = None, auto: bool = False,
                   greedy: bool = True, hf: bool = True, copies: bool = False,
                   predicted: bool = False) -> list[ConfigRuns]:
    """Baselines first (target-only is the reference of every ratio), then ours. ``acceptance``
    shapes the fixed-size Sequoia trees (default: the embedded pair's greedy calibration);
    ``hf=False`` leaves out Hugging Face's generate and assisted generation; ``copies`` adds the
    target alone and the optimizer's tree with continuations copied from the context, and leaves
    out the fixed-size trees; ``predicted`` adds the optimizer's tree given the prompt's code as the
    expected output (as OpenAI's Predicted Outputs would pass it)."""
    if acceptance is None:
        from engine.tuning.acceptance import default_acceptance

        acceptance = default_acceptance()
    configs = [ConfigRuns("target-only", None)] + ([ConfigRuns("HF generate, target only", None, hf={})] if hf else [])
    if draft is not None and hf:
        configs.append(ConfigRuns("HF assisted generation (default schedule)", None, hf={"assistant_model": draft}))
        configs += [ConfigRuns(f"HF assisted generation, {k} draft tokens", None,
                               hf={"assistant_model": draft, "num_assistant_tokens": k,
                                   "num_assistant_tokens_schedule": "constant"}) for k in ((4,) if quick else (2, 4, 6))]
    if copies:
        configs.append(ConfigRuns("target + copies", None, copies=True))
        if draft is not None and auto:
            configs += [ConfigRuns("sequoia, optimizer's tree", "auto"),
                        ConfigRuns("sequoia, optimizer's tree + copies", "auto", copies=True)]
            if predicted:
                configs.append(ConfigRuns("sequoia, optimizer's tree + prediction", "auto", copies=True,
                                          predicted=True))
        return configs
    if draft is not None:
        if auto:
            configs.append(ConfigRuns("sequoia, optimizer's tree", "auto"))
            configs.append(ConfigRuns("sequoia, optimizer's fixed tree", "auto-fixed"))
        sizes = ((8, 4), (16, 6)) if quick else ((8, 4), (16, 6), (32, 8))
        configs += [ConfigRuns(f"sequoia n={n} d={d}", Tree.optimal(acceptance, n, d)) for n, d in sizes]
        if not greedy:
            configs += [ConfigRuns(f"specinfer n={n} d={d}", Tree.optimal(acceptance, n, d), method="specinfer")
                        for n, d in sizes[-1:]]
        depths = (2, 3, 5) if quick else (2, 3, 4, 5, 6)
        configs += [ConfigRuns(f"chain d={d}", Tree.chain(d), method="chain" if not greedy else "sequoia")
                    for d in depths]
    return configs


@dataclass(frozen=True)
class BenchPlan:
    """What :func:`run` measures: ``prompts`` of the ``prompt_set`` (``chat`` or ``code-edit``,
    assets/prompts), ``new_tokens`` each, ``repeats`` rounds, at this temperature and top-p;
    ``quick``: fewer configurations; ``hf``: Hugging Face's own decoding beside ours; ``copies``:
    our configurations with copies from the context and llama.cpp's n-gram modes; ``peer``
    ("llama.cpp") on ``peer_ggufs`` (default: the embedded pair's); the embedded target in
    ``target_format``."""

    prompts: int
    new_tokens: int
    quick: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    repeats: int = 1
    peer: str | None = None
    peer_ggufs: tuple[Path, Path] | None = None
    target_format: str = "auto"
    hf: bool = True
    prompt_set: str = "chat"
    copies: bool = False


def run(plan: BenchPlan, out_dir: Path, pair: tuple | None = None) -> dict:
    """The benchmark on ``pair`` = (target, draft, tokenizer), by default the embedded pair:
    ``plan.repeats`` rounds over the prompts (each round runs every configuration on a prompt before
    the next prompt); medians over all runs. Outputs are compared with target-only decoding at
    temperature 0 only. With a peer, llama.cpp's configurations run on each prompt right after ours
    (:class:`PeerSide`); when it is not built, one line says so and the benchmark goes on without it."""
    from engine.core.speculative import SpeculativeEngine
    from engine.models.loading import PairFormats, load_default_pair, pair_name
    from engine.models.prompts import encode_chat, load_prompt_set
    from engine.tuning.acceptance import acceptance_for
    from engine.tuning.optimizer import load_tuner
    from engine.tuning.planner import TreePlanner

    target, draft, tokenizer = pair or load_default_pair(formats=PairFormats(target=plan.target_format))
    name = pair_name("default-target", "default-draft", draft, target) if pair is None else None
    tuner = load_tuner(name, target) if name else None
    engine = SpeculativeEngine(target, draft, planner=TreePlanner(name, tuner) if name else None)
    prompt_set_entries = load_prompt_set(plan.prompt_set)[:plan.prompts]
    prompt_ids = [encode_chat(tokenizer, p["messages"]) for p in prompt_set_entries]
    # the code each code-edit prompt pastes: what a client would give as the expected output
    predictions = [tokenizer.encode(code_block(p["messages"][-1]["content"]), add_special_tokens=False)
                   for p in prompt_set_entries] if plan.prompt_set == "code-edit" else None
    configs = configurations(plan.quick, draft, acceptance_for(name, plan.temperature, plan.top_p) if name else None,
                             auto=tuner is not None, greedy=plan.temperature == 0, hf=plan.hf, copies=plan.copies,
                             predicted=predictions is not None)
    engine.generate(prompt_ids[0], max_new_tokens=4, tree=Tree.chain(2), copies=False)  # warm-up
    ours, theirs = [c for c in configs if c.hf is None], [c for c in configs if c.hf is not None]
    peer_side = PeerSide(plan.peer, prompt_ids, tokenizer, plan.new_tokens, plan.temperature, plan.top_p,
                         plan.peer_ggufs if plan.peer_ggufs or pair is not None else "default",
                         ngram=plan.copies) if plan.peer else None
    for config in ours:
        if config.tree == "auto-fixed":  # the best tree without growth by confidence, for comparison
            config.tree = tuner.choose(plan.temperature, plan.top_p, config.method, grown=False)
    for round_ in range(plan.repeats):
        for i, ids in enumerate(prompt_ids):
            for config in ours:
                _decode_ours(engine, config, plan, ids, (round_, i), predictions[i] if config.predicted else None)
            with stock_weights(target):  # Hugging Face as its users run it: torch's own linear layers
                prefill_s = timed_prefill(target, ids)
                for config in theirs:
                    tokens, seconds = hf_generate(target, tokenizer, ids, plan.new_tokens, config.hf,
                                                  plan.temperature, plan.top_p)
                    config.tokens_per_s.append(len(tokens) / max(seconds - prefill_s, 1e-9))  # decode rate
                    config.tokens_generated.append(len(tokens))
                    config.outputs.append(tokens)
                    print(f"prompt {i}: {config.name:<42} {config.tokens_per_s[-1]:6.2f} tok/s", flush=True)
            if peer_side is not None:
                peer_side.run(round_, i)
    peer_runs, peer_info = peer_side.finish() if peer_side is not None else ([], None)
    report = _report(plan, name, configs, peer_runs, peer_info)
    _save_and_print(report, out_dir, peer_runs, peer_info)
    return report


def _decode_ours(engine, config: ConfigRuns, plan: BenchPlan, ids: list[int], where: tuple[int, int],
                 prediction: list[int] | None) -> None:
    """One of our configurations on one prompt (``where``: its round and index, which seed it)."""
    from engine.tuning.optimizer import TreeChoice

    round_, i = where
    choice = config.tree if isinstance(config.tree, TreeChoice) else None
    result = engine.generate(ids, max_new_tokens=plan.new_tokens, tree=choice.tree if choice else config.tree,
                             temperature=plan.temperature, top_p=plan.top_p, seed=i + 1000 * round_,
                             method=config.method, confidence=choice.confidence if choice else None,
                             copies=config.copies, prediction=prediction)
    if config.tree == "auto":
        choice = result.decision.choice
    if choice is not None:
        config.chosen, config.predicted_speedup = choice.tree, choice.predicted_speedup
        config.confidence = choice.confidence
        config.predicted_tokens_per_step, config.predicted_step_ms = choice.expected_tokens, 1e3 * choice.step_time_s
    config.tokens_per_s.append(result.tokens_per_second)
    config.tokens_per_step.append(result.tokens_per_step)
    config.copied_per_step.append(sum(s.accepted_by_source()["copy"] for s in result.steps) / len(result.steps))
    config.draft_share.append(sum(s.timings.draft_s for s in result.steps) / result.decode_s)
    config.step_ms.append({phase: 1e3 * statistics.fmean(getattr(s.timings, f"{phase}_s") for s in result.steps)
                           for phase in ("draft", "verify", "bookkeeping")})
    config.outputs.append(result.tokens)
    config.tokens_generated.append(len(result.tokens))
    print(f"prompt {i}: {config.name:<42} {result.tokens_per_second:6.2f} tok/s "
          f"{result.tokens_per_step:5.2f} tok/step", flush=True)


def _report(plan: BenchPlan, name: str | None, configs: list, peer_runs: list, peer_info: dict | None) -> dict:
    """The run's JSON: the machine, the plan, every configuration's summary against ours and llama.cpp's
    target alone."""
    baseline = statistics.median(configs[0].tokens_per_s)
    greedy = plan.temperature == 0
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "prompts": plan.prompts,
        "repeats": plan.repeats, "new_tokens": plan.new_tokens, "temperature": plan.temperature, "top_p": plan.top_p,
        "pair": name, "prompt_set": plan.prompt_set,
        "outputs_identical_to_target_only": greedy and all(c.outputs == configs[0].outputs
                                                           for c in configs if c.hf is None),
        "hf_outputs_identical_to_target_only": greedy and all(c.outputs == configs[0].outputs
                                                              for c in configs if c.hf is not None),
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "results": [c.summary(baseline) for c in configs] + [peer_summary(r, baseline) for r in peer_runs],
    }
    if peer_info is not None:
        report["peer"] = peer_info
    peer_reference = next((r["tokens_per_s"] for r in report["results"] if r["name"] == PEER_TARGET_ONLY), None)
    for r in report["results"]:
        r["vs_llamacpp_target_only"] = r["tokens_per_s"] / peer_reference if peer_reference else None
    return report


def _save_and_print(report: dict, out_dir: Path, peer_runs: list, peer_info: dict | None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=2))
    plot(report, path.with_suffix(".html"))
    print()
    print(markdown_table(report))
    greedy, identical = report["temperature"] == 0, report["outputs_identical_to_target_only"]
    compared = (f"outputs identical to target-only: {identical} (HF generate and assisted: "
                f"{report['hf_outputs_identical_to_target_only']})" if greedy
                else "outputs sampled (compared with target-only at temperature 0 only)")
    print(f"\n{compared}; peak RSS {report['peak_rss_gib']:.1f} GiB; saved {path} and .html")
    if peer_runs and greedy:
        print(f"llama.cpp outputs identical to llama.cpp target-only: {peer_info['outputs_identical_to_target_only']}")
    for name, error in (peer_info or {}).get("failed", {}).items():
        print(f"{name}: failed, left out: {error}")


PEER_TARGET_ONLY = "llama.cpp target-only"


class PeerSide:
    """llama.cpp's configurations (:func:`bench.peer.llama_cpp.run_peer`) on the bench's prompts,
    one prompt at a time (:meth:`run`, called right after ours on that prompt), or none, with one
    line saying why: not built, no GGUF files for a non-default pair, or a failed run. A
    configuration that fails is left out from then on; the peer never costs us our own figures."""

    def __init__(self, peer: str, prompt_ids: list[list[int]], tokenizer, new_tokens: int, temperature: float,
                 top_p: float, ggufs, ngram: bool = False) -> None:
        from bench.peer import llama_cpp as peer_mod
        if peer != "llama.cpp":
            raise ValueError(f"unknown peer {peer!r} (only llama.cpp)")
        self.peer_mod, self.prompt_ids, self.new_tokens = peer_mod, prompt_ids, new_tokens
        self.temperature, self.top_p, self.ngram = temperature, top_p, ngram
        self.runs: dict[str, object] = {}   # configuration name -> PeerRuns over the prompts run so far
        self.failed: dict[str, str] = {}    # configuration name -> why it stopped
        self.skipped: str | None = None
        self.binaries, reason = peer_mod.peer_binaries()
        if self.binaries is None:
            self._skip(reason)
        elif ggufs is None:
            self._skip("llama.cpp peer skipped: it runs on GGUF files, and this pair has none (pass peer_ggufs)")
        else:
            try:
                self.ggufs = peer_mod.default_ggufs() if ggufs == "default" else tuple(Path(g) for g in ggufs)
                self.texts = [tokenizer.decode(ids, skip_special_tokens=False) for ids in prompt_ids]
            except Exception as exc:  # noqa: BLE001 - e.g. the embedded pair not assembled
                self._skip(f"llama.cpp peer failed: {exc}")

    def _skip(self, reason: str) -> None:
        print(reason, flush=True)
        self.skipped, self.runs = reason, {}

    def run(self, round_: int, index: int) -> None:
        """Every configuration still standing on prompt ``index`` of round ``round_``."""
        if self.skipped:
            return
        configs = [c for c in self.peer_mod.peer_configurations(self.ngram) if c.name not in self.failed]
        try:
            request = self.peer_mod.PeerRequest(self.prompt_ids, self.new_tokens, self.temperature, self.top_p,
                                                prompt_texts=self.texts, order=[(round_, index)])
            runs = self.peer_mod.run_peer(request, configs=configs, binaries=self.binaries, ggufs=self.ggufs)
        except Exception as exc:  # noqa: BLE001 - the peer must never cost us our own figures
            self._skip(f"llama.cpp peer failed: {exc}")
            return
        for runs_ in runs:
            self.runs.setdefault(runs_.name, self.peer_mod.PeerRuns(runs_.config)).results.extend(runs_.results)
            if runs_.error is not None:
                self.failed[runs_.name] = runs_.error

    def finish(self) -> tuple[list, dict]:
        """``(the configurations that ran everywhere, the report's "peer" entry)``."""
        if self.skipped:
            return [], {"name": "llama.cpp", "skipped": self.skipped}
        if self.temperature == 0:
            self.peer_mod.mark_same_as_target_only(list(self.runs.values()))
        runs = [r for name, r in self.runs.items() if name not in self.failed]
        flags = [r.identical_to_target_only() for r in runs]
        return runs, {"name": "llama.cpp", "skipped": None, "failed": self.failed, "interleaved": True,
                      "version": f"llama-cpp-python {self.peer_mod.PEER_VERSION} sdist, vendor/llama.cpp",
                      "threads": self.peer_mod.DEFAULT_THREADS, "ggufs": [str(g) for g in self.ggufs],
                      "binaries": self.binaries.as_dict(),
                      "outputs_identical_to_target_only": None if any(f is None for f in flags) else all(flags)}


def peer_summary(runs, baseline_tps: float) -> dict:
    """A peer configuration's row in the report's format (our-engine-only fields left empty)."""
    from dataclasses import asdict

    tps = runs.median_tokens_per_s()
    acceptance = [r.draft_accepted / r.draft_tokens for r in runs.results if r.draft_tokens]
    tokens = [r.tokens for r in runs.results]
    return {"name": runs.name, "method": "llama.cpp", "peer": "llama.cpp", "peer_config": asdict(runs.config),
            "tree": None, "tree_size": None, "tree_depth": None,
            "tokens_per_s": tps, "ms_per_token": 1e3 / tps, "speedup": tps / baseline_tps,
            "predicted_speedup": None, "measured_over_predicted": None, "predicted_tokens_per_step": None,
            "predicted_step_ms": None, "step_ms_total": None, "tokens_per_step": None, "draft_share": None,
            "step_ms": None, "runs_tokens_per_s": runs.tokens_per_s,
            "runs_tokens_generated": tokens, "all_answers_tokens_per_s": all_answers_rate(tokens, runs.tokens_per_s),
            "draft_acceptance": statistics.median(acceptance) if acceptance else None,
            "outputs_identical_to_peer_target_only": runs.identical_to_target_only()}


def hf_generate(target, tokenizer, ids: list[int], new_tokens: int, options: dict, temperature: float = 0.0,
                top_p: float = 1.0) -> tuple[list[int], float]:
    """Hugging Face's own ``generate`` (target only, or assisted): new tokens and seconds.

    Assisted generation reads its schedule from the assistant's ``generation_config`` (and its
    default "heuristic" schedule carries over between calls): each run starts from the
    assistant's original config, with ``num_assistant_tokens*`` options applied there."""
    options = dict(options)
    assistant = options.get("assistant_model")
    schedule = {k: options.pop(k) for k in ("num_assistant_tokens", "num_assistant_tokens_schedule") if k in options}
    inputs = torch.tensor([ids])
    sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 else \
        {"do_sample": False}
    saved = copy.deepcopy(assistant.generation_config) if assistant is not None else None
    try:
        if assistant is not None:
            for key, value in schedule.items():
                setattr(assistant.generation_config, key, value)
        start = time.perf_counter()
        with torch.inference_mode():
            out = target.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=new_tokens,
                                  pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id, **sampling, **options)
        seconds = time.perf_counter() - start
    finally:
        if assistant is not None:
            assistant.generation_config = saved
    return out[0, len(ids):].tolist(), seconds


def timed_prefill(model, ids: list[int]) -> float:
    """Seconds of one forward over the whole prompt (what ``generate`` does first)."""
    start = time.perf_counter()
    with torch.inference_mode():
        model(torch.tensor([ids]))
    return time.perf_counter() - start


@contextlib.contextmanager
def stock_weights(model):
    """``model`` with torch's own linear layers inside the block, packed again after it."""
    from engine.backends.kernels import pack_linears, unpack_linears

    packed = unpack_linears(model)
    try:
        yield model
    finally:
        if packed:
            pack_linears(model)


def plot(report: dict, path: Path) -> None:
    """Tokens/s of every configuration (ours and Hugging Face's), target-only as the reference line."""
    import plotly.graph_objects as go

    results = report["results"]
    colours = ["#e07b39" if r.get("peer") else "#9aa5b1" if r["name"].startswith("HF")
               else "#2f6fdf" if r["name"].startswith("sequoia")
               else "#7a7f87" if r["name"] == "target-only" else "#5fa8d3" for r in results]
    fig = go.Figure(go.Bar(x=[r["name"] for r in results], y=[r["tokens_per_s"] for r in results], marker_color=colours,
                           text=[f"{r['speedup']:.2f}×" for r in results], textposition="outside"))
    fig.add_hline(y=results[0]["tokens_per_s"], line_dash="dot", annotation_text="target-only")
    peer_reference = next((r for r in results if r["name"] == PEER_TARGET_ONLY), None)
    if peer_reference is not None:
        fig.add_hline(y=peer_reference["tokens_per_s"], line_dash="dash", line_color="#e07b39",
                      annotation_text="llama.cpp target-only", annotation_position="bottom right")
    fig.update_layout(title=f"Decoding speed, T = {report['temperature']:g}, top-p {report['top_p']:g} "
                            f"({report['prompts']} prompts x {report['new_tokens']} tokens x {report.get('repeats', 1)} "
                            f"rounds, medians; {report['date']})",
                      yaxis_title="tokens/s", template="plotly_white", height=520)
    fig.write_html(path)  # plotly.js embedded: the plot opens offline


def markdown_table(report: dict) -> str:
    """One row per configuration; with a peer, a "vs llama.cpp target-only" column for every row."""
    with_peer = any(r.get("vs_llamacpp_target_only") is not None for r in report["results"])
    rows = ["| configuration | tree (n, d) | tokens/s | ms/token | vs target-only | "
            + ("vs llama.cpp target-only | " if with_peer else "")
            + "predicted | tokens/step | draft share | all answers tokens/s |",
            "|---|---|---|---|---|---|---|---|---|" + ("---|" if with_peer else "")]
    for r in report["results"]:
        tree = "" if r.get("tree_size") is None else f"{r['tree_size']}, {r['tree_depth']}"
        if r.get("confidence"):
            tree += f", grown at ≥ {r['confidence']:g}"
        predicted = "" if r.get("predicted_speedup") is None else f"{r['predicted_speedup']:.2f}×"
        per_step = "" if r["tokens_per_step"] is None else f"{r['tokens_per_step']:.2f}"
        if r.get("copied_per_step"):
            per_step += f" ({r['copied_per_step']:.2f} copied)"
        share = "" if r["draft_share"] is None else f"{r['draft_share']:.0%}"
        peer_ratio = f"{r['vs_llamacpp_target_only']:.2f}× | " if with_peer else ""
        everything = "" if r.get("all_answers_tokens_per_s") is None else f"{r['all_answers_tokens_per_s']:.2f}"
        rows.append(f"| {r['name']} | {tree} | {r['tokens_per_s']:.2f} | {r['ms_per_token']:.0f} | {r['speedup']:.2f}× | "
                    f"{peer_ratio}{predicted} | {per_step} | {share} | {everything} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.decode", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="2 prompts x 64 tokens, chains only")
    parser.add_argument("--prompts", type=int, default=None, help="number of bundled prompts (default 2 quick, 6 full)")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens per run (default 64 quick, 128 full)")
    parser.add_argument("--repeats", type=int, default=None, help="rounds over the prompts (default 1 quick, 2 full)")
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (outputs are then compared)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--prompt-set", choices=("chat", "code-edit"), default="chat",
                        help="chat questions, or code pasted with a request to give it back changed")
    parser.add_argument("--copies", action="store_true",
                        help="ours with continuations copied from the context (and llama.cpp's n-gram modes with --peer)")
    parser.add_argument("--target-format", choices=("float32", "int4", "auto"), default="auto",
                        help="the target's weights on CPU (see python -m engine.cli.generate --help)")
    parser.add_argument("--target", default=None, help="a GGUF file (or HF id) as the target (default: the embedded 1.5B)")
    parser.add_argument("--draft", default=None, help="a GGUF file (or HF id) as the draft (default: the embedded 0.5B)")
    parser.add_argument("--no-hf", action="store_true", help="leave out Hugging Face's generate and assisted generation")
    parser.add_argument("--peer", choices=["llama.cpp"], default=None,
                        help="also run llama.cpp on the same GGUF files, prompts and sampling (build it with `make peer`)")
    parser.add_argument("--device", default="cpu", help="cpu (the default pair) or cuda (see --synthetic)")
    parser.add_argument("--synthetic", default=None, metavar="TARGET+DRAFT",
                        help="GPU benchmark on random-weight models of these shapes, e.g. llama2-7b+llama-68m "
                             "(python -m bench.gpu --help for its options)")
    args, rest = parser.parse_known_args(argv)
    if args.device != "cpu" or args.synthetic:
        from bench import gpu as bench_gpu
        return bench_gpu.main(["--synthetic", args.synthetic or "llama2-7b+llama-68m", "--out", str(args.out), *rest])
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    prompts = args.prompts or (2 if args.quick else 6)
    new_tokens = args.new_tokens or (64 if args.quick else 128)
    repeats = args.repeats or (1 if args.quick else 2)
    if min(prompts, new_tokens, repeats) < 1:
        parser.error("--prompts, --new-tokens and --repeats must be at least 1")
    pair, files = None, None
    if args.target or args.draft:  # the user's own files: both sides run them, llama.cpp on the same files
        from engine.models.loading import PairFormats, gguf_file_of, load_pair

        target, draft = args.target or "default-target", args.draft or "default-draft"
        pair = load_pair(target, draft, formats=PairFormats(target=args.target_format))
        files = (gguf_file_of(target), gguf_file_of(draft))
        files = None if None in files else files
    run(BenchPlan(prompts, new_tokens, args.quick, temperature=args.temperature, top_p=args.top_p, repeats=repeats,
                  peer=args.peer, peer_ggufs=files, target_format=args.target_format, hf=not args.no_hf,
                  prompt_set=args.prompt_set, copies=args.copies), args.out, *([pair] if pair else []))


if __name__ == "__main__":
    from engine.backends.hugepages import restart_with_huge_pages

    restart_with_huge_pages()
    main()
