"""Generate text from the command line.

    python -m mlx_eagle.generate --prompt "What is the capital of France?"
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Sequence

from .cli import UserError, blas_in_use, run_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mlx_eagle.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="MLX or Hugging Face directory, .gguf file or Hugging Face repo id "
                                        "(default: SmolLM2-135M-Instruct)")
    parser.add_argument("--prompt", "-p", default="Hello!", help="the user message; '-' reads standard input")
    parser.add_argument("--system", help="a system prompt")
    parser.add_argument("--max-tokens", "-m", type=int, default=256)
    parser.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int, help="random seed for sampling")
    parser.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    parser.add_argument("--verbose", action="store_true", help="report speed, memory and the BLAS in use")
    return parser


def prompt_tokens(tokenizer, prompt: str, system: Optional[str], use_chat_template: bool) -> List[int]:
    if use_chat_template and tokenizer.chat_template is not None:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    text = f"{system}\n\n{prompt}" if system else prompt
    return tokenizer.encode(text)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from .models import context_length, load_target

    if args.verbose:
        print(f"device: {mx.default_device()}, BLAS: {blas_in_use()}", file=sys.stderr)
    if args.seed is not None:
        mx.random.seed(args.seed)
    model, tokenizer, path = load_target(args.model)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    tokens = prompt_tokens(tokenizer, prompt, args.system, not args.no_chat_template)
    limit = context_length(path)
    if limit is not None and len(tokens) + 1 > limit:
        raise UserError(f"the prompt is {len(tokens)} tokens; the model's context holds {limit}. Shorten it")
    max_tokens = args.max_tokens if limit is None else min(args.max_tokens, limit - len(tokens))
    sampler = make_sampler(args.temp, args.top_p, args.min_p, top_k=args.top_k)
    response = None
    for response in stream_generate(model, tokenizer, tokens, max_tokens=max_tokens, sampler=sampler):
        print(response.text, end="", flush=True)
    print()
    if args.verbose and response is not None:
        print(
            f"prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.1f} tokens/s | "
            f"generation: {response.generation_tokens} tokens, {response.generation_tps:.1f} tokens/s | "
            f"peak memory: {response.peak_memory:.2f} GB",
            file=sys.stderr,
        )


if __name__ == "__main__":
    run_cli(main)
