"""The teaching views' sentences about the optimizer: where a profile comes from, a pick in
words, and why the optimizer's pick beats the user's setting (:func:`explain_choice`), from the
numbers :mod:`engine.tuning.explain` and :mod:`engine.tuning.optimizer` compute."""
from __future__ import annotations

import json
from pathlib import Path

from engine.tuning.optimizer import TreeChoice
from engine.tuning.profile import HardwareProfile


def profile_source(profile: HardwareProfile, directories: list[tuple[str, Path]] | None = None) -> str:
    """Where ``profile`` comes from, in words: the file that holds exactly these measurements, the
    one bundled in ``assets/`` first (a user cache may hold a copy of it), then the user cache's;
    or "not saved"."""
    from engine.tuning.profile import profile_path

    if directories is None:
        from engine.user_cache import cache_dir
        from engine.models.prompts import ASSETS

        directories = [("bundled with the app", ASSETS), ("from the user cache", cache_dir())]
    for words, directory in directories:
        path = profile_path(Path(directory) / "profiles", profile.device, profile.pair, profile.dtype)
        try:
            if path.exists() and HardwareProfile.from_json(path.read_text()) == profile:
                shown = f"assets/profiles/{path.name}" if words == "bundled with the app" else str(path)
                return f"{words}: {shown}"
        except (OSError, ValueError, TypeError, KeyError, json.JSONDecodeError):
            continue
    return "not saved to a file (measured in this session)"


def describe_setting(choice: TreeChoice) -> str:
    if choice.size == 1:
        return "the target alone (no draft)"
    if choice.confidence > 0:
        return f"a chain of up to {choice.depth} grown while the draft's path confidence is ≥ {choice.confidence:g}"
    return f"{choice.size} nodes, depth {choice.depth}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms"


def _numbers(choice: TreeChoice, profile: HardwareProfile) -> str:
    if choice.confidence > 0:  # the tree, so the verify and draft split, changes from step to step
        return (f"G = {choice.expected_tokens:.2f} tokens/step for {_ms(choice.step_time_s)} per step on average, "
                f"predicted {choice.predicted_speedup:.2f}×")
    verify, overhead = profile.target_time(choice.size), profile.step_overhead
    draft = choice.step_time_s - verify - overhead
    other = f" + {_ms(overhead)} other" if overhead > 0 else ""
    if choice.size == 1:
        return f"G = 1 token/step for {_ms(verify)} of target{other} per token, {choice.predicted_speedup:.2f}×"
    return (f"G = {choice.expected_tokens:.2f} tokens/step for {_ms(verify)} verify + {_ms(draft)} draft{other} = "
            f"{_ms(choice.step_time_s)} per step, predicted {choice.predicted_speedup:.2f}×")


def hardware_reason(profile: HardwareProfile) -> str:
    """Why drafting is dear on this device, from its profile: a draft forward in target tokens, and
    what verifying 4 and 8 tokens costs against one."""
    one = profile.target_time(1)
    return (f"on this device one draft forward costs {profile.draft_time(1) / one:.2f}–"
            f"{profile.draft_time(2) / one:.2f} of a target token and verifying 4 / 8 tokens costs "
            f"{profile.target_time(4) / one:.1f}× / {profile.target_time(8) / one:.1f}× one token")


def explain_choice(pick: TreeChoice, mine: TreeChoice, profile: HardwareProfile) -> str:
    """One line, in words and numbers, of why the optimizer's ``pick`` beats ``mine`` (the user's
    setting), or that they are the same. Speedups are over the target alone, predicted from the
    acceptance calibration and the profile."""
    if pick.tree.parents == mine.tree.parents and pick.confidence == mine.confidence:
        line = f"Your setting is the optimizer's pick: {describe_setting(pick)}, {_numbers(pick, profile)}."
        if pick.size == 1:
            line += (f" No tree is predicted to pay for itself: {hardware_reason(profile)}, so the extra "
                     f"accepted tokens never make up for the cost of the step.")
        return line
    if pick.size == 1:
        return (f"The optimizer drafts nothing (the target alone, predicted 1.00×) rather than your "
                f"{describe_setting(mine)}: {_numbers(mine, profile)}. The tree would write "
                f"{mine.expected_tokens:.2f} tokens per step but each step costs "
                f"{mine.step_time_s / profile.token_time():.1f} target tokens' time: {hardware_reason(profile)}.")
    gain = pick.predicted_speedup / mine.predicted_speedup if mine.predicted_speedup > 0 else float("inf")
    if mine.size == 1:
        return (f"The optimizer picks {describe_setting(pick)} over the target alone: {_numbers(pick, profile)}, "
                f"{gain:.2f}× the speed of your setting.")
    why = ("more tokens per step" if pick.expected_tokens > mine.expected_tokens and
           pick.step_time_s >= mine.step_time_s else
           "a cheaper step" if pick.step_time_s < mine.step_time_s and pick.expected_tokens <= mine.expected_tokens
           else "more tokens for a cheaper step" if pick.step_time_s < mine.step_time_s else
           "more tokens per second")
    return (f"The optimizer picks {describe_setting(pick)} over your {describe_setting(mine)} for {why}: "
            f"{_numbers(pick, profile)}, against {_numbers(mine, profile)} for yours "
            f"({gain:.2f}× faster).")
