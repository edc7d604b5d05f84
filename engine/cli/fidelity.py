"""Command line: ``python -m engine.cli.fidelity`` measures how the int4 target (the GGUF's own
Q4_K/Q6_K blocks through the k-quant kernels) differs from the float32 target (the dequantised
values) on the bundled prompts: on the float32 target's own greedy answers, how often the two pick
the same next token, the mean KL divergence of their next-token distributions, and each model's
perplexity; and how many tokens the two greedy answers share before they first differ."""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine.models.prompts import encode_chat, load_prompt_set


@dataclass
class Fidelity:
    """Per-position comparisons pooled over answers: ``positions`` answer tokens scored."""

    positions: int
    top1_agreement: float       # share of positions where both models' argmax agree
    mean_kl: float              # mean KL(reference || other) of the next-token laws, nats
    reference_perplexity: float
    other_perplexity: float


def answer_log_probs(model: torch.nn.Module, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """Log-probabilities ``[len(answer), V]`` of ``model``'s next token at each answer position
    (teacher-forced: one causal pass over ``prompt + answer``)."""
    ids = torch.tensor([prompt + answer])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1: -1].float()
    return torch.log_softmax(logits, dim=-1)


def compare(reference: list[torch.Tensor], other: list[torch.Tensor], answers: list[list[int]]) -> Fidelity:
    """Pooled comparison of log-probabilities ``[L_i, V]`` of two models over the same ``answers``."""
    agree = kl = ref_nll = other_nll = 0.0
    count = 0
    for ref, oth, answer in zip(reference, other, answers):
        tokens = torch.tensor(answer)[:, None]
        agree += float((ref.argmax(-1) == oth.argmax(-1)).sum())
        kl += float((ref.exp() * (ref - oth)).sum())
        ref_nll -= float(ref.gather(1, tokens).sum())
        other_nll -= float(oth.gather(1, tokens).sum())
        count += len(answer)
    return Fidelity(count, agree / count, kl / count, math.exp(ref_nll / count), math.exp(other_nll / count))


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two answers share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def greedy_answer(model: torch.nn.Module, prompt: list[int], max_new_tokens: int, stop_ids: list[int]) -> list[int]:
    """``model``'s own greedy answer (its ``generate``), without the stop token."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=stop_ids, pad_token_id=stop_ids[0])[0, len(prompt):].tolist()
    return [t for t in out if t not in stop_ids][:max_new_tokens]


def main(argv: list[str] | None = None) -> None:
    from engine.models.loading import load_model

    parser = argparse.ArgumentParser(prog="python -m engine.cli.fidelity", description=__doc__)
    parser.add_argument("--prompts", type=int, default=10, help="bundled chat prompts")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens of each greedy answer")
    parser.add_argument("--out", type=Path, default=Path("results/fidelity-int4-vs-float32.json"))
    args = parser.parse_args(argv)
    reference, tokenizer = load_model("default-target", torch.float32, "cpu", False, "none")
    int4, _ = load_model("default-target", torch.float32, "cpu", False, "q4k")
    stop_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    prompts = [encode_chat(tokenizer, p["messages"]) for p in load_prompt_set("chat")[: args.prompts]]
    answers, int4_answers, ref_lp, int4_lp = [], [], [], []
    for i, prompt in enumerate(prompts):
        answer = greedy_answer(reference, prompt, args.new_tokens, stop_ids)
        mine = greedy_answer(int4, prompt, args.new_tokens, stop_ids)
        answers.append(answer)
        int4_answers.append(mine)
        ref_lp.append(answer_log_probs(reference, prompt, answer))
        int4_lp.append(answer_log_probs(int4, prompt, answer))
        print(f"prompt {i}: {len(answer)} tokens; greedy answers share the first {shared_prefix(answer, mine)}", flush=True)
    result = compare(ref_lp, int4_lp, answers)
    shared = [shared_prefix(a, b) for a, b in zip(answers, int4_answers)]
    identical = sum(a == b for a, b in zip(answers, int4_answers))
    print(f"on the float32 target's greedy answers ({result.positions} tokens, {len(prompts)} prompts): "
          f"top-1 agreement {result.top1_agreement:.4f}, mean KL {result.mean_kl:.5f} nats, "
          f"perplexity float32 {result.reference_perplexity:.4f} / int4 {result.other_perplexity:.4f}; "
          f"greedy answers identical on {identical} of {len(prompts)} prompts", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**asdict(result), "prompts": len(prompts), "new_tokens": args.new_tokens,
                                    "identical_answers": identical, "shared_prefix": shared}, indent=2))
    print(f"saved {args.out}")


if __name__ == "__main__":
    from engine.backends.hugepages import restart_with_huge_pages

    restart_with_huge_pages()
    main()
