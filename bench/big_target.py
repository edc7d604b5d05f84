"""A 7B-shaped target (``python -m bench.big_gguf --write``) against llama.cpp, and what the
optimizer would pick for it with the embedded 0.5B draft.

In one run, on the same file: the target's forward over n = 1 .. 32 tree tokens after a 128-token
prefix (``t_T(n)``, as the profile measures it) beside ``llama-bench -p n``; greedy decoding of the
target alone, ours against ``llama-server``'s (the same prompt ids and token count); the embedded
draft's level cost ``t_D(w)``; then the optimizer on that profile with the embedded pair's
calibrated greedy acceptance, and the acceptance (the vector scaled) at which a tree would first
pay 10%. Random weights: the text is noise and acceptance on it meaningless, the timings are not.

    python -m bench.big_target [--file results/qwen2.5-7b-shaped-q4_k_m.gguf]

Writes ``results/big-target-<time>.json`` and prints a table.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import time
from pathlib import Path

import torch

SIZES = (1, 2, 4, 8, 16, 32)
WIDTHS = (1, 2, 4, 8, 16)
DEFAULT_FILE = Path("results/qwen2.5-7b-shaped-q4_k_m.gguf")


def llama_bench_ms(binary: Path, path: Path, n: int, threads: int = 2) -> float:
    """llama-bench's forward over ``n`` prompt tokens, in ms (its pp rate turned into a forward's time)."""
    done = subprocess.run([str(binary), "-m", str(path), "-p", str(n), "-n", "0", "-t", str(threads), "-r", "3",
                           "-o", "json"], capture_output=True, text=True, timeout=900)
    rows = json.loads(done.stdout[done.stdout.index("["):])
    return 1e3 * n / float(rows[0]["avg_ts"])


def ours_decode(model, prompt: list[int], new_tokens: int) -> float:
    from engine import SpeculativeEngine

    engine = SpeculativeEngine(model, model, stop_token_ids=[])
    engine.generate(prompt, max_new_tokens=4, temperature=0, tree=None, copies=False)  # warm
    result = engine.generate(prompt, max_new_tokens=new_tokens, temperature=0, tree=None, copies=False)
    return result.tokens_per_second


def theirs_decode(server_binary: Path, path: Path, prompt: list[int], new_tokens: int) -> float:
    from bench.peer.llama_cpp import HOST, PeerConfig, PeerServer, completion_request, free_port, server_command

    port = free_port(HOST)
    with PeerServer(server_command(server_binary, PeerConfig("target-only"), path, None, port), port) as server:
        server.post("/completion", completion_request(prompt, 4))
        reply = server.post("/completion", completion_request(prompt, new_tokens))
    return float(reply["timings"]["predicted_per_second"])


def pays_at(acceptance: list[float], profile, gain: float = 1.1) -> float | None:
    """The least factor on the acceptance vector at which the optimizer's pick predicts ``gain``."""
    from engine.tuning.optimizer import choose_tree

    for step in range(1, 41):
        scale = step / 40
        if choose_tree([min(1.0, p * scale) for p in acceptance], profile, 64).predicted_speedup >= gain:
            return scale
    return None


def main(argv: list[str] | None = None) -> int:
    from bench.peer.llama_cpp import peer_binaries
    from engine.models.loading import load_pair
    from engine.tuning.calibrate import find_calibrations
    from engine.tuning.optimizer import choose_tree
    from engine.tuning.profile import HardwareProfile, measure_forward

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--file", type=Path, default=DEFAULT_FILE)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args(argv)
    binaries, reason = peer_binaries()
    if binaries is None:
        print(reason)
        return 2
    torch.set_num_threads(2)
    # as the app pairs them: the 7B's 152,064 rows and the draft's 151,936 pass the pair rule (padding)
    target, draft, tokenizer = load_pair(str(args.file), "default-draft")
    prefix = tokenizer("Write a function that parses a date. " * 16)["input_ids"][:128]
    ours = {n: 1e3 * measure_forward(target, prefix, n) for n in SIZES}
    theirs = {n: llama_bench_ms(binaries.bench, args.file, n) for n in SIZES}
    print("n    ours ms   llama-bench ms")
    for n in SIZES:
        print(f"{n:<4} {ours[n]:8.0f} {theirs[n]:10.0f}", flush=True)
    draft_ms = {w: 1e3 * measure_forward(draft, prefix, w, draft_level=True) for w in WIDTHS}
    print("draft t_D(w) ms:", {w: round(v, 1) for w, v in draft_ms.items()}, flush=True)
    ours_rate = ours_decode(target, prefix, args.new_tokens)
    theirs_rate = theirs_decode(binaries.server, args.file, prefix, args.new_tokens)
    print(f"target alone, greedy, {args.new_tokens} tokens: ours {ours_rate:.2f} tok/s, llama-server "
          f"{theirs_rate:.2f} tok/s ({ours_rate / theirs_rate:.2f}x)", flush=True)
    profile = HardwareProfile("this-cpu", "7b-shaped+default-draft", "float32", len(prefix),
                              target={n: v / 1e3 for n, v in ours.items()},
                              draft={w: v / 1e3 for w, v in draft_ms.items()})
    calibrations = find_calibrations("default-target_q4k+default-draft_q4k")
    greedy = next((c for (t, _), c in calibrations.items() if t == 0), None)
    pick, scale = None, None
    if greedy is not None:
        vector = list(greedy.vector)
        choice = choose_tree(vector, profile, 32)
        pick = {"size": choice.size, "depth": choice.depth, "tokens_per_step": round(choice.expected_tokens, 2),
                "predicted_speedup": round(choice.predicted_speedup, 2), "acceptance": [round(p, 3) for p in vector]}
        scale = pays_at(vector, profile)
        print(f"optimizer, the embedded pair's greedy acceptance {pick['acceptance'][:4]}: n={choice.size} "
              f"d={choice.depth}, {choice.expected_tokens:.2f} tokens/step, predicted {choice.predicted_speedup:.2f}x; "
              f"a tree pays 10% from {scale} of that acceptance", flush=True)
    report = {"file": str(args.file), "file_bytes": args.file.stat().st_size, "prefix": len(prefix),
              "t_T_ms": ours, "llama_bench_ms": theirs, "t_D_ms": draft_ms, "new_tokens": args.new_tokens,
              "ours_tokens_per_s": ours_rate, "llama_server_tokens_per_s": theirs_rate, "pick": pick,
              "pays_10pct_at_acceptance_scale": scale, "cpu": _cpu()}
    args.out.mkdir(parents=True, exist_ok=True)
    saved = args.out / f"big-target-{time.strftime('%Y%m%d-%H%M%S')}.json"
    saved.write_text(json.dumps(report, indent=2))
    print(f"saved {saved}")
    return 0


def _cpu() -> str:
    text = Path("/proc/cpuinfo").read_text()
    name = re.search(r"model name\s*:\s*(.*)", text)
    flags = set(re.search(r"flags\s*:\s*(.*)", text)[1].split())
    return f"{name[1] if name else 'cpu'}; " + " ".join(f for f in ("avx2", "avx512f", "avx512_vnni", "amx_tile")
                                                        if f in flags)


if __name__ == "__main__":
    raise SystemExit(main())
