"""Text and HTML the UI shows: model names and formats, method help, the key of the tree, status
lines and the optimizer's pick in words. Pure functions of plain values."""
from __future__ import annotations

import html

from app.views import figures
from app.views.explain_text import describe_setting

METHOD_HELP = {
    "sequoia": "Sequoia: children sampled without replacement (its verifier)",
    "specinfer": "SpecInfer: children sampled independently",
    "chain": "chain: classic speculative decoding along one path of the given depth",
    "topk": "top-k: the draft's top children, the target samples and matches",
    "autoregressive": "the target alone, one token per step",
}

# how each method decides whether a drafted child is kept (temperature > 0)
ACCEPT_RULE = {
    "sequoia": "tries the children in rank order and keeps one with probability min(1, p/q); after a "
               "rejection p becomes the residual and q is renormalised without the rejected token",
    "specinfer": "like sequoia, but q is the draft's distribution as sampled (children drawn independently, "
                 "with replacement), so it is not renormalised",
    "chain": "one child per level: kept with probability min(1, p/q), the classic speculative sampling rule",
    "topk": "the target samples its own token; a child is kept if it is exactly that token",
    "autoregressive": "nothing is drafted: the target writes one token per step",
}

# the embedded pair, by the ids the loaders use
MODEL_NAMES = {"default-target": "Qwen2.5-Coder-1.5B-Instruct", "default-draft": "Qwen2.5-Coder-0.5B-Instruct"}

# a small tree: root on the left, three tokens, one accepted path (green)
LOGO = ("<svg class='sc-logo' width='26' height='26' viewBox='0 0 26 26' aria-hidden='true'>"
        "<path d='M4 13 L12 6 M4 13 L12 20 M12 6 L21 4 M12 6 L21 10' stroke='#94a3b8' stroke-width='1.6' fill='none'/>"
        "<path d='M4 13 L12 6 L21 4' stroke='#15803d' stroke-width='2.4' fill='none'/>"
        "<rect x='1' y='10' width='6' height='6' rx='1.5' fill='#334155'/>"
        "<rect x='9' y='3' width='6' height='6' rx='1.5' fill='#16a34a'/>"
        "<rect x='9' y='17' width='6' height='6' rx='1.5' fill='#f87171'/>"
        "<rect x='18' y='1' width='6' height='6' rx='1.5' fill='#16a34a'/>"
        "<rect x='18' y='7' width='6' height='6' rx='1.5' fill='#cbd5e1'/></svg>")


def model_name(model_id) -> str:
    """The real name of a model id (the embedded pair's ``default-target``/``default-draft``)."""
    model_id = str(model_id or "?")
    return MODEL_NAMES.get(model_id.split(" ")[0], model_id)


def model_format(info: dict, role: str) -> str:
    """How a model of the pair in use is stored, in words: dtype, int4/int8 packing, and for the
    embedded pair where the weights came from (GGUF Q4_K_M, dequantised)."""
    fmt = info.get(f"{role}_format", "none")
    if fmt == "q4k":
        return "int4: the GGUF Q4_K_M blocks as stored"
    words = [fmt] if fmt not in ("none", None) else [str(info.get("dtype", "?"))]
    if str(info.get(role, "")).startswith("default-"):
        words.append("from GGUF Q4_K_M")
    return ", ".join(words)


def method_help(method: str, temperature: float = 1.0) -> str:
    """One line under the Method dropdown: the method and, at T = 0, that every method is greedy."""
    line = METHOD_HELP.get(method, "")
    if method != "autoregressive" and float(temperature or 0) == 0:
        line += ". At T = 0 every method keeps exactly the drafts that match the target's argmax."
    return f"<div class='sc-method-help'>{html.escape(line)}</div>"


def key_html() -> str:
    """The "What am I looking at?" key of the tree, the chart and the accept rules."""
    rules = "".join(f"<li><b>{m}</b>: {html.escape(r)}</li>" for m, r in ACCEPT_RULE.items())
    chip = "<span class='sc-chip sc-chip-{}'>{}</span>".format
    return (
        "<div class='sc-key'>"
        "<p>Each <b>step</b>, the small <b>draft</b> model proposes a tree of tokens; the large <b>target</b> "
        "model checks all of them in one forward pass. The answer is exactly what the target alone would write.</p>"
        "<ul>"
        f"<li>{chip('root', 'root')} the last committed token: the tree grows from it, left to right.</li>"
        f"<li>{chip('accepted', 'accepted')} drafts the target kept: they join the answer (green path).</li>"
        f"<li>{chip('rejected', 'rejected')} drafts the target looked at and refused · "
        f"{chip('unreached', 'never reached')} drafts under a refused token (never checked).</li>"
        f"<li>{chip('bonus', 'bonus')} the target's own next token after the accepted path: every step "
        f"commits at least this one. {chip('unused', 'not used')} accepted, but the answer had already ended.</li>"
        "<li><b>␣</b> is a space and <b>↵</b> a line break inside a token; <b>⇥</b> a tab.</li>"
        "<li>Edges: <b>solid</b> = the draft's first choice among siblings, <b>dashed</b> = its second, "
        "<b>dotted</b> = third or later. Hover a node for the draft's q, the target's p and the verdict.</li>"
        "<li>Numbers are <b>measured</b> (this answer, or the target alone run on this machine), "
        "<b>estimated</b> (the target alone, from the device profile) or <b>predicted</b> "
        "(from the acceptance calibration).</li>"
        "</ul><p><b>Accept rule</b> (temperature &gt; 0; at T = 0 a draft is kept iff it is the target's argmax):</p>"
        f"<ul>{rules}</ul></div>")


