"""Files written by llama.cpp's own converter: tiny random Hugging Face models of each architecture
go through ``convert_hf_to_gguf.py`` (from the llama.cpp source ``make peer`` unpacks) and
``llama-quantize`` into each type; the engine serves each file, and its teacher-forced logits are
compared with the Hugging Face model the file came from (F32/F16/BF16: only rounding apart) and with
transformers' own GGUF reader of the same file (the same stored blocks, dequantised independently).

The models: llama (Llama 3 rope scaling, which the converter stores as ``rope_freqs``, and SmolLM2's
tokenizer), qwen2 and qwen3 (the Qwen2.5 tokenizer of the embedded draft), 2 layers of 256, with
the weight scales of ``tests/tiny_gguf.py`` (peaked logits). The converter needs ``sentencepiece``
for the Qwen families (``pip install sentencepiece``).

    python -m bench.llama_convert [--archs llama,qwen2,qwen3] [--types F32,Q8_0,Q4_K_M,...]

Prints a line a file and writes ``results/llama-convert-<time>.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_1", "Q4_K_M", "Q4_0", "Q3_K_M", "Q2_K")
CONFIGS = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}
TEXT = "The quick brown fox jumps over the lazy dog. In Python, a list comprehension builds a list; " \
       "Paris is the capital of France."


def tokenizers() -> dict[str, object]:
    """SmolLM2's tokenizer (llama) and the embedded draft's (the Qwen families), read from their GGUF files."""
    sys.path.insert(0, str(ROOT / "tests"))
    import real_gguf
    from transformers import AutoTokenizer

    from engine.models.loading import DEFAULT_DRAFT, assemble_gguf

    smol, qwen = real_gguf.smollm2(), assemble_gguf(DEFAULT_DRAFT)
    return {"llama": AutoTokenizer.from_pretrained(smol.parent, gguf_file=smol.name),
            "qwen": AutoTokenizer.from_pretrained(qwen.parent, gguf_file=qwen.name)}


def tiny_model(arch: str, tokenizer):
    """A random 2-layer model of ``arch`` over ``tokenizer``'s vocabulary (tests/tiny_gguf.py's scales)."""
    import tiny_gguf
    import transformers

    rope = {"rope_type": "default", "rope_theta": tiny_gguf.SPECS[arch].rope_theta}
    if arch == "llama":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 128}
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    config = getattr(transformers, CONFIGS[arch])(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=128 if arch == "qwen3" else 64,
        max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=bos,
        eos_token_id=tokenizer.eos_token_id, rope_parameters=rope)
    return tiny_gguf.build_hf_model(arch, config, seed=3)


def agreement(mine: torch.Tensor, theirs: torch.Tensor) -> tuple[float, float]:
    """``(top-1 agreement, worst |Δ logit| over the position's logit range)``."""
    same = (mine.argmax(-1) == theirs.argmax(-1)).double().mean().item()
    worst = ((mine - theirs).abs().amax(-1) / (theirs.amax(-1) - theirs.amin(-1))).max().item()
    return round(same, 3), round(worst, 4)


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM

    from bench.peer.llama_cpp import peer_binaries, peer_dir
    from engine.models.loading import load_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", default=",".join(CONFIGS))
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args(argv)
    binaries, reason = peer_binaries()
    source = peer_dir() / "src"
    quantizer = binaries and binaries.server.parent / "llama-quantize"
    if binaries is None or not quantizer.exists() or not (source / "convert_hf_to_gguf.py").exists():
        print(reason or "llama-quantize or the llama.cpp source is missing: run `make peer`")
        return 2
    sys.path.insert(0, str(ROOT / "tests"))
    toks, rows = tokenizers(), []
    env = {**os.environ, "PYTHONPATH": str(source / "gguf-py")}
    with tempfile.TemporaryDirectory() as scratch:
        os.environ["SEQUOIA_CACHE"] = str(Path(scratch) / "cache")  # the packed layers of throw-away files
        for arch in args.archs.split(","):
            tokenizer = toks["llama" if arch == "llama" else "qwen"]
            ids = torch.tensor([tokenizer(TEXT)["input_ids"]])
            model = tiny_model(arch, tokenizer)
            folder = Path(scratch) / arch
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            f32 = Path(scratch) / f"{arch}-F32.gguf"
            done = subprocess.run([sys.executable, str(source / "convert_hf_to_gguf.py"), str(folder), "--outfile",
                                   str(f32), "--outtype", "f32"], capture_output=True, text=True, env=env)
            if done.returncode:
                print(f"{arch}: convert_hf_to_gguf.py failed: {done.stderr.strip().splitlines()[-1]}")
                continue
            with torch.inference_mode():
                original = model(ids).logits[0]
            for qtype in args.types.split(","):
                path = f32 if qtype == "F32" else Path(scratch) / f"{arch}-{qtype}.gguf"
                if qtype != "F32":
                    subprocess.run([str(quantizer), str(f32), str(path), qtype, "2"], check=True, capture_output=True)
                ours, _ = load_model(str(path), torch.float32, "cpu", False, "auto")
                reader = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32).eval()
                with torch.inference_mode():
                    mine, theirs = ours(ids).logits[0], reader(ids).logits[0]
                row = {"arch": arch, "type": qtype, "stored": ours.as_stored,
                       "native_forward": "lean_forward" in ours.__dict__,
                       "vs_original": agreement(mine, original), "vs_reader": agreement(mine, theirs),
                       "reader_vs_original": agreement(theirs, original)}
                rows.append(row)
                print(f"{arch:6} {qtype:7} ours vs the HF original: top-1 {row['vs_original'][0]:.3f}, worst "
                      f"{row['vs_original'][1]:.4f}; vs transformers' reader of the file: {row['vs_reader'][0]:.3f}, "
                      f"{row['vs_reader'][1]:.4f}; the reader vs the original: {row['reader_vs_original'][1]:.4f}"
                      f"  [{row['stored']}]", flush=True)
                if path != f32:
                    path.unlink()
    args.out.mkdir(parents=True, exist_ok=True)
    saved = args.out / f"llama-convert-{time.strftime('%Y%m%d-%H%M%S')}.json"
    saved.write_text(json.dumps(rows, indent=2))
    print(f"saved {saved}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
