"""Files written by llama.cpp's own tools, served by the engine and by llama.cpp side by side.

``llama-quantize --allow-requantize`` (built by ``make peer``) writes a GGUF file of each type from
a source file (by default the two real files ``make test`` installs: SmolLM2-135M Q4_1, llama, and
Gemma-3-270M Q4_K_M, gemma3), with llama.cpp's own mixtures and its fallback types for widths that
are not a multiple of 256. Each file is then read by the engine (``load_model``, as ``launch.py``
reads it) and by ``llama-server``; both decode the same prompt ids greedily, and the report gives the
number of leading tokens they agree on, the first differing token of each, and the engine's top-2
margin there (a near tie, or a misread file). Both sides quantise activations their own way, so a
near tie can go either way; a file misread shows as disagreement from the first tokens.

    python -m bench.llama_files                       # every type, both files, 48 tokens
    python -m bench.llama_files --types Q2_K,Q8_0 --source FILE.gguf

Writes ``results/llama-files-<time>.json`` and prints a table.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.peer.llama_cpp import (HOST, PeerConfig, PeerServer, completion_request, free_port, peer_binaries,
                                  server_command)

TYPES = ("Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_0", "Q4_1", "Q4_K_S", "Q4_K_M", "Q5_0", "Q5_1", "Q5_K_S",
         "Q5_K_M", "Q6_K", "Q8_0", "F16", "BF16")
PROMPTS = ("The history of the printing press begins", "def quicksort(items):\n")


@dataclass
class FileAgreement:
    """One written file: its type, what the engine served it as, and where the two greedy decodings part."""

    source: str
    type: str
    stored: str
    prompt: int
    tokens: int
    agree: int          # leading tokens equal
    ours: int | None     # the first differing token of each (None: all agree)
    theirs: int | None
    margin: float | None  # our top-2 logit margin at the first difference (a near tie: small)


def quantize(binary: Path, source: Path, qtype: str, out: Path) -> Path:
    """``source`` re-written as ``qtype`` by llama-quantize (2 threads)."""
    done = subprocess.run([str(binary), "--allow-requantize", str(source), str(out), qtype, "2"],
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"llama-quantize {qtype} failed: {done.stderr[-500:]}")
    return out


def ours_greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """The engine's target alone, greedy: tokens and each step's top-2 margin."""
    from engine.core.runner import run_model
    from engine.core.kv_cache import growing_cache

    cache = growing_cache(model.config)
    ids, tokens, margins = torch.tensor([prompt]), [], []
    with torch.inference_mode():
        logits = run_model(model, cache, ids, torch.arange(len(prompt))[None], None, 0)[-1]
        for step in range(new_tokens):
            top = logits.topk(2)
            tokens.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            position = torch.tensor([[len(prompt) + step]])
            logits = run_model(model, cache, torch.tensor([[tokens[-1]]]), position, None, 0)[-1]
    return tokens, margins


def theirs_greedy(server_binary: Path, path: Path, prompt: list[int], new_tokens: int) -> list[int]:
    port = free_port(HOST)
    with PeerServer(server_command(server_binary, PeerConfig("target-only"), path, None, port), port) as server:
        reply = server.post("/completion", completion_request(prompt, new_tokens))
    return [int(t) for t in reply["tokens"]][:new_tokens]


def compare(source: Path, qtype: str, path: Path, server_binary: Path, new_tokens: int) -> list[FileAgreement]:
    from engine.models.loading import load_model

    model, tokenizer = load_model(str(path), torch.float32, "cpu", False, "auto")
    rows = []
    for index, text in enumerate(PROMPTS):
        prompt = tokenizer(text)["input_ids"]
        ours, margins = ours_greedy(model, prompt, new_tokens)
        theirs = theirs_greedy(server_binary, path, prompt, new_tokens)
        agree = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        differs = agree < min(len(ours), len(theirs))
        rows.append(FileAgreement(source.name, qtype, model.as_stored, index, new_tokens, agree,
                                  ours[agree] if differs else None, theirs[agree] if differs else None,
                                  round(margins[agree], 4) if differs else None))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", action="append", help="a GGUF file to re-quantise (default: the test files)")
    parser.add_argument("--types", default=",".join(TYPES), help="llama-quantize types, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--out", default="results")
    args = parser.parse_args(argv)
    binaries, reason = peer_binaries()
    quantizer = binaries and binaries.server.parent / "llama-quantize"
    if binaries is None or not quantizer.exists():
        print(reason or f"{quantizer} is missing: run `make peer`")
        return 2
    if args.source:
        sources = [Path(s) for s in args.source]
    else:
        import sys
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        import real_gguf
        sources = [real_gguf.smollm2(), real_gguf.gemma3()]
    rows: list[FileAgreement] = []
    with tempfile.TemporaryDirectory() as scratch:
        for source in sources:
            for qtype in args.types.split(","):
                path = quantize(quantizer, source, qtype, Path(scratch) / f"{source.stem}-{qtype}.gguf")
                found = compare(source, qtype, path, binaries.server, args.new_tokens)
                rows += found
                for row in found:
                    print(f"{row.source[:28]:28} {row.type:7} prompt {row.prompt}: {row.agree:3}/{row.tokens} agree"
                          f"{'' if row.ours is None else f', then ours {row.ours} / theirs {row.theirs}, margin {row.margin}'}"
                          f"  [{row.stored}]", flush=True)
                path.unlink()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    saved = out / f"llama-files-{time.strftime('%Y%m%d-%H%M%S')}.json"
    saved.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    print(f"saved {saved}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