def describe_choice(choice, markup: bool = False) -> str:
    """The optimizer's pick in words; a one-node pick means drafting does not pay on this device."""
    bold = (lambda t: f"<b>{t}</b>") if markup else (lambda t: t)
    if choice.size == 1:
        return (f"{bold('the target alone')}: on this device's profile no tree is predicted to beat plain "
                f"decoding (verification of a few tokens costs several single-token forwards)")
    return (f"{bold(describe_setting(choice))} · predicted {choice.expected_tokens:.2f} "
            f"tokens/step · predicted {bold(f'{choice.predicted_speedup:.2f}×')} the target alone")


def describe_decision(decision) -> str:
    """The tree an answer decodes with (an :class:`engine.core.settings.TreeDecision`), in words."""
    tree, method = decision.tree, decision.method
    if decision.choice is not None:
        return f"{method}, auto: {describe_setting(decision.choice)}"
    if not decision.drafts:
        return "autoregressive: the target alone, 1 token per step, no draft"
    if method == "chain":
        return f"chain: {tree.depth} draft tokens in a row ({tree.size} nodes)"
    kind = "a chain" if tree.size == tree.depth + 1 else "a DP-shaped tree"
    return f"{method} on {kind}: {tree.size} nodes, depth {tree.depth}"


def dropped_notice(dropped: int, context: int) -> str:
    """What the status says when the oldest messages did not fit the context ("" for none)."""
    if not dropped:
        return ""
    return (f"The {dropped} oldest message{'s' if dropped > 1 else ''} did not fit the {context}-token context "
            f"and {'were' if dropped > 1 else 'was'} left out of the prompt (the system prompt is kept).")


def format_seconds(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _params(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n / 1e3:.0f} K"


def pair_markdown(info: dict) -> str:
    if not info:
        return "No models loaded."
    return (f"- **target** {_named(info.get('target'))} ({_params(info.get('target_params', 0))} parameters"
            f"{_weights(info.get('target_format', 'none'), info.get('target_stored'))})\n"
            f"- **draft** {_named(info.get('draft'))} ({_params(info.get('draft_params', 0))} parameters"
            f"{_weights(info.get('draft_format', 'none'), info.get('draft_stored'))})\n"
            f"- **device** `{info.get('device', '?')}` · **dtype** `{info.get('dtype', '?')}` · "
            f"**context** {info.get('max_context', 0) or '?'} tokens")


def _named(model_id) -> str:
    name = model_name(model_id)
    return f"**{name}** (`{model_id}`)" if name != str(model_id) else f"`{model_id}`"


def _weights(fmt: str, stored: str | None = None) -> str:
    """How a model's weights are held: a GGUF file's block types as stored, else the format."""
    if stored:
        return f", as stored: {stored}"
    return "" if fmt == "none" else f", {fmt} weights"


def header_html(title: str, info: dict) -> str:
    pair = (f"<b>{html.escape(model_name(info.get('target')))}</b> ({html.escape(model_format(info, 'target'))})"
            f" ← draft <b>{html.escape(model_name(info.get('draft')))}</b> ({html.escape(model_format(info, 'draft'))})"
            f" · {html.escape(str(info.get('device', '?')))}") if info else ""
    return (f"<div class='sc-header'><div class='sc-brand'>{LOGO}"
            f"<span class='sc-title'>{html.escape(title)}</span>"
            f"<span class='sc-sub'>tree speculative decoding, shown live</span></div>"
            f"<div class='sc-pair' title='target ← draft · device'>{pair}</div></div>")


def status_html(text: str, kind: str = "info") -> str:
    return f"<div class='sc-status sc-{kind}'>{text}</div>" if text else ""


def step_text_html(tokenizer, steps, index: int) -> str:
    """Under the replay slider: the end of the answer up to step ``index`` with the tokens that step
    committed marked, so the replayed tree is tied to the text it wrote."""
    if not steps or index is None or not 0 <= index < len(steps):
        return ""
    before = [t for s in steps[:index] for t in s.committed]
    now = list(steps[index].committed)
    context = tokenizer.decode(before, skip_special_tokens=True)[-90:] if before else ""
    written = tokenizer.decode(now, skip_special_tokens=False) if now else ""
    return (f"<div class='sc-step-text' title='the answer so far; the marked text is what this step committed'>"
            f"<span class='sc-step-label'>Step {index + 1} wrote:</span> "
            f"<span class='sc-step-before'>{'…' if len(before) else ''}{html.escape(context)}</span>"
            f"<mark class='sc-step-now'>{html.escape(figures.visible_token(written, 80)) if written else '∅'}</mark></div>")
