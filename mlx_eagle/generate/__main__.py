"""Generate text with EAGLE speculative decoding from the command line.

    python -m mlx_eagle.generate --prompt "What is the capital of France?"
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Sequence

import mlx.core as mx

from ..blas import blas_in_use
from ..cli import (
    add_history_arguments,
    add_kv_arguments,
    add_model_arguments,
    add_sampling_arguments,
    history_choice,
    kv_options,
    new_parser,
    run_cli,
)
from ..errors import UserError, check_text
from ..grammar import schema_file_format
from ..progress import PromptProgress
from ..trees import parse_tree


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser("mlx_eagle.generate", __doc__)
    add_model_arguments(parser)
    parser.add_argument("--prompt", "-p", default="Hello!", help="the user message; '-' reads standard input")
    parser.add_argument("--system", help="a system prompt")
    parser.add_argument("--max-tokens", "-m", type=int, default=256, help="longest reply, in tokens")
    add_history_arguments(parser)
    add_sampling_arguments(parser)
    add_kv_arguments(parser)
    parser.add_argument("--stop", action="append", help="stop when this text appears (repeatable)")
    parser.add_argument("--json-schema", metavar="FILE",
                        help="hold the reply to the JSON schema in FILE (structured output; drafting stays on)")
    parser.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    parser.add_argument("--verbose", action="store_true", help="report tau, speed, memory and the BLAS in use")
    return parser


def read_stdin() -> str:
    """The prompt from standard input, which must be UTF-8 text."""
    try:
        return sys.stdin.buffer.read().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"standard input is not UTF-8 text (byte {exc.start}); pass text with --prompt -") from None


def prompt_tokens(tokenizer, prompt: str, system: Optional[str], use_chat_template: bool) -> List[int]:
    from ..replies import chat_tokens

    if use_chat_template:  # a model without a chat template gets chat_tokens' plain rendering
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return chat_tokens(tokenizer, messages)
    text = f"{system}\n\n{prompt}" if system else prompt
    return tokenizer.encode(text)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = build_parser().parse_args(argv)

    from ..distributed import sharding
    from ..generation import check_prompt, print_stats, stream_generate
    from ..plan import load, plan_drafts, user_drafter
    from ..target import kv_quantization
    from ..options import ReplyOptions

    # What is wrong with the arguments (and the prompt) is said before the model loads.
    tree = parse_tree(args.tree) if args.tree != "auto" else "auto"
    response_format = schema_file_format(args.json_schema) if args.json_schema else None
    options = ReplyOptions(max_tokens=args.max_tokens, temp=args.temp, top_p=args.top_p, min_p=args.min_p,
                           top_k=args.top_k, seed=args.seed, stop=args.stop, response_format=response_format)
    kv_quantization(**kv_options(args))
    prompt = read_stdin() if args.prompt == "-" else check_text(args.prompt, "--prompt")
    system = check_text(args.system, "--system") if args.system else None
    user_drafter(args.draft)  # your own drafter, imported now: one line if it cannot be
    history = history_choice(args)
    if args.verbose:
        print(f"device: {mx.default_device()}, BLAS: {blas_in_use()}", file=sys.stderr)
    model, tokenizer = load(args.model, pipeline=args.pipeline)
    if args.verbose and sharding(model):
        print(f"model: {sharding(model)}", file=sys.stderr)
    ids = prompt_tokens(tokenizer, prompt, system, not args.no_chat_template)
    check_prompt(model, ids)  # before planning, which may time this device
    plan = plan_drafts(model, args.draft, tree, lookup=not args.no_lookup, history=history,
                       tokenizer=tokenizer, **kv_options(args))
    for source in plan.sources:
        if source.make is None and source.note:  # a drafter that decided not to draft here says why
            print(f"{'drafting from the context alone' if plan.active else 'decoding plainly'}: {source.note}",
                  file=sys.stderr)
        elif args.verbose and source.note:
            print(f"{source.name}: {source.note}", file=sys.stderr)
    if args.verbose:
        print(f"drafts: {plan.describe()}", file=sys.stderr)
    response = None
    for response in stream_generate(model, tokenizer, ids, draft=plan, prompt_progress_callback=PromptProgress(),
                                    options=options, **kv_options(args)):
        print(response.text, end="", flush=True)
    print()
    if args.verbose and response is not None:
        print_stats(response)


def cli() -> None:
    """Console-script entry point."""
    run_cli(main)


if __name__ == "__main__":
    cli()
